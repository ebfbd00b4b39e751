"""Crash-point matrix row 27: a worker SIGKILLed while its task holds a concurrency
slot. The slot is freed only by the reaper's decision (the lease's expiry, once the dead
owner's heartbeat is a TTL old), never by a guess; the row waiting for it starts after
that decision, and the limit is never exceeded, as the audit trail shows.
"""

from __future__ import annotations

import itertools
import signal

import pytest

from celery_lease import State

from ..helpers import wait_until
from .support import TASKS, LeaseEnv, released

SOURCE = (
    TASKS
    + '''

@app.task(base=LeasedTask, bind=True, shared=False, name="t.limited", concurrency_limit=1)
def limited(self, key, gate=None):
    """``work`` with one slot across the cluster."""
    return body(self, key, gate)
'''
)


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [pytest.param("redis", "postgresql", id="redis-postgresql", marks=pytest.mark.postgres)],
    indirect=True,
)
def test_a_killed_slot_holder_frees_its_slot_only_by_the_reapers_decision(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = lease_env.project(broker_url=broker_url, source=SOURCE)  # lease_ttl 1 s
    workers = {w.nodename: w for w in (p.worker("a", concurrency=2), p.worker("b", concurrency=2))}
    gate = p.gates.hold("gate")
    with released(p.gates, gate):
        holder = p.submit("t.limited", "one", gate)
        p.wait_count("start:one", 1)
        waiter = p.submit("t.limited", "two", gate)
        wait_until(
            lambda: (p.get(waiter).reason or "").startswith("waiting for a slot of t.limited"),
            message="the second task waits for the slot",
        )
        (first,) = lease_env.external.effects("start:one")
        victim = workers.pop(str(first.payload))
        (survivor,) = workers.values()
        victim_id = p.incarnation(victim)
        victim.kill_group(signal.SIGKILL)
        victim.wait_group_gone()
    for task_id in (holder, waiter):
        p.wait_state(task_id, State.SUCCEEDED, timeout=30)

    trails = {t: p.store.history(t) for t in (holder, waiter)}
    (expiry,) = [r for r in trails[holder] if r.to_state is State.TIMEOUT]
    assert expiry.actor == f"reaper:{survivor.nodename}"
    assert expiry.reason is not None and "heartbeat older than the TTL" in expiry.reason
    (dead,) = [w for w in p.store.workers() if w.id == victim_id]
    assert (expiry.at - dead.heartbeat_at).total_seconds() >= 1.0  # the TTL, in db time
    # the waiting row got the slot after the reaper's decision, not before
    (started,) = [r for r in trails[waiter] if r.to_state is State.RUNNING]
    assert started.at >= expiry.at
    # the slot was never held twice: RUNNING spans of the limited task never overlap
    spans = []
    for trail in trails.values():
        began = None
        for r in trail:
            if r.to_state is State.RUNNING:
                began = r.at
            elif r.from_state is State.RUNNING and began is not None:
                spans.append((began, r.at))
                began = None
    spans.sort()
    assert all(earlier[1] <= later[0] for earlier, later in itertools.pairwise(spans))
    assert p.get(holder).attempt == 2 and p.get(waiter).attempt == 1
    assert lease_env.external.count("done:one") == 1
    assert lease_env.external.count("done:two") == 1
    (usage,) = p.store.slot_usage()
    assert (usage.running, usage.granted, usage.waiting) == (0, 0, 0)
