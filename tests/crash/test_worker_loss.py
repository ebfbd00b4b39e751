"""Crash-point matrix rows 9, 10 and 11: the whole worker is lost.

- SIGKILL of the whole process group, then a restart under the same node name: the new
  incarnation expires its dead predecessor's leases at start-up (no TTL wait).
- SIGKILL of the whole worker while another worker is alive: the other worker's embedded
  reaper expires the lease once the dead owner's heartbeat is older than the TTL.
- A frozen worker (SIGSTOP past the TTL, then SIGCONT): the task is re-run elsewhere and
  the frozen attempt is fenced off; its late outcome is rejected.
"""

from __future__ import annotations

import contextlib
import signal
from typing import Any

import pytest
from sqlalchemy import delete, select

from celery_lease import State

from ..helpers import wait_until
from .support import RECOVERED, LeaseEnv, Stopwatch, released, report


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [
        pytest.param("amqp", "postgresql", id="amqp-postgresql", marks=pytest.mark.postgres),
        pytest.param("redis", "sqlite", id="redis-sqlite"),
    ],
    indirect=True,
)
def test_killed_worker_restarted_under_its_node_name_expires_at_start_up(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    # the worker's own fence is its shortest TTL (the default's, 1 s in the suite): a
    # longer one, so that a loaded machine delaying a renewal cannot fence the restarted
    # worker and add an attempt (nothing here waits for a TTL)
    p = lease_env.project(broker_url=broker_url, ttl=10.0)
    worker = p.worker("node", concurrency=1)
    old = p.incarnation(worker)
    gate = p.gates.hold("gate")
    with released(p.gates, gate):
        task_id = p.submit("t.long_lease", "k", gate)  # lease_ttl=60: no TTL path in this test
        p.wait_count("start:k", 1)
        worker.kill_group(signal.SIGKILL)
        worker.wait_group_gone()
    # nobody else is there to notice: the row still says RUNNING under the dead owner
    rec = p.get(task_id)
    assert rec.state is State.RUNNING and rec.owner == old

    spawned = Stopwatch()
    worker.restart()
    worker.wait_ready(timeout=60, store=p.store)
    ready = Stopwatch()
    p.wait_count("start:k", 2, timeout=20)
    report("restarted worker ready -> re-run started", ready.lap())
    report("restarted worker spawned -> re-run started", spawned.lap())
    rec = p.wait_state(task_id, State.SUCCEEDED)

    new = p.incarnation(worker)
    assert new != old and rec.owner == new
    assert rec.attempt == 2 and rec.recoveries == 1
    assert lease_env.external.count("done:k") == 1
    assert p.trail(task_id) == RECOVERED
    expiry = p.store.history(task_id)[2]
    assert expiry.actor == "worker:node@lease-test"
    assert expiry.reason is not None and "restarted" in expiry.reason
    (previous,) = [w for w in p.store.workers() if w.id == old]
    assert previous.stopped_at is not None and previous.stop_reason is not None
    assert new in previous.stop_reason  # "superseded by restart <new id>"


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [pytest.param("amqp", "sqlite", id="amqp-sqlite")],
    indirect=True,
)
def test_killed_worker_with_another_alive_expires_after_the_ttl(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = lease_env.project(broker_url=broker_url)  # lease_ttl 1 s
    workers = {w.nodename: w for w in (p.worker("a"), p.worker("b"))}
    gate = p.gates.hold("gate")
    with released(p.gates, gate):
        task_id = p.submit("t.work", "k", gate)
        p.wait_count("start:k", 1)
        (first,) = lease_env.external.effects("start:k")
        victim = workers.pop(str(first.payload))
        (survivor,) = workers.values()
        victim_id = p.incarnation(victim)
        victim.kill_group(signal.SIGKILL)
        clock = Stopwatch()
        victim.wait_group_gone()
    p.wait_count("start:k", 2, timeout=30)
    report("lost node (TTL 1 s) -> re-run started", clock.lap())
    rec = p.wait_state(task_id, State.SUCCEEDED)
    report("lost node (TTL 1 s) -> SUCCEEDED", clock.lap())

    assert rec.owner == p.incarnation(survivor) and rec.attempt == 2
    assert rec.result == {"key": "k", "node": survivor.nodename}
    assert [e.payload for e in lease_env.external.effects("done:k")] == [survivor.nodename]
    assert p.trail(task_id) == RECOVERED
    expiry = p.store.history(task_id)[2]
    assert expiry.actor == f"reaper:{survivor.nodename}"
    assert expiry.reason is not None and "heartbeat older than the TTL" in expiry.reason
    # database time: expired only once the dead owner's last heartbeat was a TTL old
    (dead,) = [w for w in p.store.workers() if w.id == victim_id]
    assert dead.stopped_at is None  # nobody said goodbye: only the TTL could tell
    assert (expiry.at - dead.heartbeat_at).total_seconds() >= 1.0


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    # PostgreSQL: a process frozen inside a SQLite write transaction would block every
    # writer until it resumes. Redis: a frozen consumer pulls nothing, whereas RabbitMQ
    # would push re-published messages into the frozen worker's socket
    [pytest.param("redis", "postgresql", id="redis-postgresql", marks=pytest.mark.postgres)],
    indirect=True,
)
def test_frozen_worker_is_fenced_off_and_its_late_outcome_rejected(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = lease_env.project(broker_url=broker_url)  # lease_ttl 1 s
    frozen = p.worker("frozen", concurrency=2)
    gate = p.gates.hold("gate")
    with released(p.gates, gate):
        plain = p.submit("t.work", "plain", gate)  # no steps: only its outcome is fenced
        stepped = p.submit("t.stepped", "stepped", gate)  # its effect is a recorded step
        p.wait_count("start:plain", 1)
        p.wait_count("start:stepped", 1)
        first_owner = p.incarnation(frozen)
        for task_id in (plain, stepped):
            assert p.get(task_id).owner == first_owner

        frozen.kill_group(signal.SIGSTOP)
        other = p.worker("other", concurrency=2)
        # the other worker's reaper expires both leases after the TTL and runs them again
        p.wait_count("start:plain", 2, timeout=30)
        p.wait_count("start:stepped", 2, timeout=30)
        p.gates.release(gate)
        for task_id in (plain, stepped):
            p.wait_state(task_id, State.SUCCEEDED)
        done = {t: p.store.history(t) for t in (plain, stepped)}

        frozen.kill_group(signal.SIGCONT)
        frozen.wait_log(rf"{plain}\] attempt 1: outcome SUCCEEDED rejected", timeout=20)
        frozen.wait_log(rf"{stepped}\]: task {stepped} attempt 1: lease lost", timeout=20)

    second_owner = p.incarnation(other)
    ext = lease_env.external
    for task_id, key in ((plain, "plain"), (stepped, "stepped")):
        rec = p.get(task_id)
        assert rec.state is State.SUCCEEDED and rec.attempt == 2
        assert rec.owner == second_owner
        assert rec.result == {"key": key, "node": other.nodename}
        trail = p.store.history(task_id)
        assert trail == done[task_id], "the frozen attempt changed the row after all"
        assert p.trail(task_id) == RECOVERED
        assert trail[2].actor == "reaper:other@lease-test"
        outcomes = [r for r in trail if r.from_state is State.RUNNING]
        assert [(r.to_state, r.attempt) for r in outcomes] == [
            (State.TIMEOUT, 1),
            (State.SUCCEEDED, 2),
        ]
        assert outcomes[1].actor == "worker:other@lease-test"
    # the stepped task's late attempt stopped at its step boundary: one effect in all
    assert [e.payload for e in ext.effects("done:stepped")] == [other.nodename]
    assert ext.calls("done:stepped") == 1
    # a body without steps is not fenced mid-way (only its outcome is): its own late
    # side effect happened; that is what steps are for
    assert sorted(e.payload or "" for e in ext.effects("done:plain")) == sorted(
        [other.nodename, frozen.nodename]
    )
    # the frozen worker is alive again and serves normally
    assert frozen.is_alive()


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [pytest.param("redis", "postgresql", id="redis-postgresql", marks=pytest.mark.postgres)],
    indirect=True,
)
def test_reaper_lock_held_by_a_frozen_transaction_does_not_stop_recovery(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    """Row 11's freeze, landing while the frozen worker is inside its reaper-lock
    transaction (a ~1 ms window every reaper interval): simulated by holding that row
    locked in an open transaction made by the store's own engine, as the worker would."""
    p = lease_env.project(broker_url=broker_url)  # lease_ttl 1 s
    locks = p.store.t.locks
    p.store.try_lock(p.reaper_lock, "frozen-worker", 0.001)
    stalled = p.store.engine.connect()
    transaction = stalled.begin()
    try:
        # what try_lock's UPDATE holds until its COMMIT, which a frozen process never sends
        stalled.execute(select(locks).where(locks.c.name == p.reaper_lock).with_for_update())
        victim = p.worker("victim")
        gate = p.gates.hold("gate")
        with released(p.gates, gate):
            task_id = p.submit("t.work", "k", gate)
            p.wait_count("start:k", 1)
            survivor = p.worker("survivor")
            victim.kill_group(signal.SIGKILL)
            victim.wait_group_gone()
        rec = p.wait_state(task_id, State.SUCCEEDED, timeout=10)
        assert rec.attempt == 2 and rec.owner == p.incarnation(survivor)
        expiry = p.store.history(task_id)[2]
        assert expiry.actor == "reaper:survivor@lease-test"
    finally:
        with contextlib.suppress(Exception):  # the server may have ended the session
            transaction.rollback()
        stalled.close()


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [
        pytest.param("redis", "postgresql", id="redis-postgresql", marks=pytest.mark.postgres),
        pytest.param("redis", "sqlite", id="redis-sqlite"),
    ],
    indirect=True,
)
def test_a_worker_whose_incarnation_row_was_lost_registers_again_and_keeps_working(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    """A failover to a replica that asynchronous replication had not brought up to date
    loses the row of a worker registered in that window (deleted here): the worker's
    heartbeat inserts it again, as it was registered, and the worker runs tasks on."""
    p = lease_env.project(broker_url=broker_url)
    worker = p.worker("node", concurrency=1)
    first = p.submit("t.work", "a")
    p.wait_state(first, State.SUCCEEDED)
    inc = p.incarnation(worker)
    (registered,) = [w for w in p.store.workers() if w.id == inc]

    w = p.store.t.workers
    with p.store.engine.begin() as conn:
        conn.execute(delete(w).where(w.c.id == inc))

    def back() -> Any:
        row = next((r for r in p.store.workers() if r.id == inc), None)
        return row if row is not None and row.stopped_at is None else None

    again = wait_until(back, timeout=30, message="the incarnation row registered again")
    assert again.started_at == registered.started_at
    assert (again.nodename, again.hostname, again.pid) == (
        registered.nodename,
        registered.hostname,
        registered.pid,
    )
    worker.wait_log(r"its row is missing \(database failover\?\); re-registering")

    second = p.submit("t.work", "b")
    rec = p.wait_state(second, State.SUCCEEDED)
    assert rec.owner == inc and rec.attempt == 1 and rec.recoveries == 0
    assert p.incarnation(worker) == inc and worker.pid == registered.pid
    assert lease_env.external.count("done:a") == 1 and lease_env.external.count("done:b") == 1
