"""Issue 2: every Celery pool (prefork, threads, solo) runs leased tasks and keeps their
leases alive with the worker's one heartbeat, however long the tasks run."""

from __future__ import annotations

import pytest

from celery_lease import State

from ..crash.support import CLEAN_RUN, LeaseEnv, released
from ..helpers import wait_until


@pytest.mark.parametrize(
    ("pool", "concurrency", "broker_url", "backend"),
    [
        pytest.param("prefork", 2, "redis", "postgresql", marks=pytest.mark.postgres),
        pytest.param("threads", 2, "amqp", "sqlite"),
        pytest.param("solo", 1, "redis", "sqlite"),
    ],
    ids=["prefork", "threads", "solo"],
    indirect=["broker_url", "backend"],
)
def test_pool_runs_leased_tasks_and_heartbeats(
    lease_env: LeaseEnv, pool: str, concurrency: int, broker_url: str
) -> None:
    p = lease_env.project(broker_url=broker_url)  # lease_ttl 1 s, heartbeat 0.2 s
    worker = p.worker(pool=pool, concurrency=concurrency)
    incarnation = p.incarnation(worker)
    gates = [p.gates.hold(f"g{i}") for i in range(concurrency)]
    with released(p.gates, *gates):
        ids = [p.submit("t.work", f"k{i}", gate) for i, gate in enumerate(gates)]
        for task_id in ids:
            p.wait_state(task_id, State.RUNNING)
        start = next(w for w in p.store.workers() if w.id == incarnation).heartbeat_at

        def heartbeat_age() -> float:
            (row,) = [w for w in p.store.workers() if w.id == incarnation]
            return (row.heartbeat_at - start).total_seconds()

        # hold the tasks for three TTLs of heartbeats (database time): the reaper sweeps
        # all along, and a lease kept alive by anything but the heartbeat would expire
        wait_until(lambda: heartbeat_age() > 3.0, timeout=30, message="heartbeat advances")
        for task_id in ids:
            rec = p.get(task_id)
            assert rec.state is State.RUNNING and rec.owner == incarnation
            assert rec.heartbeat_at is not None and rec.heartbeat_at > start
    for i, task_id in enumerate(ids):
        rec = p.wait_state(task_id, State.SUCCEEDED)
        assert rec.result == {"key": f"k{i}", "node": worker.nodename}
        assert rec.attempt == 1 and rec.recoveries == 0 and rec.owner == incarnation
        assert p.trail(task_id) == CLEAN_RUN
        assert lease_env.external.count(f"start:k{i}") == 1
        assert lease_env.external.count(f"done:k{i}") == 1
    # prefork ran the bodies in its children, threads and solo in the main process
    pids = {e.pid for e in lease_env.external.effects() if e.name.startswith("start:")}
    if pool == "prefork":
        assert len(pids) == concurrency and worker.pid not in pids
    else:
        assert pids == {worker.pid}
