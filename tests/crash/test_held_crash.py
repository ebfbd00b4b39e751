"""Crash matrix row 30: a reaper killed while publishing held rows.

Five tasks held in the store until their ETA (``lease_hold_eta_after = 0``, a countdown
of half a second), the reaper's batches two rows long. Once they are due, a
``celery lease reap`` process dies at crash point ``reaper_took_held``: its first
batch is taken (no longer held, reserved for publishing) and committed, nothing is
published. The two rows it took are PENDING, not held, not published; the other three
are still held; the broker's queue is empty. The next sweep (another ``lease reap``)
publishes the three held ones; the worker's embedded reaper publishes the two the dead
reaper took once ``lease_publish_grace`` has passed (the outbox sweep). Each row is
published once, each task runs once, with the audit trail of a run without a fault.
"""

from __future__ import annotations

import re

import pytest
from sqlalchemy import select

from celery_lease import State
from celery_lease.check import check
from celery_lease.config import TUNING_ENV

from ..helpers import wait_until
from .faults import assert_crashed, run_reaper
from .support import CLEAN_RUN, LeaseEnv, queue_depth


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [
        pytest.param("redis", "sqlite", id="redis-sqlite"),
        pytest.param("amqp", "postgresql", id="amqp-postgresql", marks=pytest.mark.postgres),
    ],
    indirect=True,
)
def test_row30_reaper_killed_while_publishing_held_rows(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = lease_env.project(
        broker_url=broker_url, hold_eta_after=0.0, env={TUNING_ENV: "reaper_batch_size=2"}
    )
    keys = [f"k{i}" for i in range(5)]
    ids = {key: p.submit("t.work", key, countdown=0.5) for key in keys}
    assert sorted(h.id for h in p.store.held()) == sorted(ids.values())
    latest = max(p.get(t).eta for t in ids.values())  # type: ignore[type-var]
    wait_until(lambda: p.store.database_time() >= latest, timeout=30, message="all due")

    died = run_reaper(p.project, crash_at="reaper_took_held")
    assert_crashed(died, "reaper_took_held")
    still_held = {h.id for h in p.store.held()}
    taken = set(ids.values()) - still_held
    assert len(still_held) == 3 and len(taken) == 2
    for task_id in taken:
        record = p.get(task_id)
        assert record.state is State.PENDING and record.published_at is None
    assert queue_depth(broker_url, p.project.queue) == 0

    swept = run_reaper(p.project, crash_at=None)
    assert swept.returncode == 0, swept.stderr
    found = re.search(r"released=(\d+)", swept.stdout)
    assert found and int(found.group(1)) == 3, swept.stdout
    assert p.store.held() == []

    worker = p.worker("after-row30")  # its reaper publishes the two taken, after the grace
    for key, task_id in ids.items():
        record = p.wait_state(task_id, State.SUCCEEDED, timeout=60)
        assert record.attempt == 1 and record.recoveries == 0
        assert record.result == {"key": key, "node": worker.nodename}
        assert p.trail(task_id) == CLEAN_RUN, (key, p.trail(task_id))
    p.drain()
    for key in keys:
        assert p.external.count(f"start:{key}") == 1, key
        assert p.external.count(f"done:{key}") == 1, key
    t = p.store.t.tasks
    with p.store.engine.connect() as conn:
        counts = conn.execute(select(t.c.publish_count).where(t.c.id.in_(list(ids.values()))))
        assert sorted(counts.scalars()) == [1] * len(keys)  # each published once
    assert check(p.store, liveness=False) == []
