"""Lease expiry decided a batch at a time, on SQLite and PostgreSQL.

A sweep reads its candidates once, expires them all in one fenced statement, reads
their steps in flight once, lets the policy decide each row, and writes the decisions
together: every row still gets its own decision, reason and audit rows, exactly as one
expired alone.
"""

from __future__ import annotations

from celery_lease.states import State

from .test_outcome_batches import Statements
from .test_store_contract import claim, running, state, trail

S = State


def test_a_batch_gives_every_row_its_own_decision(store):
    safe = [running(store)[0] for _ in range(3)]
    manual_task, _, _ = running(store, on_timeout="manual")
    poison_task, _, _ = running(store, max_recoveries=0)
    inflight_task, inflight_lease, _ = running(store)
    store.step_started(inflight_lease, "charge", checkable=False)
    cancelled_task, _, _ = running(store)
    store.request_cancel(cancelled_task, actor="alice", reason="not needed")
    everyone = [*safe, manual_task, poison_task, inflight_task, cancelled_task]

    got = store.expire(actor="r", reason="owner died", task_ids=everyone, only_expired=False)

    decided = {e.task_id: e for e in got}
    assert sorted(decided) == sorted(everyone)
    for task_id in safe:
        assert decided[task_id].to_state is S.RETRY_WAIT
        assert state(store, task_id) is S.RETRY_WAIT
    assert decided[manual_task].to_state is S.WAIT_MANUAL
    assert "on_timeout is 'manual'" in decided[manual_task].reason
    assert decided[poison_task].to_state is S.WAIT_MANUAL
    assert "poison task" in decided[poison_task].reason
    assert decided[inflight_task].to_state is S.WAIT_MANUAL
    assert "'charge'" in decided[inflight_task].reason
    assert decided[cancelled_task].to_state is S.CANCELLED
    assert store.get(cancelled_task).finished_at is not None
    for task_id, expiry in decided.items():
        record = store.get(task_id)
        assert record.state is expiry.to_state
        assert record.reason == f"{expiry.reason} (after: owner died)"
        assert trail(store, task_id)[-2:] == [(S.RUNNING, S.TIMEOUT), (S.TIMEOUT, expiry.to_state)]
    # the safe rows are due now: the next sweep publishes them
    due = {p.id for p in store.take_due_retries(actor="r")}
    assert due == set(safe)


def test_only_this_attempts_unchecked_calls_are_in_flight(store):
    # attempt 1 started a call, which raised; the task asked for a retry
    task_id, lease, owner = running(store)
    store.step_started(lease, "charge", checkable=False)
    assert store.schedule_retry(lease, 0.0, actor="w", reason="retry 1", error="boom")
    assert state(store, task_id) is S.PENDING  # the retry's message goes out at once
    assert claim(store, task_id, owner).lease.attempt == 2
    checkable_task, checkable_lease, _ = running(store)
    store.step_started(checkable_lease, "charge", checkable=True)
    inflight_task, inflight_lease, _ = running(store)
    store.step_started(inflight_lease, "charge", checkable=False)

    got = store.expire(
        actor="r",
        reason="x",
        task_ids=[task_id, checkable_task, inflight_task],
        only_expired=False,
    )

    decided = {e.task_id: e.to_state for e in got}
    assert decided == {
        task_id: S.RETRY_WAIT,  # attempt 2 has no call in flight
        checkable_task: S.RETRY_WAIT,  # its check will tell
        inflight_task: S.WAIT_MANUAL,
    }


def test_a_batch_costs_the_same_statements_whatever_its_size(store):
    def expire_batch(n: int) -> list[str]:
        tasks = [running(store)[0] for _ in range(n)]
        with Statements(store.engine) as seen:
            got = store.expire(actor="r", reason="x", task_ids=tasks, only_expired=False)
        assert sorted(e.task_id for e in got) == sorted(tasks)
        return seen.statements

    small, large = expire_batch(2), expire_batch(40)
    if store.is_pg:
        # candidates, the overruns of these tasks ending (their slots given back),
        # RUNNING -> TIMEOUT (audit in the same statement), steps in flight, the
        # decisions (audit in the same statement)
        assert small == large == ["SELECT", "UPDATE", "WITH", "SELECT", "WITH"]
    else:
        # the decisions are one statement per row here; everything else is per batch
        assert large.count("SELECT") == small.count("SELECT")
        assert large.count("UPDATE") - small.count("UPDATE") == 38


def test_a_lease_taken_over_meanwhile_is_not_expired_by_a_stale_batch(store):
    task_id, lease, _ = running(store)
    assert store.give_up(lease, actor="w", reason="stopped") is not None
    # the same lease given up again: its token no longer matches, nothing changes
    assert store.give_up(lease, actor="w", reason="stopped") is None
    assert trail(store, task_id).count((S.RUNNING, S.TIMEOUT)) == 1
