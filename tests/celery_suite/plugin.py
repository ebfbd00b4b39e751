"""Every task of Celery's own integration suite leased, with no edit to Celery's tests.

Celery's ``t/integration`` fixtures build the app with ``Celery(**celery_parameters)``
(``celery.contrib.pytest``). This plugin, loaded after ``celery.contrib.pytest``
(``-p celery.contrib.pytest -p tests.celery_suite.plugin``), overrides that one fixture:
the app's task class is :class:`celery_lease.LeasedTask`, named by the string Celery
documents for ``task_cls``, and the lease store is the URL in ``CELERY_SUITE_LEASE_DB``
(a SQLite file or a PostgreSQL URL, with the schema in ``CELERY_SUITE_LEASE_SCHEMA``),
created on first use. The lease settings are the defaults a project gets. Everything
else (broker, result backend, the session worker, the tests) is Celery's own.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

#: The environment variable naming the lease store of the leased run.
LEASE_DB_ENV = "CELERY_SUITE_LEASE_DB"
#: PostgreSQL: the schema of the run's tables (created by the migration).
LEASE_SCHEMA_ENV = "CELERY_SUITE_LEASE_SCHEMA"

#: ``task_cls`` in the string form Celery documents.
LEASED_TASK_CLS = "celery_lease:LeasedTask"


@pytest.fixture(scope="session")
def celery_parameters() -> dict[str, Any]:
    """The app's constructor arguments: every task leased, on the run's store."""
    url = os.environ.get(LEASE_DB_ENV)
    if not url:
        raise pytest.UsageError(f"{LEASE_DB_ENV} must name the lease store of the leased run")
    parameters: dict[str, Any] = {
        "task_cls": LEASED_TASK_CLS,
        "lease_database_url": url,
        "lease_auto_migrate": True,
    }
    schema = os.environ.get(LEASE_SCHEMA_ENV)
    if schema:
        parameters["lease_schema"] = schema
    return parameters
