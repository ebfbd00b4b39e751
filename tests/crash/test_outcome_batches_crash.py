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

A retry (``self.retry()``) is handed over too, with its message: the writer writes
the row, then publishes the message. Lost in the buffer, it is row 20 (the re-run is
the retry, counted as a recovery); lost between the row and the publish, it is row 1
(the reaper publishes the row's message: plain Celery's one retry).
"""

from __future__ import annotations

import uuid

import pytest

from celery_lease import State
from celery_lease.config import TUNING_ENV
from celery_lease.states import STEP_DONE
from celery_lease.testing import wait_until

from .faults import proxy_to_postgres
from .support import LeasedProject, LeaseEnv, pg_only

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
        settings={"lease_db_timeout": 1.0},
        env={TUNING_ENV: "outcome_flush_interval=5.0"},
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


# -- retries handed to the writer ------------------------------------------------------------


def retry_killed_at(
    lease_env: LeaseEnv, request: pytest.FixtureRequest, broker: str, point: str
) -> tuple[LeasedProject, str]:
    """A worker that dies at crash point ``point`` while its pool process retries a
    task once (``t.retry_then_ok``); the task's id, once the whole worker is gone."""
    p = lease_env.project(broker_url=request.getfixturevalue(f"{broker}_url"))
    crashing = p.worker("w1", env={"CELERY_LEASE_CRASH_AT": point})
    task_id = p.submit("t.retry_then_ok", 1)
    # the whole worker died: the crash point fired in its main process (the writer),
    # where a retry written by the pool process would have ended only that process
    wait_until(lambda: not crashing.is_alive(), timeout=60, message="the worker never died")
    return p, task_id


@pytest.mark.parametrize("broker", ["redis", "amqp"])
def test_row20_whole_worker_killed_with_a_retry_buffered(
    lease_env: LeaseEnv, request: pytest.FixtureRequest, broker: str
) -> None:
    # a pool process's self.retry() is handed to the writer: the worker dies with it
    # buffered, before the row or the retry's message was written
    p, task_id = retry_killed_at(lease_env, request, broker, "outcome_buffered")
    record = p.get(task_id)
    assert (record.state, record.attempt, record.retries) == (State.RUNNING, 1, 0)
    assert p.external.count("retry_then_ok") == 1

    p.worker("w1")  # its predecessor's lease expires at once: the re-run is the retry
    final = p.wait_state(task_id, State.SUCCEEDED, timeout=60)
    # the lost retry counts as a recovery; the re-run retried once more (its message is
    # the first one, retries 0) and then succeeded
    assert (final.recoveries, final.retries, final.result) == (1, 1, 1)
    assert p.external.count("retry_then_ok") == 3
    trail = p.trail(task_id)
    assert trail[:3] == [(None, "PENDING"), ("PENDING", "RUNNING"), ("RUNNING", "TIMEOUT")]
    assert trail[-1] == ("RUNNING", "SUCCEEDED")


@pytest.mark.parametrize("broker", ["redis", "amqp"])
def test_row1_worker_killed_after_writing_a_retry_before_publishing_it(
    lease_env: LeaseEnv, request: pytest.FixtureRequest, broker: str
) -> None:
    # the writer committed the retry (PENDING, its message stored) and died before
    # sending the message: the row is its outbox, the reaper publishes it
    p, task_id = retry_killed_at(lease_env, request, broker, "after_retry_recorded")
    record = p.get(task_id)
    assert (record.state, record.retries, record.published_at) == (State.PENDING, 1, None)
    assert p.trail(task_id)[-2:] == [("RUNNING", "RETRY_WAIT"), ("RETRY_WAIT", "PENDING")]

    p.worker("w2")
    final = p.wait_state(task_id, State.SUCCEEDED, timeout=60)
    # exactly plain Celery's run: one retry, no recovery
    assert (final.recoveries, final.retries, final.attempt, final.result) == (0, 1, 2, 1)
    assert p.external.count("retry_then_ok") == 2
