"""Crash-point matrix rows 27, 28 and 37, for a task with a concurrency limit.

- Row 27: a worker SIGKILLed while its task holds a slot. The slot is freed only by the
  reaper's decision (the lease's expiry, once the dead owner's heartbeat is a TTL old),
  never by a guess; the row waiting for it starts after that decision, and the limit is
  never exceeded, as the audit trail shows.
- Row 28: a worker frozen (SIGSTOP) while its task holds the slot, thawed after the
  slot went to the task's next attempt: its late outcome is fenced off and frees
  nothing, so a row waiting for the slot still waits until the attempt holding it ends.
- Row 37: the database unreachable while a row waits for the slot: the holder's
  outcome, the free, is kept and written when the database answers, and the waiting
  row starts only then.
"""

from __future__ import annotations

import itertools
import signal
from typing import Any

import pytest

from celery_lease import State

from ..helpers import wait_until
from .faults import proxy_to_postgres
from .support import TASKS, LeaseEnv, pg_only, released

DATABASE_URL_ENV = "TEST_CONF_LEASE_DATABASE_URL"

SOURCE = (
    TASKS
    + '''

@app.task(base=LeasedTask, bind=True, shared=False, name="t.limited", concurrency_limit=1)
def limited(self, key, gate=None):
    """``work`` with one slot across the cluster."""
    return body(self, key, gate)


@app.task(base=LeasedTask, bind=True, shared=False, name="t.limited_twice", concurrency_limit=1)
def limited_twice(self, key, first_gate=None, later_gate=None):
    """One slot; the first attempt waits at ``first_gate``, later ones at ``later_gate``."""
    node = self.request.hostname
    # decided before the start is counted: the test freezes the worker once it sees
    # the count, which may be before this line would run after it
    first = external.count(f"start:{key}") == 0
    external.call(f"start:{key}", payload=node)
    hold(first_gate if first else later_gate)
    external.call(f"done:{key}", payload=node)
    return {"key": key, "node": node}
'''
)


def running_spans(p: Any, task_ids: list[str]) -> list[tuple[Any, Any]]:
    """The RUNNING spans of these tasks in their audit trails, in order."""
    spans = []
    for task_id in task_ids:
        began = None
        for r in p.store.history(task_id):
            if r.to_state is State.RUNNING:
                began = r.at
            elif r.from_state is State.RUNNING and began is not None:
                spans.append((began, r.at))
                began = None
    return sorted(spans)


