"""Transactional enqueue from Django (``celery_lease.contrib.django.outbox``).

The task's row is written through Django's own database connection inside the current
``transaction.atomic()`` block; the message goes out from ``transaction.on_commit``.
Each scenario runs in a fresh Python process (Django settings are process-global), on
SQLite and PostgreSQL, and is checked from the test process: rows in the store,
messages in the Redis queue, and, for a commit, a real worker running the task once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import redis
from sqlalchemy.engine import make_url

from celery_lease import State, admin
from celery_lease.store import Store

from ..helpers import WorkerProject, wait_until

TASKS = """
from celery_lease import LeasedTask
from tests.helpers import ExternalSystem

external = ExternalSystem.from_env()


@app.task(base=LeasedTask, bind=True, name="fulfil")
def fulfil(self, order_id):
    return self.step("charge", external.call, "charge", self.idempotency_key("charge"))
"""

SCRIPT = """
import json
import os
import sys

import django
from django.conf import settings

settings.configure(DATABASES={{"default": {database!r}}}, INSTALLED_APPS=[], USE_TZ=True)
django.setup()

from django.db import connection, transaction

from celery_lease import ConfigurationError
from celery_lease.contrib.django.outbox import apply_async_on_commit, delay_on_commit

sys.path[:0] = [{project_dir!r}]
import {module} as proj

ORDERS = {orders!r}
out = {{}}
with connection.cursor() as cursor:
    cursor.execute(f"CREATE TABLE IF NOT EXISTS {{ORDERS}} (id integer primary key)")


def order(pk):
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {{ORDERS}} (id) VALUES (%s)", [pk])


scenario = sys.argv[1]
if scenario == "commit":
    with transaction.atomic():
        order(1)
        out["id"] = delay_on_commit(proj.fulfil, 1).id
        out["before_commit"] = "ok"
elif scenario == "rollback":
    try:
        with transaction.atomic():
            order(1)
            out["id"] = delay_on_commit(proj.fulfil, 1).id
            raise RuntimeError("business rule broken")
    except RuntimeError:
        pass
elif scenario == "savepoint":
    with transaction.atomic():
        out["kept"] = delay_on_commit(proj.fulfil, 1).id
        try:
            with transaction.atomic():
                out["dropped"] = delay_on_commit(proj.fulfil, 2).id
                raise RuntimeError("inner block fails")
        except RuntimeError:
            pass
elif scenario == "autocommit":
    out["id"] = apply_async_on_commit(proj.fulfil, (1,), task_id="django-auto").id
elif scenario == "dedup":
    with transaction.atomic():
        first = apply_async_on_commit(proj.fulfil, (1,), dedup_key="order-1")
        again = apply_async_on_commit(proj.fulfil, (1,), dedup_key="order-1")
        out["ids"] = [first.id, again.id]
elif scenario == "held":
    with transaction.atomic():
        order(1)
        out["id"] = apply_async_on_commit(proj.fulfil, (1,), countdown=3600).id
elif scenario == "crash":
    with transaction.atomic():
        order(1)
        # runs before the task's own on_commit callback: dies right after the commit
        transaction.on_commit(lambda: os._exit(137))
        out["id"] = delay_on_commit(proj.fulfil, 1).id
        print(json.dumps(out), flush=True)
elif scenario == "other-database":
    try:
        delay_on_commit(proj.fulfil, 1)
    except ConfigurationError as error:
        out["error"] = str(error)
elif scenario == "not-leased":
    try:
        delay_on_commit(proj.app.tasks["celery_lease.reap"])
    except ConfigurationError as error:
        out["error"] = str(error)
with connection.cursor() as cursor:
    cursor.execute(f"SELECT id FROM {{ORDERS}} ORDER BY id")
    out["orders"] = [row[0] for row in cursor.fetchall()]
