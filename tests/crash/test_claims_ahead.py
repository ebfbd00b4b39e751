"""Claims made ahead, in batches, by a worker's lease agent (the default, every pool), with
real workers and real kills.

The deliveries a worker has reserved and starts next are claimed in one statement before
a pool process is free for them; each pool process asks the agent for its claim as its
task starts and runs under it. The tests hold the pool's processes busy at gates, so
that the deliveries behind them wait in the worker, and check what the store records.
The crash rows that a claim made ahead touches: a pool child killed while it runs a task
claimed ahead (row 3), the whole worker killed with deliveries claimed ahead that no
pool process has started yet (row 9), and a delivery claimed ahead that Celery drops
before it runs (its ``expires`` passed while it waited).
"""

from __future__ import annotations

import os
import signal
from datetime import UTC, datetime, timedelta

import pytest

from celery_lease import State
from celery_lease.config import TUNING_ENV
from celery_lease.testing import wait_until

from .support import CLEAN_RUN, GIVEN_BACK, RECOVERED, LeaseEnv, released

BOTH = pytest.mark.parametrize(
    ("broker_url", "backend"),
    [
        pytest.param("redis", "postgresql", id="redis-postgresql", marks=pytest.mark.postgres),
        pytest.param("amqp", "sqlite", id="amqp-sqlite"),
    ],
    indirect=True,
)


def _project(lease_env: LeaseEnv, broker_url: str, **overrides):
    """Celery's own prefetch (several deliveries per process)."""
    return lease_env.project(
        broker_url=broker_url,
        settings={"worker_prefetch_multiplier": 4},
        **overrides,
    )


def _busy(p, gates):
    """Occupy one pool process per gate with ``t.work`` held at it."""
    ids = [p.submit("t.work", gate, gate) for gate in gates]
    for gate, task_id in zip(gates, ids, strict=True):
        p.wait_count(f"start:{gate}", 1)
        p.wait_state(task_id, State.RUNNING)
    return ids


def _claimed_ahead(p, task_id):
    """Wait until the row is RUNNING although none of its code ran: claimed ahead."""
    p.wait_state(task_id, State.RUNNING)
    claim = _claim(p, task_id)
    assert claim.reason is not None and claim.reason.startswith("claimed ahead by worker:")
    return claim


def _claim(p, task_id):
    (claim,) = [r for r in p.store.history(task_id) if r.to_state is State.RUNNING]
    return claim


