"""``celery -A proj lease ...`` in a Django project acts on Django's database (the
lease store's URL comes from DATABASES once Django is set up, as in a worker)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from tests.helpers import REPO_ROOT

pytestmark = pytest.mark.postgres


def test_lease_cli_uses_djangos_database(django_project: Any, tmp_path):
    from django.db import connection

    env = dict(os.environ)
    for key in ("CELERY_LEASE_DATABASE_URL", "PYTEST_CURRENT_TEST", "PYTEST_ADDOPTS"):
        env.pop(key, None)
    env.update(
        DJANGO_SETTINGS_MODULE="tests.django.proj.settings",
        CELERY_LEASE_DJANGO_DB=connection.settings_dict["NAME"],
        PYTHONPATH=str(REPO_ROOT),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.django.proj", "lease", "migrate"],
        cwd=tmp_path,  # a SQLite default would land here
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert connection.settings_dict["NAME"] in proc.stdout
    assert "schema is up to date" in proc.stdout
    assert list(tmp_path.iterdir()) == []
