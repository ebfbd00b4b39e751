"""Crash matrix rows 1 and 2: the producer dies between writing the row and publishing.

The row is the outbox. A producer process submits one task and dies at a named crash
point (``CELERY_LEASE_CRASH_AT``, ``os._exit(137)``):

* row 1, ``after_insert``: the row is committed, no message exists. The reaper
  publishes it after ``lease_publish_grace``; it runs once.
* row 2, ``after_publish``: the message is in the broker, the row is not marked
  published. The reaper publishes it a second time after the grace (it cannot know
  the first publish happened); the worker runs one copy and drops the other at claim.

Each runs on Redis and RabbitMQ, SQLite and PostgreSQL. Asserted: the exit status of
the producer proves it died at that point; the broker held 0 (row 1) or 1 (row 2)
messages when it died; the task ends SUCCEEDED with the audit trail of a run without a
crash; the counting stub saw one attempt and one effect; no invariant is violated.
"""

from __future__ import annotations

import uuid

import pytest

from celery_lease import State, admin
from celery_lease.check import check

from ..helpers import wait_until
from .faults import assert_crashed, run_producer
from .support import CLEAN_RUN, LeasedProject, LeaseEnv, Stopwatch, queue_depth, report

MATRIX = pytest.mark.parametrize(
    ("broker_url", "backend"),
    [
        pytest.param("redis", "sqlite", id="redis-sqlite"),
        pytest.param("redis", "postgresql", id="redis-postgresql", marks=pytest.mark.postgres),
        pytest.param("amqp", "sqlite", id="amqp-sqlite"),
        pytest.param("amqp", "postgresql", id="amqp-postgresql", marks=pytest.mark.postgres),
    ],
    indirect=True,
)


def queued(p: LeasedProject) -> int:
    """Messages waiting in the project's queue (ready, not delivered to a consumer)."""
    return queue_depth(p.project.broker_url, p.project.queue)


def assert_ran_once(p: LeasedProject, task_id: str, key: str) -> None:
    record = p.wait_state(task_id, State.SUCCEEDED, timeout=60)
    assert record.attempt == 1, record
    assert record.result == {"key": key, "node": "w1@lease-test"}
    assert p.trail(task_id) == CLEAN_RUN
    assert p.external.count(f"start:{key}") == 1
    assert p.external.count(f"done:{key}") == 1


def assert_clean(p: LeasedProject) -> None:
    assert check(p.store, liveness=False) == []


@MATRIX
def test_row1_producer_dies_after_insert_before_publish(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = lease_env.project(broker_url=broker_url)
    task_id, key = uuid.uuid4().hex, "row1"

    died = run_producer(
        p.project, "t.work", [key], crash_at="after_insert", task_id=task_id, dedup_key=key
    )
    assert_crashed(died, "after_insert")

    record = p.get(task_id)
    assert (record.state, record.published_at, record.attempt) == (State.PENDING, None, 0)
    assert queued(p) == 0, "nothing may have been published"

    # the restarted producer submits again under the same dedup key: it gets the same
    # task back and publishes nothing; the outbox (the row) is what gets the task run
    again = p.module.app.tasks["t.work"].apply_async([key], dedup_key=key)
    assert again.id == task_id
    assert queued(p) == 0

    clock = Stopwatch()
    p.worker()
    assert_ran_once(p, task_id, key)
    report("row 1: worker start -> SUCCEEDED (publish grace + one sweep)", clock.lap())
    record = p.get(task_id)
    assert record.published_at is not None
    p.drain()
    assert p.external.count(f"start:{key}") == 1
    assert_clean(p)


@MATRIX
def test_row2_producer_dies_after_publish_before_marking(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = lease_env.project(broker_url=broker_url)
    task_id, key = uuid.uuid4().hex, "row2"

    died = run_producer(p.project, "t.work", [key], crash_at="after_publish", task_id=task_id)
    assert_crashed(died, "after_publish")

    record = p.get(task_id)
    assert (record.state, record.published_at) == (State.PENDING, None)
    assert queued(p) == 1, "the message was published"

    # no worker yet: the reaper cannot tell the message exists and publishes again
    ops = admin(p.module.app)

    def republished() -> bool:
        return ops.reap().republished == 1

    wait_until(republished, timeout=30, interval=0.2, message="the reaper re-published")
    assert queued(p) == 2, "two copies of one task are queued"

    worker = p.worker()
    assert_ran_once(p, task_id, key)
    p.drain()  # every earlier message, the duplicate included, has been received
    worker.wait_log(rf"{task_id}\]: delivery dropped without running", timeout=30)
    assert queued(p) == 0
    assert p.external.count(f"start:{key}") == 1
    assert_clean(p)


def test_crash_points_are_inert_without_the_variable(lease_env: LeaseEnv) -> None:
    """The same producer without ``CELERY_LEASE_CRASH_AT`` returns normally and publishes."""
    p = lease_env.project()
    done = run_producer(p.project, "t.work", ["inert"], crash_at=None, task_id="inert-1")
    assert done.returncode == 0, done.stderr
    assert "PRODUCER RETURNED" in done.stdout
    record = p.get("inert-1")
    assert record.published_at is not None
    assert queued(p) == 1
