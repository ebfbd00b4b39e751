"""Issue 27, part 2: long delays held in the store (``lease_hold_eta_after``).

A leased task due further ahead than the setting is written, held, and not published:
the broker's queue stays empty; a reaper sweep publishes the stored message when the
ETA is less than one reaper interval away, and a real worker runs it once. A cancel
while held never publishes; two reapers at once publish each row once; with the
setting off the task is published at once, as in plain Celery. On Redis with SQLite and
RabbitMQ with PostgreSQL (the store is what holds; the broker is what must stay empty).

Nothing here sleeps to wait: before a reaper runs (none does until the test starts a
worker or calls one), a held row cannot be published by anyone, so the queue's depth
is read without a race; what is awaited is recorded state (a row's state, the
database's clock passing an ETA).
"""

from __future__ import annotations

import json
import threading
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import select

from celery_lease import State, admin
from celery_lease._runtime import runtime
from celery_lease.exceptions import InvalidSubmissionType, InvalidSubmissionValue
from celery_lease.reaper import Reaper
from celery_lease.store import Store
from celery_lease.store._outcome import RETRY_HELD

from ..crash.support import TASKS, LeasedProject, LeaseEnv, queue_depth
from ..helpers import flush_published, wait_until

BROKERS = pytest.mark.parametrize(
    ("broker_url", "backend"),
    [
        pytest.param("redis", "sqlite", id="redis-sqlite"),
        pytest.param("amqp", "postgresql", id="amqp-postgresql", marks=pytest.mark.postgres),
    ],
    indirect=True,
)


def held_ids(p: LeasedProject) -> list[str]:
    return [h.id for h in p.store.held(limit=10_000)]


def column(p: LeasedProject, task_id: str, name: str) -> Any:
    """One column of a task's row, read as stored."""
    t = p.store.t.tasks
    with p.store.engine.connect() as conn:
        return conn.execute(select(t.c[name]).where(t.c.id == task_id)).scalar_one()


def wait_due(p: LeasedProject, *task_ids: str) -> None:
    """Wait until the database's clock has passed every one of these tasks' ETAs."""
    latest = max(p.get(t).eta for t in task_ids)  # type: ignore[type-var]
    wait_until(lambda: p.store.database_time() >= latest, timeout=30, message="ETA passed")


def worker_name() -> str:
    return f"held-{uuid.uuid4().hex[:8]}"  # a node name of its own: RabbitMQ


