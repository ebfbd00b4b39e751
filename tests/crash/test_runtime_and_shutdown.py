"""Crash-point matrix row 17 (alive but over ``max_runtime``) and the shutdown paths.

- A task whose owner's heartbeat is alive but which has made no progress for longer than
  its ``max_runtime`` goes to WAIT_MANUAL and is left running, never re-run; if it then
  finishes, its outcome is accepted.
- Warm shutdown (SIGTERM) with a task running: the worker finishes it, then marks its
  incarnation stopped.
- Cold shutdown (SIGQUIT): the leases it still holds expire at once (no TTL wait), and
  the next worker re-runs them.
"""

from __future__ import annotations

import signal

import pytest

from celery_lease import State

from ..helpers import wait_until
from .support import CLEAN_RUN, LeasedProject, LeaseEnv, released


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [pytest.param("redis", "postgresql", id="redis-postgresql", marks=pytest.mark.postgres)],
    indirect=True,
)
def test_alive_task_over_max_runtime_goes_to_wait_manual_and_its_outcome_is_accepted(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = lease_env.project(broker_url=broker_url)
    worker = p.worker(concurrency=1)
    owner = p.incarnation(worker)
    gate = p.gates.hold("gate")
    with released(p.gates, gate):
        task_id = p.submit("t.overrun", "k", gate)  # max_runtime=1.0, lease_ttl 1 s
        rec = p.wait_state(task_id, State.WAIT_MANUAL, timeout=20)
        assert rec.reason is not None and "max_runtime" in rec.reason
        assert rec.owner == owner and rec.attempt == 1
        parked = rec.finished_at

        # left running, never re-run: several more TTLs of reaper sweeps change nothing
        def heartbeat() -> float:
            (row,) = [w for w in p.store.workers() if w.id == owner]
            return row.heartbeat_at.timestamp()

        since = heartbeat()
        wait_until(lambda: heartbeat() - since > 3.0, timeout=30, message="heartbeats go on")
        rec = p.get(task_id)
        assert rec.state is State.WAIT_MANUAL and rec.attempt == 1 and rec.recoveries == 0
        assert rec.finished_at == parked
        assert lease_env.external.count("start:k") == 1
    # the owner finishes after all: its outcome is accepted
    rec = p.wait_state(task_id, State.SUCCEEDED)
    assert rec.result == {"key": "k", "node": worker.nodename} and rec.attempt == 1
    assert p.trail(task_id) == [
        (None, "PENDING"),
        ("PENDING", "RUNNING"),
        ("RUNNING", "WAIT_MANUAL"),
        ("WAIT_MANUAL", "SUCCEEDED"),
    ]
    assert lease_env.external.count("done:k") == 1


@pytest.mark.parametrize(
    ("broker_url", "backend"), [pytest.param("redis", "sqlite", id="redis-sqlite")], indirect=True
)
def test_warm_shutdown_finishes_the_running_task_and_stops_the_incarnation(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = lease_env.project(broker_url=broker_url)
    worker = p.worker(concurrency=1)
    incarnation = p.incarnation(worker)
    gate = p.gates.hold("gate")
    with released(p.gates, gate):
        task_id = p.submit("t.work", "k", gate)
        p.wait_count("start:k", 1)
        worker.kill(signal.SIGTERM)
        worker.wait_log(r"Warm shutdown")
        # the worker waits for the task: still RUNNING, still its lease
        rec = p.get(task_id)
        assert rec.state is State.RUNNING and rec.owner == incarnation
    assert worker.proc is not None and worker.proc.wait(30) == 0

    rec = p.get(task_id)
    assert rec.state is State.SUCCEEDED and rec.attempt == 1 and rec.owner == incarnation
    assert p.trail(task_id) == CLEAN_RUN
    assert lease_env.external.count("done:k") == 1
    (row,) = [w for w in p.store.workers() if w.id == incarnation]
    assert row.stopped_at is not None and row.stop_reason == "shutdown"
    assert not row.alive and row.running == 0


def cold_shutdown(p: LeasedProject, name: str) -> tuple[str, str]:
    """Start worker ``name`` (prefork), run a gated task (``lease_ttl=60``) on it, cold-shut
    it down (SIGQUIT) mid-task and wait until its whole process group is gone.

    Returns (task id, the worker's incarnation id). Celery's solo and threads pools
    cannot cold-shut down a running task (``kill_job`` is not implemented): prefork only.
    """
    worker = p.worker(name, concurrency=1)
    incarnation = p.incarnation(worker)
    gate = p.gates.hold(f"gate-{name}")
    with released(p.gates, gate):
        task_id = p.submit("t.long_lease", "k", gate)  # lease_ttl=60: no TTL path here
        p.wait_count("start:k", 1)
        worker.kill(signal.SIGQUIT)
        worker.wait_log(r"Cold shutdown")
        assert worker.proc is not None
        worker.proc.wait(30)
        worker.wait_group_gone()
    return task_id, incarnation


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [pytest.param("amqp", "postgresql", id="amqp-postgresql", marks=pytest.mark.postgres)],
    indirect=True,
)
def test_cold_shutdown_expires_leftover_leases_at_once(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = lease_env.project(broker_url=broker_url)
    task_id, _ = cold_shutdown(p, "cold")
    # no other process runs a reaper: only the shutdown itself can have expired it
    rec = p.get(task_id)
    assert rec.state is State.PENDING and rec.recoveries == 1, rec
    assert p.trail(task_id)[2:] == [
        ("RUNNING", "TIMEOUT"),
        ("TIMEOUT", "RETRY_WAIT"),
        ("RETRY_WAIT", "PENDING"),
    ]

    nxt = p.worker("next", concurrency=1)
    rec = p.wait_state(task_id, State.SUCCEEDED)
    assert rec.attempt == 2 and rec.owner == p.incarnation(nxt)
    assert lease_env.external.count("start:k") == 2
    assert lease_env.external.count("done:k") == 1


@pytest.mark.parametrize(
    ("broker_url", "backend"), [pytest.param("redis", "sqlite", id="redis-sqlite")], indirect=True
)
def test_cold_shutdown_marks_the_incarnation_stopped(lease_env: LeaseEnv, broker_url: str) -> None:
    p = lease_env.project(broker_url=broker_url)
    _, incarnation = cold_shutdown(p, "cold")
    (row,) = [w for w in p.store.workers() if w.id == incarnation]
    assert row.stopped_at is not None, "a cold shutdown left the incarnation looking alive"