print(json.dumps(out))
"""


class DjangoEnv:
    def __init__(
        self, project: WorkerProject, store: Store, database: dict[str, Any], orders: str, rds: Any
    ) -> None:
        self.project = project
        self.store = store
        self.database = database
        self.orders = orders
        self.redis = rds
        self.app = project.load().app

    def run(self, scenario: str, database: dict[str, Any] | None = None) -> tuple[int, Any]:
        script = SCRIPT.format(
            database=database or self.database,
            project_dir=str(self.project.directory),
            module=self.project.module,
            orders=self.orders if database is None else "orders",
        )
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script), scenario],
            env=self.project.process_env(),
            capture_output=True,
            timeout=60,
        )
        lines = done.stdout.decode().strip().splitlines()
        if done.returncode not in (0, 137) or not lines:
            raise AssertionError(f"{scenario}: exit {done.returncode}\n{done.stderr.decode()}")
        return done.returncode, json.loads(lines[-1])

    def queued(self) -> int:
        return int(self.redis.llen(self.project.queue))


@pytest.fixture
def django_env(
    celery_project: Callable[..., WorkerProject],
    lease_config: Any,
    make_store: Any,
    store_url: str,
    store_schema: str | None,
    backend: str,
    redis_url: str,
) -> Any:
    store = make_store()
    project = celery_project(TASKS, config=lease_config())
    url = make_url(store_url)
    if backend == "sqlite":
        database: dict[str, Any] = {"ENGINE": "django.db.backends.sqlite3", "NAME": url.database}
        orders = "orders"
    else:
        database = {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": url.database,
            "USER": url.username or "",
            "PASSWORD": url.password or "",
            "HOST": url.host or "",
            "PORT": str(url.port or ""),
        }
        orders = f"{store_schema}.orders"
    rds = redis.Redis.from_url(redis_url)
    yield DjangoEnv(project, store, database, orders, rds)
    rds.close()


def test_commit_publishes_from_on_commit_and_the_task_runs_once(django_env, external):
    _, out = django_env.run("commit")
    assert out["orders"] == [1]
    row = django_env.store.get(out["id"])
    assert row.state is State.PENDING and row.published_at is not None
    assert django_env.queued() == 1

    django_env.project.worker().wait_ready(store=django_env.store)
    wait_until(lambda: django_env.store.get(out["id"]).state is State.SUCCEEDED, message="ran")
    assert external.count("charge") == 1


def test_rollback_leaves_no_row_and_publishes_nothing(django_env):
    _, out = django_env.run("rollback")
    assert out["orders"] == []
    assert django_env.store.get(out["id"]) is None
    assert django_env.queued() == 0


def test_a_rolled_back_savepoint_drops_its_task_only(django_env):
    _, out = django_env.run("savepoint")
    assert django_env.store.get(out["dropped"]) is None
    assert django_env.store.get(out["kept"]).published_at is not None
    assert django_env.queued() == 1


def test_outside_a_transaction_the_row_and_the_message_go_at_once(django_env):
    _, out = django_env.run("autocommit")
    assert out["id"] == "django-auto"
    assert django_env.store.get("django-auto").published_at is not None
    assert django_env.queued() == 1


def test_a_dedup_key_submits_once(django_env):
    _, out = django_env.run("dedup")
    first, again = out["ids"]
    assert first == again
    assert django_env.queued() == 1


def test_a_task_due_far_ahead_is_held_and_not_published_on_commit(django_env):
    _, out = django_env.run("held")
    assert out["orders"] == [1]
    row = django_env.store.get(out["id"])
    assert row.state is State.PENDING and row.published_at is None
    assert [h.id for h in django_env.store.held()] == [out["id"]]
    assert django_env.queued() == 0
    assert admin(django_env.app).reap().released == 0  # due in an hour: still held
    assert django_env.queued() == 0


def test_dying_between_commit_and_publish_is_covered_by_the_reaper(django_env, external):
    code, out = django_env.run("crash")
    assert code == 137
    row = django_env.store.get(out["id"])
    assert row is not None and row.state is State.PENDING and row.published_at is None
    assert django_env.queued() == 0

    wait_until(lambda: admin(django_env.app).reap().republished == 1, message="republished")
    django_env.project.worker().wait_ready(store=django_env.store)
    wait_until(lambda: django_env.store.get(out["id"]).state is State.SUCCEEDED, message="ran")
    assert external.count("charge") == 1


def test_another_database_or_a_plain_task_is_refused(django_env, tmp_path):
    other = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "other.sqlite3")}
    _, out = django_env.run("other-database", other)
    assert "not the lease store's database" in out["error"]
    _, out = django_env.run("not-leased")
    assert "needs a LeasedTask" in out["error"]
    assert django_env.queued() == 0
