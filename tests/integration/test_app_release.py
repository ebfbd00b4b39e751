"""An app that is closed and dropped gives back its store: connections and threads.

Celery's pytest fixtures (``celery_app``) build an app per test, and Celery's own
integration suite run with every task leased showed what that cost: each app's store
kept its pooled connection and its background thread for the life of the process, and
a PostgreSQL server's ``max_connections`` ran out after about ninety tests. Here a
fresh process builds apps one after another, each submitting a leased task, closes and
drops them: every app is collected, and so is its store, within its thread's idle
check. Both stores; on PostgreSQL the server's count of the process's connections
falls back to what it was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from ..helpers import REPO_ROOT

CHILD = textwrap.dedent(
    """
    import gc, json, os, sys, weakref
    from celery import Celery
    from celery_lease._runtime import runtime
    from celery_lease.testing import wait_until

    url, schema = os.environ["LEASE_URL"], os.environ.get("LEASE_SCHEMA") or None

    def connections():
        # every session on the store's database but this one (the parent test process
        # holds its own, unchanged while it waits for this one)
        if not url.startswith("postgresql"):
            return 0
        import psycopg
        from sqlalchemy.engine import make_url
        libpq = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        with psycopg.connect(libpq) as conn:
            return conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchone()[0]

    before = connections()
    apps, stores = [], []
    most = 0
    for i in range(4):
        settings = {"lease_database_url": url, "lease_auto_migrate": True}
        if schema:
            settings["lease_schema"] = schema
        app = Celery(f"release{i}", broker="memory://", backend="cache+memory://",
                     set_as_current=False, task_cls="celery_lease:LeasedTask", **settings)

        @app.task(name="release.add")
        def add(x, y):
            return x + y

        add.delay(1, 2)
        stores.append(weakref.ref(runtime(app).store))
        apps.append(weakref.ref(app))
        most = max(most, connections() - before)
        app.close()
        del app, add

    gc.collect()
    alive_apps = sum(r() is not None for r in apps)

    def released():
        gc.collect()
        return all(r() is None for r in stores) and connections() <= before

    wait_until(released, timeout=30, message="every store released")
    print(json.dumps({"alive_apps": alive_apps, "most_connections": most}))
    """
)


def test_a_dropped_app_gives_back_its_store(store_url: str, store_schema: str | None) -> None:
    env = {
        **os.environ,
        "LEASE_URL": store_url,
        "LEASE_SCHEMA": store_schema or "",
        "PYTHONPATH": str(REPO_ROOT),
    }
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["alive_apps"] == 0
    if store_url.startswith("postgresql"):
        assert out["most_connections"] >= 1  # the count above sees the store's connections
