"""Crash-point matrix rows 12 and 15: the broker duplicates or loses messages.

- The same task id delivered again while the first copy runs (and after it finished):
  the claim fails, the copy is acked and dropped without running the body.
- Messages lost in the broker (the Redis database flushed before any worker consumed
  them): the rows are PENDING and published; once ``lease_republish_after`` passes,
  the embedded reaper publishes them again and each task runs once.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import redis

from celery_lease import State

from ..helpers import wait_until
from .support import CLEAN_RUN, LeaseEnv, Stopwatch, queue_depth, released, report


@pytest.mark.parametrize(
    ("broker_url", "backend"), [pytest.param("amqp", "sqlite", id="amqp-sqlite")], indirect=True
)
def test_duplicate_delivery_is_dropped_and_the_body_runs_once(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    # acks_late: the busy worker holds its one message, so the copy reaches the idle one
    # (a prefork worker may queue a message behind a busy child: not what is tested here)
    p = lease_env.project(broker_url=broker_url, settings={"task_acks_late": True})
    first = p.worker("first")
    producer = p.project.producer()
    gate = p.gates.hold("gate")
    with released(p.gates, gate):
        task_id = p.submit("t.work", "k", gate)
        p.wait_count("start:k", 1)
        second = p.worker("second")
        producer.send_task("t.work", args=["k", gate], task_id=task_id)
        p.wait_log(second, rf"{task_id}\]: delivery dropped without running \(task is RUNNING\)")
        assert p.get(task_id).attempt == 1
    rec = p.wait_state(task_id, State.SUCCEEDED)

    # and once more after it finished (a redelivery after the outcome write)
    producer.send_task("t.work", args=["k", gate], task_id=task_id)
    p.drain(2)
    dropped = rf"{task_id}\]: delivery dropped without running \(task is SUCCEEDED\)"
    assert any(re.search(dropped, w.log_text()) for w in (first, second))

    assert rec.attempt == 1 and rec.result == {"key": "k", "node": first.nodename}
    # nothing changed, not even a timestamp (heartbeat_at is the owner worker's)
    assert dataclasses.replace(p.get(task_id), heartbeat_at=None) == dataclasses.replace(
        rec, heartbeat_at=None
    )
    assert p.trail(task_id) == CLEAN_RUN
    assert lease_env.external.count("start:k") == 1
    assert lease_env.external.count("done:k") == 1


@pytest.mark.parametrize(
    ("broker_url", "backend"), [pytest.param("redis", "sqlite", id="redis-sqlite")], indirect=True
)
def test_lost_messages_are_republished_and_run_once(
    lease_env: LeaseEnv, broker_url: str, queue_name: str
) -> None:
    p = lease_env.project(broker_url=broker_url, republish_after=1.0)
    keys = [f"k{i}" for i in range(5)]
    ids = [p.submit("t.work", key) for key in keys]
    for task_id in ids:
        assert p.get(task_id).state is State.PENDING
        # "published" is recorded a few milliseconds after the publish, off the hot path
        wait_until(lambda t=task_id: p.get(t).published_at is not None, message="marked")
    assert queue_depth(broker_url, queue_name) == len(keys)

    client = redis.Redis.from_url(broker_url)
    try:
        client.flushdb()  # the broker lost every queued message
    finally:
        client.close()
    assert queue_depth(broker_url, queue_name) == 0

    worker = p.worker(concurrency=2)
    clock = Stopwatch()
    for task_id in ids:
        p.wait_state(task_id, State.SUCCEEDED, timeout=30)
    report("lost messages (republish_after 1 s): worker ready -> all 5 SUCCEEDED", clock.lap())
    worker.wait_log(r"'republished': [1-9]")

    p.drain(2)
    ext = lease_env.external
    for task_id, key in zip(ids, keys, strict=True):
        assert ext.count(f"start:{key}") == 1 and ext.count(f"done:{key}") == 1
        assert p.get(task_id).attempt == 1
        assert p.trail(task_id) == CLEAN_RUN  # re-publishing is not a state change