@BROKERS
def test_a_held_task_is_not_in_the_broker_until_due_then_runs_once(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = lease_env.project(broker_url=broker_url, hold_eta_after=1.0)
    queue = p.project.queue
    soon = p.submit("t.add", 1, 2, countdown=3)
    eta = datetime.now(timezone.utc) + timedelta(hours=2)
    later = p.submit("t.add", 3, 4, eta=eta)
    flush_published(runtime(p.module.app).store)  # no "published" mark is waiting to be recorded

    # no reaper has run: nobody can have published them
    assert sorted(held_ids(p)) == sorted([soon, later])
    assert held_ids(p)[0] == soon  # soonest first
    assert queue_depth(broker_url, queue) == 0
    for task_id in (soon, later):
        record = p.get(task_id)
        assert record.state is State.PENDING and record.published_at is None
    assert abs((p.get(later).eta - eta).total_seconds()) < 0.001  # type: ignore[operator]

    p.worker(worker_name())  # its embedded reaper publishes what is due
    record = p.wait_state(soon, State.SUCCEEDED, timeout=60)
    assert record.started_at is not None and record.message is not None
    # the stored message was sent, with the ETA Celery gave it: run then, not before
    due = datetime.fromisoformat(json.loads(record.message)["headers"]["eta"])
    assert record.started_at >= due
    assert p.external.count("add") == 1
    assert column(p, soon, "held") is False and column(p, soon, "publish_count") == 1
    assert p.trail(soon) == [(None, "PENDING"), ("PENDING", "RUNNING"), ("RUNNING", "SUCCEEDED")]
    # the one due in two hours is still held, and still not in the broker
    assert held_ids(p) == [later]
    assert p.get(later).state is State.PENDING and p.get(later).published_at is None


@BROKERS
def test_a_sweep_publishes_a_held_task_only_once_it_is_due(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = lease_env.project(broker_url=broker_url, hold_eta_after=0.0)
    queue = p.project.queue
    far = p.submit("t.add", 1, 1, countdown=3600)
    near = p.submit("t.add", 2, 2, countdown=0.5)
    api = admin(p.module.app)

    wait_due(p, near)
    report = api.reap()
    assert report.released == 1
    assert held_ids(p) == [far]
    assert queue_depth(broker_url, queue) == 1  # the one due, not the one an hour ahead
    flush_published(runtime(p.module.app).store)
    assert p.get(near).published_at is not None
    assert api.reap().released == 0  # published once

    p.worker(worker_name())
    p.wait_state(near, State.SUCCEEDED, timeout=60)
    assert p.external.count("add") == 1
    assert p.get(far).state is State.PENDING and held_ids(p) == [far]


@BROKERS
def test_cancelling_a_held_task_never_publishes_it(lease_env: LeaseEnv, broker_url: str) -> None:
    p = lease_env.project(broker_url=broker_url, hold_eta_after=0.0)
    queue = p.project.queue
    task_id = p.submit("t.add", 1, 2, countdown=0.5)
    api = admin(p.module.app)
    assert api.cancel(task_id, reason="not wanted") is State.PENDING
    assert held_ids(p) == []  # a cancelled task is no longer listed as held

    wait_due(p, task_id)
    report = api.reap()  # its ETA has come: its mark is cleared, nothing published
    assert report.released == 0
    assert column(p, task_id, "held") is False
    assert queue_depth(broker_url, queue) == 0
    record = p.get(task_id)
    assert record.state is State.CANCELLED and record.published_at is None
    assert p.trail(task_id) == [(None, "PENDING"), ("PENDING", "CANCELLED")]
    p.worker(worker_name())
    p.drain()  # every message published before has been received: none was this one
    assert p.get(task_id).state is State.CANCELLED and p.external.count("add") == 1


@pytest.mark.parametrize(
    "backend",
    ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)],
    indirect=True,
)
def test_two_reapers_at_once_publish_each_held_row_once(
    lease_env: LeaseEnv, redis_url: str
) -> None:
    n = 250  # more than two reaper batches of 100
    p = lease_env.project(broker_url=redis_url, hold_eta_after=0.0)
    queue = p.project.queue
    submitted = p.module.app.tasks["t.add"].submit_many(
        [{"args": (i, 0), "countdown": 0.5} for i in range(n)]
    )
    ids = [s.task_id for s in submitted]
    assert all(s.created for s in submitted)
    assert len(held_ids(p)) == n and queue_depth(redis_url, queue) == 0  # bulk: held too
    wait_due(p, *ids)

    # two reapers of the app (its broker is the rows' origin), each with its own store
    stores = [Store(runtime(p.module.app).config) for _ in range(2)]
    barrier = threading.Barrier(2)
    counts: list[int] = []
    errors: list[BaseException] = []

    def run(store: Store, actor: str) -> None:
        try:
            reaper = Reaper(p.module.app, actor, store=store)
            barrier.wait(timeout=30)
            counts.append(reaper.publish_held())
        except BaseException as error:  # reported below, in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(s, f"reaper-{i}")) for i, s in enumerate(stores)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for store in stores:
        store.dispose()
    assert errors == []
    assert sum(counts) == n, counts
    assert queue_depth(redis_url, queue) == n  # one message per row
    assert held_ids(p) == []
    flush_published(runtime(p.module.app).store)
    t = p.store.t.tasks
    with p.store.engine.connect() as conn:
        published = conn.execute(select(t.c.publish_count).where(t.c.id.in_(ids))).scalars()
        assert sorted(published) == [1] * n

    p.worker(worker_name(), concurrency=2)
    for task_id in ids:
        p.wait_state(task_id, State.SUCCEEDED, timeout=120)
    assert p.external.count("add") == n