def never_overlap(spans: list[tuple[Any, Any]]) -> bool:
    return all(earlier[1] <= later[0] for earlier, later in itertools.pairwise(spans))


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [pytest.param("redis", "postgresql", id="redis-postgresql", marks=pytest.mark.postgres)],
    indirect=True,
)
def test_a_killed_slot_holder_frees_its_slot_only_by_the_reapers_decision(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = lease_env.project(broker_url=broker_url, source=SOURCE)  # lease_ttl 1 s
    started = [p.worker(name, concurrency=2, ready=False) for name in ("a", "b")]
    for worker in started:  # started together, waited for together
        worker.wait_ready(timeout=60, store=p.store)
    workers = {w.nodename: w for w in started}
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
    assert never_overlap(running_spans(p, [holder, waiter]))
    assert p.get(holder).attempt == 2 and p.get(waiter).attempt == 1
    assert lease_env.external.count("done:one") == 1
    assert lease_env.external.count("done:two") == 1
    (usage,) = p.store.slot_usage()
    assert (usage.running, usage.granted, usage.waiting) == (0, 0, 0)


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    # as row 11: PostgreSQL (a process frozen inside a SQLite write transaction would
    # block every writer) and Redis (a frozen consumer pulls nothing)
    [pytest.param("redis", "postgresql", id="redis-postgresql", marks=pytest.mark.postgres)],
    indirect=True,
)
def test_a_frozen_slot_holders_late_outcome_frees_nothing(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = lease_env.project(broker_url=broker_url, source=SOURCE)  # lease_ttl 1 s
    frozen = p.worker("frozen", concurrency=2)
    first, later = p.gates.hold("first"), p.gates.hold("later")
    with released(p.gates, first, later):
        holder = p.submit("t.limited_twice", "one", first, later)
        p.wait_count("start:one", 1)
        frozen.kill_group(signal.SIGSTOP)
        other = p.worker("other", concurrency=2)
        # the other worker's reaper expires the frozen lease after the TTL, and the
        # task's next attempt takes the slot there (it waits at the later gate)
        p.wait_count("start:one", 2, timeout=30)
        waiter = p.submit("t.limited_twice", "two")
        wait_until(
            lambda: (p.get(waiter).reason or "").startswith("waiting for a slot"),
            message="the second task waits for the slot",
        )
        p.gates.release(first)
        frozen.kill_group(signal.SIGCONT)
        frozen.wait_log(rf"{holder}\] attempt 1: outcome SUCCEEDED rejected", timeout=20)
        # the late outcome freed nothing: the slot is still the second attempt's
        (usage,) = p.store.slot_usage()
        assert (usage.running, usage.waiting) == (1, 1)
        rec = p.get(waiter)
        assert rec.state is State.PENDING and rec.attempt == 0
        p.gates.release(later)
        for task_id in (holder, waiter):
            p.wait_state(task_id, State.SUCCEEDED, timeout=30)

    rec = p.get(holder)
    assert rec.attempt == 2 and rec.owner == p.incarnation(other)
    outcomes = [r for r in p.store.history(holder) if r.from_state is State.RUNNING]
    assert [(r.to_state, r.attempt) for r in outcomes] == [
        (State.TIMEOUT, 1),
        (State.SUCCEEDED, 2),
    ]
    assert never_overlap(running_spans(p, [holder, waiter]))
    (started,) = [r for r in p.store.history(waiter) if r.to_state is State.RUNNING]
    assert started.at >= outcomes[1].at  # after the attempt holding the slot ended
    assert lease_env.external.count("done:two") == 1
    assert frozen.is_alive()


@pg_only()
def test_row37_database_unreachable_while_rows_wait_for_a_slot(
    lease_env: LeaseEnv, redis_url: str
) -> None:
    # the worker reaches PostgreSQL through a proxy the test cuts while one task holds
    # the only slot and another waits for it; the holder finishes during the outage: its
    # outcome (the free) is kept and written once the database answers, and only then
    # does the waiting task start. A TTL longer than the outage: the worker does not
    # fence itself, so the holder runs once
    p = lease_env.project(
        broker_url=redis_url, source=SOURCE, ttl=20.0, settings={"lease_db_timeout": 1.0}
    )
    with proxy_to_postgres() as proxy:
        worker = p.worker(
            concurrency=2, env={DATABASE_URL_ENV: proxy.url(p.store.config.database_url)}
        )
        gate = p.gates.hold("gate")
        with released(p.gates, gate):
            holder = p.submit("t.limited", "one", gate)
            p.wait_count("start:one", 1)
            waiter = p.submit("t.limited", "two")
            wait_until(
                lambda: "waiting for a slot" in (p.get(waiter).reason or ""),  # type: ignore[union-attr]
                timeout=30,
                message="the second task never waited for the slot",
            )
            proxy.cut()
        # the holder finished with the database away: its outcome is kept, not lost
        p.wait_log(worker, r"outcome writer: .* 1 outcomes kept, retrying", timeout=30)
        assert p.get(holder).state is State.RUNNING  # type: ignore[union-attr]
        assert p.get(waiter).state is State.PENDING  # type: ignore[union-attr]
        assert lease_env.external.count("start:two") == 0
        proxy.restore()
        first = p.wait_state(holder, State.SUCCEEDED, timeout=60)
        second = p.wait_state(waiter, State.SUCCEEDED, timeout=60)
        assert worker.is_alive()
    assert (first.attempt, second.attempt) == (1, 1)
    for key in ("one", "two"):
        assert lease_env.external.count(f"done:{key}") == 1
    spans = running_spans(p, [holder, waiter])
    assert all(b[0] >= a[1] for a, b in itertools.pairwise(spans)), spans
