"""Crash-point matrix rows 20 and 21: outcomes buffered by the worker's outcome writer.

A pool process hands a finished task's outcome to the writer in the worker's main
process, which writes it with others. While it is buffered the row is RUNNING under
the worker's live heartbeat:

- row 20, the whole worker dies with the outcome buffered (the ``outcome_buffered``
  crash point ends the main process like a SIGKILL, after the writer read the outcome
  and before it wrote it): the lease expires (at once, as the worker restarts under
  its name) and the re-run skips every recorded step; the final state is the same as
  without the crash;
- row 21, the database becomes unreachable with the outcome buffered (PostgreSQL, a
  TCP proxy the test cuts): the writer keeps it and retries, the worker fences itself
  on the TTL, and once the database answers nothing is lost: the row ends SUCCEEDED,
  its step ran once.
"""

from __future__ import annotations

import uuid

import pytest

from celery_lease import State
from celery_lease.states import STEP_DONE
from celery_lease.testing import wait_until

from .faults import proxy_to_postgres
from .support import LeaseEnv, pg_only

DATABASE_URL_ENV = "TEST_CONF_LEASE_DATABASE_URL"


@pytest.mark.parametrize("broker", ["redis", "amqp"])
def test_row20_whole_worker_killed_with_the_outcome_buffered(
    lease_env: LeaseEnv, request: pytest.FixtureRequest, broker: str
) -> None:
    broker_url = request.getfixturevalue(f"{broker}_url")
    p = lease_env.project(broker_url=broker_url)
    crashing = p.worker("w1", env={"CELERY_LEASE_CRASH_AT": "outcome_buffered"})
    key = uuid.uuid4().hex[:8]
    task_id = p.submit("t.stepped", key)

    wait_until(lambda: not crashing.is_alive(), timeout=60, message="the worker never died")
    record = p.get(task_id)
    # the outcome died with the worker: the step is recorded, the row is not finished
    assert record.state is State.RUNNING and record.attempt == 1
    assert [s.name for s in p.store.steps(task_id)] == ["effect"]

    p.worker("w1")  # restarted under its name: its predecessor's leases expire at once
    final = p.wait_state(task_id, State.SUCCEEDED, timeout=60)
    assert final.attempt == 2
    assert final.result == {"key": key, "node": final.result["node"]}
    # the re-run skipped the recorded step: its effect happened once
    assert p.external.count(f"done:{key}") == 1
    assert {s.attempt for s in p.store.steps(task_id)} == {1}
    assert ("RUNNING", "TIMEOUT") in p.trail(task_id)  # expired as the worker restarted
    assert p.trail(task_id)[-1] == ("RUNNING", "SUCCEEDED")


@pg_only()
def test_row21_database_unreachable_with_the_outcome_buffered(
    lease_env: LeaseEnv, redis_url: str
) -> None:
    # the writer holds outcomes for 5 s: long enough for the test to cut the database
    # once the task's step is recorded (the hand-over itself needs no database)
    p = lease_env.project(
        broker_url=redis_url,
        ttl=2.0,
        heartbeat_interval=0.5,
        outcome_flush_interval=5.0,
        settings={"lease_db_timeout": 1.0},
    )
    with proxy_to_postgres() as proxy:
        worker = p.worker(env={DATABASE_URL_ENV: proxy.url(p.store.config.database_url)})
        key = uuid.uuid4().hex[:8]
        task_id = p.submit("t.stepped", key)
        wait_until(
            lambda: [s.name for s in p.store.steps(task_id) if s.state == STEP_DONE] == ["effect"],
            timeout=30,
            message="the step was never recorded",
        )
        proxy.cut()
        # the writer could not write the outcome: it keeps it
        p.wait_log(worker, r"outcome writer: .* 1 outcomes kept, retrying", timeout=30)
        # and the worker fences itself on the TTL, as without buffered outcomes
        p.wait_log(worker, r"heartbeat not renewed for .* treating its leases as lost", 30)
        assert p.get(task_id).state is State.RUNNING
        proxy.restore()
        final = p.wait_state(task_id, State.SUCCEEDED, timeout=60)
        assert worker.is_alive()

    # nothing lost: the outcome was written once the database answered, or the fenced
    # lease was expired and the re-run skipped the recorded step
    assert p.external.count(f"done:{key}") == 1
    assert {s.attempt for s in p.store.steps(task_id)} == {1}
    if final.attempt == 1:
        assert p.trail(task_id)[-1] == ("RUNNING", "SUCCEEDED")
    else:
        assert ("RUNNING", "TIMEOUT") in p.trail(task_id)
