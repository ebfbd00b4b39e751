"""Issue 2, core lease lifecycle, in real ``celery worker`` subprocesses.

Every outcome a task can have (success, exception, ``self.retry()``, ``autoretry_for``
with backoff, retries exhausted, a result that cannot be stored) on each broker
(Redis, RabbitMQ) and each store (SQLite, PostgreSQL): the full cross product, one
worker per combination running every kind of task at once.
"""

from __future__ import annotations

import re

import pytest

from celery_lease import State

from ..crash.support import CLEAN_RUN, LeasedProject, LeaseEnv

MATRIX = pytest.mark.parametrize(
    ("broker_url", "backend"),
    [
        pytest.param("redis", "sqlite", id="redis-sqlite"),
        pytest.param("redis", "postgresql", id="redis-postgresql", marks=pytest.mark.postgres),
        pytest.param("amqp", "sqlite", id="amqp-sqlite"),
        pytest.param("amqp", "postgresql", id="amqp-postgresql", marks=pytest.mark.postgres),
    ],
    indirect=True,
)


def retry_gaps(p: LeasedProject, task_id: str) -> list[float]:
    """Database seconds between the claim of each attempt that retried and the claim
    of its retry (the attempt calls ``retry()`` after its claim: the retry must not
    run before its countdown from then).

    The worker that retries publishes the retry itself (RETRY_WAIT -> PENDING in the
    same statement, by the same worker, its outcome writer's): the countdown is the
    message's ETA, and the row's."""
    trail = p.store.history(task_id)
    gaps = []
    for i, row in enumerate(trail):
        if row.to_state is State.RETRY_WAIT:
            began, nxt, claim = trail[i - 1], trail[i + 1], trail[i + 2]
            assert (began.from_state, began.to_state) == (State.PENDING, State.RUNNING), began
            assert (nxt.from_state, nxt.to_state) == (State.RETRY_WAIT, State.PENDING), nxt
            assert nxt.actor == row.actor and nxt.actor.startswith("worker:"), nxt
            assert (nxt.at - row.at).total_seconds() < 0.3, (row, nxt)
            assert (claim.from_state, claim.to_state) == (State.PENDING, State.RUNNING), claim
            gaps.append((claim.at - began.at).total_seconds())
    return gaps


@MATRIX
def test_every_outcome_on_each_broker_and_store(lease_env: LeaseEnv, broker_url: str) -> None:
    p = lease_env.project(broker_url=broker_url)
    p.worker(concurrency=2)

    ok = p.submit("t.add", 2, 3)
    boom = p.submit("t.boom", "no luck")
    retried = p.submit("t.retry_then_ok", 2)
    auto = p.submit("t.autoretry", 2)
    exhausted = p.submit("t.exhaust_fail")
    manual = p.submit("t.exhaust_manual")
    odd = p.submit("t.odd_result")
    big = p.submit("t.big_result")

    # success: the result is stored, the trail is the clean one
    rec = p.wait_state(ok, State.SUCCEEDED)
    assert rec.result == 5 and rec.error is None and rec.attempt == 1
    assert rec.started_at is not None and rec.finished_at is not None
    assert p.trail(ok) == CLEAN_RUN
    assert [r.actor for r in p.store.history(ok)] == [
        "producer",
        "worker:w1@lease-test",
        "worker:w1@lease-test",
    ]

    # exception: FAILED with its type and message, not retried
    rec = p.wait_state(boom, State.FAILED)
    assert rec.error == "ValueError: no luck" and rec.attempt == 1
    assert rec.reason == "task raised ValueError"
    assert p.trail(boom) == [(None, "PENDING"), ("PENDING", "RUNNING"), ("RUNNING", "FAILED")]

    # self.retry(countdown=0.3) twice: RETRY_WAIT, re-published by the reaper when due
    rec = p.wait_state(retried, State.SUCCEEDED)
    assert rec.result == 2 and rec.retries == 2 and rec.attempt == 3 and rec.recoveries == 0
    assert p.trail(retried) == [
        (None, "PENDING"),
        *[("PENDING", "RUNNING"), ("RUNNING", "RETRY_WAIT"), ("RETRY_WAIT", "PENDING")] * 2,
        ("PENDING", "RUNNING"),
        ("RUNNING", "SUCCEEDED"),
    ]
    assert all(gap >= 0.3 - 0.01 for gap in retry_gaps(p, retried))

    # autoretry_for with retry_backoff (factor 1, no jitter): waits 1 s, then 2 s
    rec = p.wait_state(auto, State.SUCCEEDED)
    assert rec.result == "ok" and rec.retries == 2 and rec.attempt == 3
    gaps = retry_gaps(p, auto)
    assert len(gaps) == 2 and gaps[0] >= 1 - 0.01 and gaps[1] >= 2 - 0.01, gaps
    # the delays Celery's backoff computed (1 s, then 2 s) are the ones recorded
    delays = []
    for row in p.store.history(auto):
        if row.to_state is State.RETRY_WAIT:
            found = re.search(r"in ([\d.]+) s", row.reason or "")
            assert found is not None, row.reason
            delays.append(float(found.group(1)))
            assert re.fullmatch(r"retry \d of 3, due in [\d.]+ s", row.reason or ""), row.reason
    assert delays == [1.0, 2.0]

    # retries exhausted: FAILED (default) or WAIT_MANUAL (on_exhausted="manual")
    rec = p.wait_state(exhausted, State.FAILED)
    assert rec.attempt == 2 and rec.retries == 1 and rec.error == "Flaky: always"
    # a sentence, not "retries exhausted (1/1): retry()"
    exhausted_reason = "retries exhausted: 1 of 1 used, and the task asked for another"
    assert rec.reason == f"{exhausted_reason} (Flaky: always)"
    assert p.trail(exhausted)[-1] == ("RUNNING", "FAILED")
    rec = p.wait_state(manual, State.WAIT_MANUAL)
    assert rec.attempt == 2 and rec.retries == 1 and rec.error == "Flaky: always"
    assert rec.reason == f"{exhausted_reason} (Flaky: always)"
    assert p.trail(manual)[-1] == ("RUNNING", "WAIT_MANUAL")

    # results that cannot be stored: SUCCEEDED, no result, a note saying why
    for task_id in (odd, big):
        rec = p.wait_state(task_id, State.SUCCEEDED)
        assert rec.result is None and rec.attempt == 1
        assert rec.reason is not None, rec
        assert rec.reason.startswith("succeeded, but the result was not stored: "), rec.reason
        assert p.trail(task_id) == CLEAN_RUN

    # each body ran exactly as often as its attempts say
    ext = lease_env.external
    assert ext.count("add") == 1 and ext.count("boom") == 1
    assert ext.count("retry_then_ok") == 3 and ext.count("autoretry") == 3
    assert ext.count("exhaust_fail") == 2 and ext.count("exhaust_manual") == 2
    assert ext.count("odd_result") == 1 and ext.count("big_result") == 1
