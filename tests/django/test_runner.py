"""``manage.py test`` with the app's test runner: a Django TestCase uses the lease store
on the test database, and the runner still drops that database at the end (PostgreSQL
refuses while the lease store holds connections to it)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from tests.helpers import REPO_ROOT

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


def _databases(prefix: str) -> list[str]:
    import psycopg

    from tests.conftest import PG_ADMIN_URL, _libpq_url

    with psycopg.connect(_libpq_url(PG_ADMIN_URL), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE %s", [prefix + "%"]
        ).fetchall()
    return [r[0] for r in rows]


def test_manage_py_test_with_the_lease_runner():
    from tests.conftest import PG_ADMIN_URL, pg_execute

    name = f"test_celery_lease_runner_{uuid.uuid4().hex[:8]}"
    env = dict(os.environ)
    for key in ("CELERY_LEASE_DATABASE_URL", "PYTEST_CURRENT_TEST", "PYTEST_ADDOPTS"):
        env.pop(key, None)
    env.update(
        DJANGO_SETTINGS_MODULE="tests.django.proj.settings",
        CELERY_LEASE_DJANGO_TEST_DB=name,
        PYTHONPATH=str(REPO_ROOT),
    )
    try:
        proc = subprocess.run(
            [
                sys.executable, "tests/django/manage.py", "test", "tests.django.runner_project",
                "--noinput", "--testrunner", "celery_lease.contrib.django.testing.DiscoverRunner",
            ],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "Ran 1 test" in proc.stderr and "\nOK" in proc.stderr
        assert _databases(name) == []  # dropped despite the lease store's connections
    finally:
        pg_execute(PG_ADMIN_URL, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