@BOTH
def test_the_deliveries_that_start_next_are_claimed_ahead_in_one_statement(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    # 0.3 s to gather the claims of deliveries that arrive together
    p = _project(lease_env, broker_url, env={TUNING_ENV: "claim_interval=0.3"})
    worker = p.worker(concurrency=2)
    gates = [p.gates.hold(f"g{i}") for i in range(2)]
    with released(p.gates, *gates):
        busy = _busy(p, gates)
        ids = [p.submit("t.add", i, 1) for i in range(6)]
        # one round ahead: as many as the worker has pool processes
        ahead = [_claimed_ahead(p, task_id) for task_id in ids[:2]]
        assert p.external.count("add") == 0  # claimed, not run
        if p.store.is_pg:
            assert ahead[0].at == ahead[1].at  # one statement: one database time
        assert {r.attempt for r in ahead} == {1}
    for i, task_id in enumerate(ids):
        rec = p.wait_state(task_id, State.SUCCEEDED)
        assert rec.result == i + 1 and rec.attempt == 1 and rec.recoveries == 0
        assert p.trail(task_id) == CLEAN_RUN
        assert _claim(p, task_id).reason in {
            f"claimed ahead by worker:{worker.nodename}",
            f"claimed by worker:{worker.nodename}",
        }
    for task_id in busy:
        assert p.wait_state(task_id, State.SUCCEEDED).attempt == 1
    assert p.external.count("add") == 6


@BOTH
def test_tasks_with_a_runtime_limit_are_claimed_by_their_pool_process(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = _project(lease_env, broker_url)
    worker = p.worker(concurrency=1)
    (gate,) = gates = [p.gates.hold("g0")]
    with released(p.gates, gate):
        _busy(p, gates)
        limited = p.submit("t.overrun", "k", None)  # max_runtime=1.0: not claimed ahead
        eligible = p.submit("t.add", 1, 2)
        _claimed_ahead(p, eligible)
        assert p.get(limited).state is State.PENDING
    assert p.wait_state(eligible, State.SUCCEEDED).result == 3
    rec = p.wait_state(limited, State.SUCCEEDED)
    assert rec.attempt == 1 and p.trail(limited) == CLEAN_RUN
    assert _claim(p, limited).reason == f"claimed by worker:{worker.nodename}"


@BOTH
def test_a_pool_child_killed_running_a_task_claimed_ahead_reruns_once(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = _project(lease_env, broker_url)
    worker = p.worker(concurrency=1)
    ext = lease_env.external
    busy_gate, gate = p.gates.hold("g0"), p.gates.hold("gk")
    with released(p.gates, busy_gate, gate):
        _busy(p, [busy_gate])
        task_id = p.submit("t.long_lease", "k", gate)  # lease_ttl=60: fast path only
        _claimed_ahead(p, task_id)
        assert ext.count("start:k") == 0
        p.gates.release(busy_gate)
        p.wait_count("start:k", 1)
        (first,) = ext.effects("start:k")
        assert first.pid in worker.children()
        os.kill(first.pid, signal.SIGKILL)
        p.gates.release(gate)
        rec = p.wait_state(task_id, State.SUCCEEDED, timeout=30)
    assert ext.count("start:k") == 2 and ext.count("done:k") == 1
    assert rec.attempt == 2 and rec.recoveries == 1
    assert p.trail(task_id) == RECOVERED
    timeout = p.store.history(task_id)[2]
    assert timeout.reason is not None and "pool child lost" in timeout.reason


@BOTH
def test_whole_worker_killed_with_deliveries_claimed_ahead_and_not_started(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = _project(lease_env, broker_url)
    worker = p.worker("node", concurrency=2)
    ext = lease_env.external
    gates = [p.gates.hold("k0"), p.gates.hold("k1")]
    with released(p.gates, *gates):
        running = [p.submit("t.long_lease", g, g) for g in gates]
        for g, task_id in zip(gates, running, strict=True):
            p.wait_count(f"start:{g}", 1)
            p.wait_state(task_id, State.RUNNING)
        # both pool processes are busy: these wait in the worker, claimed ahead
        waiting = [p.submit("t.long_lease", f"k{i}") for i in (2, 3)]
        for task_id in waiting:
            _claimed_ahead(p, task_id)
        assert ext.count("start:k2") == ext.count("start:k3") == 0
        worker.kill_group(signal.SIGKILL)
        worker.wait_group_gone()
    worker.restart()
    worker.wait_ready(timeout=60, store=p.store)
    # the restart expires every lease its predecessor held, started or not: each task
    # runs once more, the killed ones to their end, the waiting ones for the first time
    # (a recovery counted for them too: their rows were RUNNING)
    for i, task_id in enumerate([*running, *waiting]):
        rec = p.wait_state(task_id, State.SUCCEEDED, timeout=60)
        assert rec.attempt == 2 and rec.recoveries == 1, rec
        assert p.trail(task_id) == RECOVERED
        assert ext.count(f"done:k{i}") == 1
    assert [ext.count(f"start:k{i}") for i in range(4)] == [2, 2, 1, 1]


@BOTH
def test_a_delivery_claimed_ahead_that_expires_before_it_runs_is_cancelled(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = _project(lease_env, broker_url)
    p.worker(concurrency=1)
    (gate,) = gates = [p.gates.hold("g0")]
    with released(p.gates, gate):
        _busy(p, gates)
        expires = datetime.now(UTC) + timedelta(seconds=2)
        task_id = p.submit("t.add", 1, 2, expires=expires)
        _claimed_ahead(p, task_id)
        # past its expiry while it waits: Celery drops it when a pool process is free
        wait_until(
            lambda: datetime.now(UTC) > expires + timedelta(seconds=0.5),
            timeout=10,
            message="the expiry never passed",
        )
    rec = p.wait_state(task_id, State.CANCELLED, timeout=30)
    assert p.external.count("add") == 0
    assert p.trail(task_id)[-2:] == [("RUNNING", "TIMEOUT"), ("TIMEOUT", "CANCELLED")]
    # given back at once, as Celery dropped it (not found later, stranded)
    (expiry,) = [r for r in p.store.history(task_id) if r.to_state is State.TIMEOUT]
    assert expiry.reason is not None and "expired before it ran" in expiry.reason, expiry
    assert rec.reason is not None


@BOTH
def test_a_warm_shutdown_gives_back_the_claims_made_ahead(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    # a worker stopped (a deploy) with deliveries claimed ahead that no pool process
    # started: they are retried at once, no recovery counted (the stopping worker's
    # last sweep publishes them again), and the next worker runs each once
    p = _project(lease_env, broker_url)
    worker = p.worker("node", concurrency=1)
    gate = p.gates.hold("g0")
    with released(p.gates, gate):
        (busy,) = _busy(p, [gate])
        waiting = [p.submit("t.add", i, 1) for i in range(2)]
        _claimed_ahead(p, waiting[0])
        worker.signal_main(signal.SIGTERM)  # warm: the running task finishes first
        worker.wait_log(r"worker: Warm shutdown", 30)
    worker.proc.wait(60)  # type: ignore[union-attr]
    assert p.wait_state(busy, State.SUCCEEDED).attempt == 1
    # a warm shutdown starts none of the deliveries waiting (Celery leaves them to the
    # broker): the one claimed ahead was given back, the other never claimed
    first = p.get(waiting[0])
    assert first.state in (State.RETRY_WAIT, State.PENDING), first
    assert first.attempt == 1 and first.recoveries == 0, first
    assert p.get(waiting[1]).attempt == 0
    p.worker("next", concurrency=1)
    for i, task_id in enumerate(waiting):
        rec = p.wait_state(task_id, State.SUCCEEDED, timeout=60)
        assert rec.result == i + 1 and rec.recoveries == 0, rec
        assert p.trail(task_id) == [GIVEN_BACK, CLEAN_RUN][i], p.trail(task_id)
        assert rec.attempt == [2, 1][i], rec
    back = p.store.history(waiting[0])[2]
    assert back.reason is not None and "worker stopped before it started" in back.reason
    assert "no recovery counted" in back.reason
    assert p.external.count("add") == 2