@BROKERS
def test_with_hold_eta_after_none_a_task_is_published_at_once(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = lease_env.project(broker_url=broker_url, hold_eta_after=None)
    assert p.module.app.conf.lease_hold_eta_after is None
    task_id = p.submit("t.add", 1, 2, countdown=3600)
    flush_published(runtime(p.module.app).store)
    assert held_ids(p) == [] and column(p, task_id, "held") is False
    assert p.get(task_id).published_at is not None
    assert queue_depth(broker_url, p.project.queue) == 1  # in the broker, with its ETA
    message = p.get(task_id).message
    assert message is not None and '"eta"' in message


#: A task that retries in an hour (Celery's retry(countdown=...)): held, by default.
RETRY_IN_AN_HOUR = """

@app.task(base=LeasedTask, bind=True, shared=False, name="t.retry_later", max_retries=3)
def retry_later(self):
    external.call("retry_later")
    raise self.retry(countdown=3600, exc=Flaky("later"))
"""


@BROKERS
@pytest.mark.parametrize("write_through", [False, True], ids=["writer", "write-through"])
def test_a_retry_due_in_an_hour_is_held_not_published(
    lease_env: LeaseEnv, broker_url: str, write_through: bool
) -> None:
    # the default lease_hold_eta_after (60 s); both ways a worker writes a retry: the
    # main process's outcome writer, or the pool process itself
    p = lease_env.project(
        broker_url=broker_url,
        source=TASKS + RETRY_IN_AN_HOUR,
        outcome_write_through=write_through,
    )
    task_id = p.submit("t.retry_later")
    p.worker(worker_name())
    wait_until(
        lambda: (r := p.get(task_id)).retries == 1 and r.state is State.PENDING,
        timeout=30,
        message="the retry was recorded",
    )
    record = p.get(task_id)
    assert record.published_at is None and column(p, task_id, "held") is True
    assert held_ids(p) == [task_id]  # lease list --scheduled
    due = record.eta
    assert due is not None and timedelta(minutes=59) < due - p.store.database_time()
    assert p.trail(task_id)[-2:] == [("RUNNING", "RETRY_WAIT"), ("RETRY_WAIT", "PENDING")]
    assert p.store.history(task_id)[-1].reason == RETRY_HELD
    # no worker holds its message for the hour (Celery's view of its ETA tasks)
    scheduled = p.module.app.control.inspect(timeout=2.0).scheduled() or {}
    assert all(not tasks for tasks in scheduled.values()), scheduled
    assert queue_depth(broker_url, p.project.queue) == 0
    assert p.external.count("retry_later") == 1


@BROKERS
def test_a_held_retry_is_published_when_due_and_runs_once(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    # t.retry_then_ok retries in 0.3 s: held with the setting at 0.1 s
    p = lease_env.project(broker_url=broker_url, hold_eta_after=0.1)
    task_id = p.submit("t.retry_then_ok", 1)
    p.worker(worker_name())
    record = p.wait_state(task_id, State.SUCCEEDED, timeout=60)
    assert (record.attempt, record.retries) == (2, 1)
    assert p.external.count("retry_then_ok") == 2
    history = p.store.history(task_id)
    (held,) = [h for h in history if h.from_state is State.RETRY_WAIT]
    assert held.reason == RETRY_HELD
    # the reaper's held sweep published it once; it ran no earlier than its ETA
    assert column(p, task_id, "held") is False and column(p, task_id, "publish_count") == 1
    assert record.eta is not None and record.started_at is not None
    assert record.started_at >= record.eta


def test_hold_eta_after_decides_by_distance(lease_env: LeaseEnv, redis_url: str) -> None:
    # the default, 60 s: a countdown of 30 s is published, one of 120 s held
    p = lease_env.project(broker_url=redis_url)
    assert p.store.config.hold_eta_after == 60.0
    near = p.submit("t.add", 1, 2, countdown=30)
    far = p.submit("t.add", 1, 2, countdown=120)
    naive = p.submit(
        "t.add", 1, 2, eta=datetime.now(timezone.utc).replace(tzinfo=None) + timedelta(hours=3)
    )
    flush_published(runtime(p.module.app).store)
    assert sorted(held_ids(p)) == sorted([far, naive])
    assert p.get(near).published_at is not None
    assert queue_depth(redis_url, p.project.queue) == 1
    # a naive eta is in the app's timezone (UTC here), as Celery reads it
    wait = p.get(naive).eta - p.store.database_time()  # type: ignore[operator]
    assert timedelta(hours=2, minutes=59) < wait <= timedelta(hours=3)


@pytest.mark.parametrize(
    ("eta", "error", "argument"),
    [
        ("tomorrow", InvalidSubmissionValue, "eta"),
        (12345, InvalidSubmissionType, "eta"),
    ],
)
def test_an_eta_that_is_not_a_datetime_is_refused_and_nothing_written(
    lease_env: LeaseEnv, redis_url: str, eta: Any, error: type[Exception], argument: str
) -> None:
    p = lease_env.project(broker_url=redis_url, hold_eta_after=0.0)
    task = p.module.app.tasks["t.add"]
    with pytest.raises(error, match="eta") as raised:
        task.apply_async((1, 2), eta=eta)
    assert raised.value.argument == argument  # type: ignore[attr-defined]
    with pytest.raises(error, match="eta"):
        task.submit_many([{"args": (1, 2), "eta": eta}])
    assert admin(p.module.app).tasks() == []
    assert queue_depth(redis_url, p.project.queue) == 0


def test_a_paused_task_names_held_rows_wait_for_the_resume(
    lease_env: LeaseEnv, redis_url: str
) -> None:
    p = lease_env.project(broker_url=redis_url, hold_eta_after=0.0)
    api = admin(p.module.app)
    api.pause(task="t.add", reason="incident")
    task_id = p.submit("t.add", 1, 2, countdown=0.5)
    wait_due(p, task_id)
    assert api.reap().released == 0  # due, but its task name is paused: still held
    assert held_ids(p) == [task_id]
    assert queue_depth(redis_url, p.project.queue) == 0

    assert api.resume(task="t.add", reason="over")  # its sweep publishes it
    assert held_ids(p) == []
    assert queue_depth(redis_url, p.project.queue) == 1
    p.worker(worker_name())
    p.wait_state(task_id, State.SUCCEEDED, timeout=60)
    assert p.external.count("add") == 1
