"""Fixtures for the Django integration: a real Django project (``tests/django/proj``) on
a real PostgreSQL test database, set up with ``django.test.utils`` (no pytest-django).

- ``django_project`` (session): ``django.setup()``, the test environment, and the test
  database ``test_celery_lease_django``, created and migrated by Django's own runner, so
  the lease tables come from the app's migration. Dropped at the end.
- ``db``: each test runs in a transaction rolled back afterwards (users, permissions,
  django-celery-results rows). The lease tables are written by the lease store's own
  connections (committed), so ``lease`` empties them before each test instead.
- ``lease``: a :class:`LeaseRows` factory that puts tasks into each state through the
  store's real operations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from ..conftest import turn

SETTINGS_MODULE = "tests.django.proj.settings"

# the lease store must follow Django's test database, not a URL meant for other tests
_ENV_URL = "CELERY_LEASE_DATABASE_URL"


@pytest.fixture(scope="session")
def django_project() -> Iterator[Any]:
    """Django set up with the test project; its PostgreSQL test database migrated."""
    import django
    from django.conf import settings
    from django.test.utils import (
        setup_databases,
        setup_test_environment,
        teardown_databases,
        teardown_test_environment,
    )

    if settings.configured and getattr(settings, "SETTINGS_MODULE", None) != SETTINGS_MODULE:
        pytest.fail(
            f"Django is already configured with {settings.SETTINGS_MODULE!r} in this process; "
            f"the Django tests need {SETTINGS_MODULE} (share it rather than configure another)",
            pytrace=False,
        )
    saved_url = os.environ.pop(_ENV_URL, None)
    # a queue of this test session's own, on the Redis db of these tests (14)
    os.environ.setdefault("CELERY_LEASE_TEST_DJANGO_QUEUE", f"lease-django-{uuid.uuid4().hex[:10]}")
    os.environ["DJANGO_SETTINGS_MODULE"] = SETTINGS_MODULE
    try:
        django.setup()
    finally:
        # Celery installs its Django fixup in every app created while this variable is
        # set, and worker processes of other suites would inherit it: only set it up here
        del os.environ["DJANGO_SETTINGS_MODULE"]
    setup_test_environment()
    try:
        with turn(exclusive=False, label="django test database"):  # never while a service restarts
            old = setup_databases(verbosity=0, interactive=False, keepdb=False)
    except Exception as exc:
        teardown_test_environment()
        pytest.fail(f"cannot create the Django test database: {exc}", pytrace=False)
    from celery_lease._runtime import runtime
    from celery_lease.contrib.django import close_connections, lease_app

    app = lease_app()
    try:
        yield app
    finally:
        from celery_lease import notify

        _forget_queue(app)

        store = runtime(app)._store
        if store is not None:
            notify.flush(store, 10)
        close_connections()
        _close_other_sessions()
        with turn(exclusive=False, label="django test database teardown"):
            teardown_databases(old, verbosity=0)
        teardown_test_environment()
        if saved_url is not None:
            os.environ[_ENV_URL] = saved_url


def _forget_queue(app: Any) -> None:
    """Delete this session's queue and kombu's binding keys for it (Redis db 14 only)."""
    import redis

    queue = app.conf.task_default_queue
    client = redis.Redis.from_url(app.conf.broker_url, socket_connect_timeout=5)
    try:
        for key in list(client.scan_iter(match=f"*{queue}*")):
            client.delete(key)
    except redis.RedisError:
        pass  # leftover keys of a unique queue name harm nobody
    finally:
        client.close()


def _close_other_sessions() -> None:
    """End connections to the test database that threads of this process left open
    (the result-backend notifier's Django connection), or DROP DATABASE would wait."""
    from django.db import connection

    name = connection.settings_dict["NAME"]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            [name],
        )
    connection.close()


@pytest.fixture
def db(django_project: Any) -> Iterator[None]:
    """Django's connection in a transaction rolled back after the test."""
    from django.db import connection, transaction

    if connection.connection is not None and not connection.is_usable():
        # the server restarted since the last test (an exclusive test of another xdist
        # worker): Django reconnects on first use
        connection.close()
    atomic = transaction.atomic()
    atomic.__enter__()
    try:
        yield
    finally:
        transaction.set_rollback(True)
        atomic.__exit__(None, None, None)


# -- lease rows in every state, made by the store's own operations ------------------------


