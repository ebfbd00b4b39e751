"""Crash rows of the lease agent: the process of its own that claims a worker's
deliveries in batches (:mod:`celery_lease.worker.main.agent`), with real workers,
real kills and a database cut by a TCP proxy.

- the agent killed (SIGKILL) with a claim made ahead and not handed over: the worker's
  main process sees it gone and stops as a warm shutdown does; the task running
  finishes and its outcome is written, the claim never handed over expires as the
  worker stops and is retried (a recovery counted, none of its code having run), and
  every task runs its code once;
- the database unreachable while deliveries wait for their claims: the agent cannot
  claim, answers "not claimed", and each pool process claims for itself and fails as
  it always did; once the database answers, every delivery is published again and
  each task runs once.
"""

from __future__ import annotations

import os
import signal

import pytest

from celery_lease import State
from celery_lease.testing import wait_until

from .faults import proxy_to_postgres
from .support import CLEAN_RUN, RECOVERED, LeaseEnv, pg_only, released

BOTH = pytest.mark.parametrize(
    ("broker_url", "backend"),
    [
        pytest.param("redis", "postgresql", id="redis-postgresql", marks=pytest.mark.postgres),
        pytest.param("amqp", "sqlite", id="amqp-sqlite"),
    ],
    indirect=True,
)

DATABASE_URL_ENV = "TEST_CONF_LEASE_DATABASE_URL"


def _claim(p, task_id):
    (claim,) = [r for r in p.store.history(task_id) if r.to_state is State.RUNNING][:1]
    return claim


@BOTH
def test_agent_killed_with_a_claim_made_ahead_and_not_handed_over(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = lease_env.project(broker_url=broker_url, settings={"worker_prefetch_multiplier": 4})
    worker = p.worker("node", concurrency=1)
    ext = lease_env.external
    gate = p.gates.hold("k0")
    with released(p.gates, gate):
        running = p.submit("t.long_lease", "k0", "k0")
        p.wait_count("start:k0", 1)
        p.wait_state(running, State.RUNNING)
        # the pool process is busy: one round ahead (one pool process) is claimed
        # ahead and waits in the worker; the next one is not
        ahead = p.submit("t.long_lease", "k1")
        p.wait_state(ahead, State.RUNNING)
        claim = _claim(p, ahead)
        assert claim.reason == f"claimed ahead by worker:{worker.nodename}"
        assert ext.count("start:k1") == 0
        (first,) = ext.effects("start:k0")
        assert worker.children() == [first.pid]
        agent = worker.lease_agent()
        assert agent is not None and agent != first.pid
        os.kill(agent, signal.SIGKILL)
        p.wait_log(worker, r"the lease agent \(pid \d+\) is gone", timeout=30)
        # the gate opens as the block ends: the running task finishes, the worker stops
    wait_until(lambda: not worker.is_alive(), timeout=60, message="the worker never stopped")
    done = p.wait_state(running, State.SUCCEEDED, timeout=30)
    assert done.attempt == 1 and p.trail(running) == CLEAN_RUN
    # the claim never handed over expired as the worker stopped: retried
    assert p.get(ahead).state is State.PENDING
    worker.restart()
    worker.wait_ready(timeout=60, store=p.store)
    rec = p.wait_state(ahead, State.SUCCEEDED, timeout=60)
    assert rec.attempt == 2 and rec.recoveries == 1
    assert p.trail(ahead) == RECOVERED
    assert ext.count("start:k0") == ext.count("done:k0") == 1
    assert ext.count("start:k1") == ext.count("done:k1") == 1


@pg_only()
@pytest.mark.parametrize("broker", ["redis", "amqp"])
def test_database_unreachable_while_deliveries_wait_for_their_claims(
    lease_env: LeaseEnv, request: pytest.FixtureRequest, broker: str
) -> None:
    # a TTL long enough that the worker is still claimable (its heartbeat not lapsed)
    # when the deliveries arrive, however loaded the machine: a worker that fenced
    # itself first claims nothing ahead, and the agent's failed claim never comes
    p = lease_env.project(
        broker_url=request.getfixturevalue(f"{broker}_url"),
        ttl=10.0,
        heartbeat_interval=0.5,
        settings={"lease_db_timeout": 1.0, "worker_prefetch_multiplier": 4},
    )
    with proxy_to_postgres() as proxy:
        worker = p.worker(
            concurrency=2, env={DATABASE_URL_ENV: proxy.url(p.store.config.database_url)}
        )
        proxy.cut()
        ids = [p.submit("t.add", i, 1) for i in range(4)]
        p.wait_log(worker, r"lease agent: \d+ deliveries not claimed ahead", timeout=60)
        assert p.external.count("add") == 0
        assert {p.get(task_id).state for task_id in ids} == {State.PENDING}
        proxy.restore()
        for i, task_id in enumerate(ids):
            rec = p.wait_state(task_id, State.SUCCEEDED, timeout=90)
            assert rec.result == i + 1 and rec.attempt == 1
        assert worker.is_alive()
    # each ran once: the deliveries that failed to claim were published again
    assert p.external.count("add") == 4
