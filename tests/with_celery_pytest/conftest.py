"""Celery's own pytest fixtures (``celery.contrib.pytest``), for this directory only.

A project that tests its tasks the way Celery documents it uses these fixtures:
``celery_app`` and ``celery_worker`` (an in-process worker thread, a task defined in
the test, then ``celery_worker.reload()``), ``celery_session_app`` and
``celery_session_worker``, or ``task_always_eager``. Importing the fixtures here (not
enabling the plugin with ``-p celery.contrib.pytest``) keeps them out of every other
directory; ``pytest-celery`` is not needed.

The lease store is a SQLite file of the test session, set through ``celery_config``
with ``lease_database_url``, as a project would.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery.contrib.pytest import (  # noqa: F401  (fixtures)
    celery_app,
    celery_class_tasks,
    celery_enable_logging,
    celery_includes,
    celery_parameters,
    celery_session_app,
    celery_session_worker,
    celery_worker,
    celery_worker_parameters,
    celery_worker_pool,
    depends_on_current_app,
    use_celery_app_trap,
)


@pytest.fixture(scope="session")
def celery_config(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """In-memory broker and result backend; the lease store on a SQLite file."""
    path = tmp_path_factory.mktemp("celery-pytest") / "lease.sqlite3"
    return {
        "broker_url": "memory://",
        "result_backend": "cache+memory://",
        "lease_database_url": f"sqlite:///{path}",
        "lease_ttl": 5.0,
        "lease_heartbeat_interval": 0.2,
        "lease_reaper_interval": 0.2,
    }