@dataclasses.dataclass
class LeaseRows:
    """Creates leased tasks in a given state through the real store operations."""

    app: Any

    @property
    def store(self) -> Any:
        from celery_lease._runtime import runtime

        return runtime(self.app).store

    def clear(self) -> None:
        from sqlalchemy import delete

        t = self.store.t
        with self.store.engine.begin() as conn:
            for table in (t.steps, t.transitions, t.tasks, t.workers, t.pauses, t.pause_log):
                conn.execute(delete(table))

    def worker(self, nodename: str = "w1@lease-test") -> str:
        worker_id = uuid.uuid4().hex
        self.store.register_worker(worker_id, nodename, "lease-test", 4242)
        return worker_id

    def make(
        self,
        state: str,
        *,
        name: str = "proj.tasks.charge",
        worker: str | None = None,
        nodename: str = "w1@lease-test",
        dedup_key: str | None = None,
        task_id: str | None = None,
        args: Any = (1, 2),
    ) -> str:
        """A task in ``state`` (one of PENDING, RUNNING, SUCCEEDED, FAILED, RETRY_WAIT,
        WAIT_MANUAL, CANCELLED); WAIT_MANUAL tasks have a non-idempotent step whose
        outcome is unknown, and every claimed task has one completed step."""
        from celery_lease.states import State
        from celery_lease.store import NewTask

        target = State(state)
        tid = task_id or str(uuid.uuid4())
        store = self.store
        store.submit(
            NewTask(
                id=tid,
                name=name,
                args=json.dumps(list(args)),
                kwargs=json.dumps({"order": 17}),
                options="{}",
                lease_ttl=30.0,
                max_recoveries=5,
                dedup_key=dedup_key,
            )
        )
        if target is State.PENDING:
            return tid
        if target is State.CANCELLED:
            store.request_cancel(tid, actor="producer", reason="no longer needed")
            return tid
        owner = worker or self.worker(nodename)
        claim = store.claim(tid, owner, f"worker:{nodename}")
        lease = claim.lease
        store.step_done(lease, "reserve stock", json.dumps({"reserved": 3}), idempotent=True)
        actor = f"worker:{nodename}"
        if target is State.RUNNING:
            pass
        elif target is State.SUCCEEDED:
            store.finish(lease, target, actor=actor, reason="succeeded", result='{"ok": true}')
        elif target is State.FAILED:
            store.finish(
                lease, target, actor=actor, reason="ValueError: card declined", error="ValueError"
            )
        elif target is State.RETRY_WAIT:
            # a lease expiry the policy retries (a worker's own retry is published
            # at once, so it rests in PENDING)
            store.expire(
                actor="reaper:lease-test",
                reason="retry: gateway busy",
                task_ids=[tid],
                only_expired=False,
            )
        elif target is State.WAIT_MANUAL:
            store.step_started(lease, "charge card", checkable=False)
            store.expire(
                actor="reaper:lease-test",
                reason="worker lost",
                task_ids=[tid],
                only_expired=False,
            )
        else:
            raise ValueError(f"cannot make a task in {state}")
        record = store.get(tid)
        assert record is not None and record.state is target, (tid, record)
        return tid

    def state(self, task_id: str) -> str:
        record = self.store.get(task_id)
        assert record is not None, task_id
        return str(record.state.value)

    def trail(self, task_id: str) -> list[Any]:
        return list(self.store.history(task_id))


@pytest.fixture
def lease(django_project: Any) -> Iterator[LeaseRows]:
    """Empty lease tables and a factory of rows in every state."""
    rows = LeaseRows(django_project)
    rows.clear()
    yield rows
    with contextlib.suppress(Exception):
        from celery_lease import notify

        notify.flush(rows.store, 10)


# -- users --------------------------------------------------------------------------------


@pytest.fixture
def make_user(db: None) -> Any:
    """``make_user(name, *codenames, superuser=False)``: a staff user holding
    ``celery_lease.<codename>`` permissions."""
    from django.contrib.auth.models import Permission, User

    def make(name: str, *codenames: str, superuser: bool = False) -> Any:
        if superuser:
            return User.objects.create_superuser(name, f"{name}@example.com", "pw")
        user = User.objects.create_user(name, f"{name}@example.com", "pw", is_staff=True)
        for codename in codenames:
            user.user_permissions.add(
                Permission.objects.get(content_type__app_label="celery_lease", codename=codename)
            )
        return User.objects.get(pk=user.pk)  # fresh: permission cache empty

    return make


@pytest.fixture
def client_for(db: None) -> Any:
    """``client_for(user)``: a Django test client logged in as ``user``."""
    from django.test import Client

    def make(user: Any) -> Any:
        client = Client()
        client.force_login(user)
        return client

    return make
