"""The lease admin against a database that black-holes (accepts, never answers) or
refuses: every page and action ends with a 503 page that says the lease store is
unavailable (within ``lease_db_timeout``, not a hang, not a 500), changes nothing, and
the admin works again once the database answers.

Run in a subprocess (``tests/django/blackhole_admin.py``): this pytest process has
Django set up with the lease tables on its default database, while the faults need
them on an alias of their own behind the TCP proxies of the crash suite
(:class:`tests.crash.faults.TcpProxy`), which the subprocess starts. A hang would end
in this test's subprocess timeout, not in a timing assertion.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import PG_ADMIN_URL, pg_execute
from tests.helpers import REPO_ROOT

pytestmark = pytest.mark.postgres

#: Every page and action asked while the database black-holes.
ASKED = (
    "list",
    "detail",
    "action",
    "detail_action",
    "all_matching",
    "pauses",
    "pause",
    "workers",
)


@pytest.fixture
def database() -> Iterator[str]:
    """A PostgreSQL database of this test's own (its direct URL)."""
    from psycopg import sql
    from sqlalchemy.engine import make_url

    name = f"celery_lease_dj_unavailable_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(name)
    pg_execute(PG_ADMIN_URL, sql.SQL("CREATE DATABASE {}").format(ident))
    try:
        yield make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        pg_execute(PG_ADMIN_URL, sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))


def run_admin_under_faults(database: str, tmp_path: Path) -> dict:
    env = dict(os.environ)
    for name in ("CELERY_LEASE_DATABASE_URL", "PYTEST_CURRENT_TEST"):
        env.pop(name, None)
    env.update(
        DJANGO_SETTINGS_MODULE="tests.django.proj.settings_blackhole",
        CELERY_LEASE_BH_URL=database,
        CELERY_LEASE_BH_SQLITE=str(tmp_path / "django.sqlite3"),
        PYTHONPATH=str(REPO_ROOT),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "tests.django.blackhole_admin"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    sys.stderr.write(proc.stderr[-3000:])  # the durations, shown with -s
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(json.loads(proc.stdout))


def assert_unavailable(seen: dict, label: str, *, timed_out: bool) -> None:
    assert seen["status"] == 503, (label, seen)
    assert seen["body_says_unavailable"], (label, seen)
    assert seen["retry_after"], (label, seen)
    error = seen["error"] or ""
    assert "unavailable" in error, (label, error)
    if timed_out:
        assert "lease_db_timeout" in error, (label, error)
    assert not any(level == "success" for level, _ in seen["messages"]), (label, seen)


def test_admin_answers_503_while_the_database_black_holes_and_loses_nothing(
    database: str, tmp_path: Path
):
    out = run_admin_under_faults(database, tmp_path)
    ids = out["ids"]

    assert out["before"]["status"] == 200
    # the store's database does not answer: each page and action, reads and writes
    for label in ASKED:
        assert_unavailable(out[f"blackhole_{label}"], label, timed_out=True)
    # the store answers, Django's own connection to the lease tables does not
    for label in ("django_only_list", "django_only_detail"):
        seen = out[label]
        assert_unavailable(seen, label, timed_out=True)
        assert "DATABASES['lease']" in seen["error"], seen
    assert out["resumed_list"]["status"] == 200
    # refused connections end the same way, without waiting for the bound
    assert_unavailable(out["refused_list"], "refused_list", timed_out=False)
    assert_unavailable(out["refused_action"], "refused_action", timed_out=False)
    # back: the admin works again, through fresh connections
    assert out["restored_list"]["status"] == 200
    assert out["restored_action"]["status"] == 302

    # nothing was lost or half-done: read the store directly, not through the proxies
    from celery_lease.config import LeaseConfig
    from celery_lease.store import Store

    store = Store(LeaseConfig(database_url=database))
    try:
        states = {key: store.get(task_id).state.value for key, task_id in ids.items()}
        assert states == {"manual": "WAIT_MANUAL", "other": "FAILED", "pending": "PENDING"}
        trail = store.history(ids["manual"])
        assert [t.to_state.value for t in trail] == ["PENDING", "RUNNING", "TIMEOUT", "WAIT_MANUAL"]
        last = store.history(ids["other"])[-1]
        assert (last.to_state.value, last.actor, last.reason) == (
            "FAILED",
            "sam",
            "after the outage",
        )
        assert store.pauses() == [] and store.pause_history() == []
    finally:
        store.dispose()
