"""The Django integration on SQLite (timestamps are REAL epoch seconds there), run in a
subprocess because this pytest process has Django set up on PostgreSQL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO_ROOT


def test_admin_on_sqlite(tmp_path: Path):
    env = dict(os.environ)
    env.pop("CELERY_LEASE_DATABASE_URL", None)
    env.pop("PYTEST_CURRENT_TEST", None)
    env.update(
        DJANGO_SETTINGS_MODULE="tests.django.proj.settings_sqlite",
        CELERY_LEASE_DJANGO_SQLITE=str(tmp_path / "django.sqlite3"),
        PYTHONPATH=str(REPO_ROOT),
    )
    proc = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "tests.django.sqlite_smoke"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    ids = out["ids"]

    assert out["store_url"] == f"sqlite:///{tmp_path / 'django.sqlite3'}"
    assert out["list_status"] == 200
    assert out["listed"] == sorted(ids.values())
    assert out["filtered"] == [ids["manual"]]
    assert out["by_worker"] == [ids["done"]]
    assert out["searched"] == [ids["pending"]]
    assert out["detail_status"] == 200 and out["detail_has_trail"]
    assert out["created_at_shown"].endswith("+00:00")  # an aware datetime from epoch seconds
    assert out["fail_status"] == 302 and out["cancel_status"] == 302
    assert out["states"] == {"manual": "FAILED", "pending": "CANCELLED", "done": "SUCCEEDED"}
    assert out["last_actor"] == "sam"
    assert any(ids["done"] in m and "Nothing was changed" in m for m in out["refused_messages"])
