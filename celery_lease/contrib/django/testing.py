"""A Django test runner for projects using the lease store on their own database.

``TEST_RUNNER = "celery_lease.contrib.django.testing.DiscoverRunner"``: Django's runner,
which also closes the lease store's connections before the test databases are dropped
(PostgreSQL refuses to drop a database that still has sessions). With another runner
(pytest-django, a runner of your own), call
:func:`celery_lease.contrib.django.close_connections` before the databases go.
"""

from __future__ import annotations

from typing import Any

from django.test import runner

from ._conf import close_connections


class DiscoverRunner(runner.DiscoverRunner):
    """``django.test.runner.DiscoverRunner`` that lets go of the lease store's connections
    before it drops the test databases."""

    def teardown_databases(self, old_config: Any, **kwargs: Any) -> None:
        close_connections()
        super().teardown_databases(old_config, **kwargs)


__all__ = ["DiscoverRunner"]
