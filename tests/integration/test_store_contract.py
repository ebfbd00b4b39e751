"""The store contract, run against a real SQLite file and a real PostgreSQL schema.

Every test takes the ``store`` fixture, parametrized over both backends (``-k sqlite``
or ``-k postgresql`` to pick one). At teardown the audit trail of every task is checked
(see ``tests.helpers.check_audit``). Timing-dependent tests poll with ``wait_until``
and compare against database time only.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import re
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import update

import celery_lease.store as store_package
from celery_lease.exceptions import IllegalTransition, TaskNotFound
from celery_lease.states import State
from celery_lease.store import Claim, Lease, NewTask, Refusal, Store
from celery_lease.store.schema import after, db_now

from ..helpers import check_audit, discard_unpublished, submit_in_process, wait_until

S = State


# -- small builders -----------------------------------------------------------------------


def new_task(task_id: str | None = None, **overrides) -> NewTask:
    values = {
        "id": task_id or uuid.uuid4().hex,
        "name": "tests.job",
        "args": "[1,2]",
        "kwargs": '{"k":"v"}',
        "options": "{}",
        "lease_ttl": 1.0,
        "max_recoveries": 5,
    }
    values.update(overrides)
    return NewTask(**values)


def submit(store: Store, **overrides) -> str:
    task_id, created = store.submit(new_task(**overrides))
    assert created
    return task_id


def register(store: Store, nodename: str | None = None) -> str:
    """A live worker incarnation (a node name of its own unless given: registering a
    node name again supersedes its earlier incarnations)."""
    worker_id = uuid.uuid4().hex
    nodename = nodename or f"w-{worker_id[:6]}@host"
    store.register_worker(worker_id, nodename, "host", os.getpid())
    return worker_id


def claim(store: Store, task_id: str, owner: str, actor: str = "worker:w1@host") -> Claim:
    got = store.claim(task_id, owner, actor)
    assert isinstance(got, Claim), got
    return got


def running(store: Store, nodename: str | None = None, **overrides) -> tuple[str, Lease, str]:
    """A RUNNING task owned by a freshly registered worker: (task id, lease, worker id)."""
    owner = register(store, nodename)
    task_id = submit(store, **overrides)
    return task_id, claim(store, task_id, owner).lease, owner


def state(store: Store, task_id: str) -> State:
    record = store.get(task_id)
    assert record is not None
    return record.state


def trail(store: Store, task_id: str) -> list[tuple[State | None, State]]:
    return [(r.from_state, r.to_state) for r in store.history(task_id)]


def recover(store: Store, task_id: str, owner: str) -> Lease:
    """Expire the task's lease, let the retry come due, and claim it again."""
    (expiry,) = store.expire(
        actor="reaper", reason="test expiry", task_ids=[task_id], only_expired=False
    )
    assert expiry.to_state is S.RETRY_WAIT, expiry
    assert [p.id for p in store.take_due_retries(actor="reaper")] == [task_id]
    return claim(store, task_id, owner).lease


def snapshot(store: Store, task_id: str) -> tuple[object, ...]:
    record = store.get(task_id)
    return (
        None if record is None else record.as_dict(),
        store.history(task_id),
        store.steps(task_id),
    )


# -- submit and dedup ---------------------------------------------------------------------


def test_submit_creates_a_pending_row_with_one_audit_row(store):
    task_id, created = store.submit(new_task(name="tests.add", max_runtime=9.5, max_retries=3))
    assert created
    record = store.get(task_id)
    assert record is not None
    assert (record.state, record.attempt, record.recoveries, record.retries) == (S.PENDING, 0, 0, 0)
    assert record.name == "tests.add"
    assert (record.args, record.kwargs, record.options) == ([1, 2], {"k": "v"}, {})
    assert (record.max_runtime, record.max_retries, record.on_timeout) == (9.5, 3, "retry")
    assert record.published_at is None and record.owner is None
    assert record.created_at.tzinfo is not None
    (row,) = store.history(task_id)
    assert (row.from_state, row.to_state, row.actor, row.attempt) == (
        None,
        S.PENDING,
        "producer",
        0,
    )


def test_submitting_the_same_id_twice_keeps_one_row(store):
    task = new_task()
    assert store.submit(task) == (task.id, True)
    assert store.submit(task) == (task.id, False)
    assert len(store.history(task.id)) == 1
    assert store.counts()[S.PENDING] == 1


def test_dedup_key_returns_the_first_task(store):
    first = new_task(dedup_key="invoice-7")
    second = new_task(dedup_key="invoice-7", args="[9]")
    assert store.submit(first) == (first.id, True)
    assert store.submit(second) == (first.id, False)
    assert store.get(second.id) is None
    record = store.get(first.id)
    assert record is not None and record.args == [1, 2] and record.dedup_key == "invoice-7"
    other = new_task(dedup_key="invoice-8")
    assert store.submit(other) == (other.id, True)


def test_dedup_holds_whatever_state_the_first_task_is_in(store):
    task_id, lease, _ = running(store, dedup_key="once")
    assert store.finish(lease, S.SUCCEEDED, actor="w", reason="done", result="1")
    assert store.submit(new_task(dedup_key="once")) == (task_id, False)


def test_concurrent_dedup_submissions_from_processes_create_one_row(store):
    ctx = multiprocessing.get_context("spawn")
    n = 4
    barrier, results = ctx.Barrier(n), ctx.Queue()
    tasks = [new_task(dedup_key="race") for _ in range(n)]
    procs = [
        ctx.Process(target=submit_in_process, args=(store.config, t, barrier, results))
        for t in tasks
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=90) for _ in procs]
    for p in procs:
        p.join(30)
    results.close()
    results.join_thread()
    assert all(p.exitcode == 0 for p in procs), outcomes

    winners = [task_id for task_id, created in outcomes if created is True]
    assert len(winners) == 1, outcomes
    assert {task_id for task_id, _ in outcomes} == {winners[0]}
    rows = store.list_tasks()
    assert [r.id for r in rows] == winners
    assert len(store.history(winners[0])) == 1


def test_submit_joins_the_callers_transaction(store):
    kept, dropped = new_task(), new_task()
    with store.engine.begin() as conn:
        store.submit(kept, conn=conn)
    with pytest.raises(RuntimeError), store.engine.begin() as conn:
        store.submit(dropped, conn=conn)
        raise RuntimeError("the caller's business transaction fails")
    assert store.get(kept.id) is not None
    assert store.get(dropped.id) is None
    assert store.history(dropped.id) == []


def test_mark_published_and_discard_unpublished(store):
    published, unpublished = submit(store), submit(store)
    store.mark_published([published])
    assert store.get(published).published_at is not None
    assert store.get(unpublished).published_at is None

    discard_unpublished(store, published)  # published: must stay
    discard_unpublished(store, unpublished)
    assert store.get(published) is not None
    assert store.get(unpublished) is None and store.history(unpublished) == []


# -- claim --------------------------------------------------------------------------------


def test_claim_moves_pending_to_running_and_counts_the_attempt(store):
    owner = register(store, "w1@host")
    task_id = submit(store)
    got = claim(store, task_id, owner, actor="worker:w1@host")
    assert got.lease.task_id == task_id and got.lease.attempt == 1 and got.lease.token
    assert (got.retries, got.recoveries, got.resumed, got.cancel_requested) == (0, 0, False, False)
    record = store.get(task_id)
    assert (record.state, record.attempt, record.owner) == (S.RUNNING, 1, owner)
    assert record.started_at is not None and record.owner_node == "w1@host"
    assert store.history(task_id)[-1].actor == "worker:w1@host"


def test_second_claim_is_refused_and_changes_nothing(store):
    task_id, _lease, _ = running(store)
    before = snapshot(store, task_id)
    refusal = store.claim(task_id, register(store, "w2@host"), "worker:w2@host")
    assert isinstance(refusal, Refusal)
    assert refusal.state is S.RUNNING and refusal.task_id == task_id
    assert snapshot(store, task_id) == before


def test_claims_racing_from_threads_have_one_winner(store):
    task_id = submit(store)
    owners = [register(store, f"w{i}@host") for i in range(6)]
    barrier = threading.Barrier(len(owners))
    results: list[object] = []

    def attempt(owner: str) -> None:
        barrier.wait(10)
        results.append(store.claim(task_id, owner, f"worker:{owner}"))

    threads = [threading.Thread(target=attempt, args=(o,)) for o in owners]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    claims = [r for r in results if isinstance(r, Claim)]
    assert len(results) == len(owners) and len(claims) == 1
    assert store.get(task_id).attempt == 1
    assert trail(store, task_id).count((S.PENDING, S.RUNNING)) == 1


def test_claim_of_unknown_task_without_adopt_is_refused(store):
    refusal = store.claim("no-such-task", register(store), "worker:w1@host")
    assert isinstance(refusal, Refusal) and refusal.state is None
    assert store.get("no-such-task") is None


def test_claim_adopts_a_message_without_a_row(store):
    owner = register(store)
    task = new_task()
    got = store.claim(task.id, owner, "worker:w1@host", adopt=task)
    assert isinstance(got, Claim)
    assert got.lease.attempt == 1 and got.resumed
    record = store.get(task.id)
    assert (record.state, record.args, record.on_timeout) == (S.RUNNING, [1, 2], "retry")
    assert trail(store, task.id) == [(None, S.PENDING), (S.PENDING, S.RUNNING)]
    assert "adopted" in store.history(task.id)[0].reason


def test_adopted_message_without_storable_args_can_only_be_recovered_by_a_person(store):
    owner = register(store)
    task = new_task(args=None, kwargs=None)
    assert isinstance(store.claim(task.id, owner, "worker:w1@host", adopt=task), Claim)
    assert store.get(task.id).on_timeout == "manual"
    assert "could not be stored" in store.history(task.id)[0].reason
    (expiry,) = store.expire(
        actor="reaper", reason="owner died", task_ids=[task.id], only_expired=False
    )
    assert expiry.to_state is S.WAIT_MANUAL


def test_adopt_is_ignored_when_the_row_exists(store):
    owner = register(store)
    task_id = submit(store, args="[42]")
    got = store.claim(task_id, owner, "worker:w1@host", adopt=new_task(task_id, args="[0]"))
    assert isinstance(got, Claim) and not got.resumed
    assert store.get(task_id).args == [42]
    assert len(store.history(task_id)) == 2


def test_every_claim_increments_the_attempt(store):
    task_id, lease1, owner = running(store)
    lease2 = recover(store, task_id, owner)
    lease3 = recover(store, task_id, owner)
    assert [lease1.attempt, lease2.attempt, lease3.attempt] == [1, 2, 3]
    assert len({lease1.token, lease2.token, lease3.token}) == 3
    record = store.get(task_id)
    assert (record.attempt, record.recoveries) == (3, 2)
    again = store.claim(task_id, owner, "w")  # RUNNING: refused
    assert isinstance(again, Refusal)


def test_reclaim_after_recovery_reports_resumed_and_counts(store):
    task_id, _, owner = running(store)
    (expiry,) = store.expire(actor="reaper", reason="x", task_ids=[task_id], only_expired=False)
    assert expiry.to_state is S.RETRY_WAIT
    store.take_due_retries(actor="reaper")
    got = claim(store, task_id, owner)
    assert got.resumed and got.recoveries == 1 and got.retries == 0


@pytest.mark.parametrize("final", [S.SUCCEEDED, S.CANCELLED, S.FAILED])
def test_claim_of_a_finished_task_is_refused(store, final):
    task_id, lease, _ = running(store)
    assert store.finish(lease, final, actor="w", reason="end")
    refusal = store.claim(task_id, register(store, "w2@host"), "w2")
    assert isinstance(refusal, Refusal) and refusal.state is final


# -- outcome and fencing ------------------------------------------------------------------


def test_finish_records_the_outcome(store):
    task_id, lease, _ = running(store)
    assert store.finish(lease, S.SUCCEEDED, actor="worker:w1", reason="ok", result='{"total":3}')
    record = store.get(task_id)
    assert record.state is S.SUCCEEDED and record.result == {"total": 3}
    assert record.finished_at is not None and record.finished_at >= record.started_at
    assert trail(store, task_id)[-1] == (S.RUNNING, S.SUCCEEDED)


def test_finish_failed_records_the_error(store):
    task_id, lease, _ = running(store)
    assert store.finish(lease, S.FAILED, actor="w", reason="raised", error="ValueError: bad")
    record = store.get(task_id)
    assert (record.state, record.error) == (S.FAILED, "ValueError: bad")


def test_finish_to_an_illegal_state_raises_and_changes_nothing(store):
    task_id, lease, _ = running(store)
    before = snapshot(store, task_id)
    with pytest.raises(IllegalTransition) as info:
        store.finish(lease, S.PENDING, actor="w", reason="nonsense")
    assert (info.value.from_state, info.value.to_state) == (S.RUNNING, S.PENDING)
    assert snapshot(store, task_id) == before


def test_a_stale_lease_is_fenced_off_after_expiry_and_reclaim(store):
    task_id, stale, owner = running(store)
    assert store.step_done(stale, "a", '"first"', idempotent=True)[0] is not None
    fresh = recover(store, task_id, owner)
    before = snapshot(store, task_id)
    progress_at = store.get(task_id).progress_at

    assert store.finish(stale, S.SUCCEEDED, actor="old", reason="late", result="1") is False
    assert store.schedule_retry(stale, 0.0, actor="old", reason="late", error=None) is False
    assert store.step_started(stale, "b", checkable=False) is None
    fenced, _ = store.step_done(stale, "c", '"stale"', idempotent=True)
    assert fenced is None
    assert store.save_progress(stale, '{"cursor":99}') is None
    assert store.check_lease(stale) is None
    assert snapshot(store, task_id) == before
    assert store.get(task_id).progress_at == progress_at
    assert set(store.load_steps(task_id)) == {"a"}

    assert store.check_lease(fresh) is not None
    assert store.finish(fresh, S.SUCCEEDED, actor="new", reason="done", result="2")
    assert store.get(task_id).result == 2


def test_a_lease_is_lost_as_soon_as_it_expires(store):
    task_id, lease, _ = running(store)
    store.expire(actor="reaper", reason="gone", task_ids=[task_id], only_expired=False)
    assert state(store, task_id) is S.RETRY_WAIT
    assert store.check_lease(lease) is None
    assert store.finish(lease, S.SUCCEEDED, actor="w", reason="late") is False
    assert state(store, task_id) is S.RETRY_WAIT


def test_a_wrong_token_is_fenced_even_with_the_right_attempt(store):
    task_id, lease, _ = running(store)
    forged = Lease(task_id, lease.attempt, uuid.uuid4().hex)
    assert store.finish(forged, S.SUCCEEDED, actor="w", reason="x") is False
    assert store.save_progress(forged, "1") is None
    assert state(store, task_id) is S.RUNNING


# -- steps and progress -------------------------------------------------------------------


def test_steps_are_first_writer_wins_across_attempts(store):
    task_id, lease1, owner = running(store)
    fenced, stored = store.step_done(lease1, "charge", '{"charge_id":1}', idempotent=False)
    assert fenced is not None and stored == '{"charge_id":1}'
    lease2 = recover(store, task_id, owner)
    _, replay = store.step_done(lease2, "charge", '{"charge_id":2}', idempotent=False)
    assert replay == '{"charge_id":1}'
    step = store.load_steps(task_id)["charge"]
    assert (step.state, step.result, step.attempt) == ("DONE", '{"charge_id":1}', 1)


def test_step_started_then_done(store):
    task_id, lease, _ = running(store)
    assert store.step_started(lease, "upload", checkable=False) is not None
    assert store.load_steps(task_id)["upload"].state == "STARTED"
    store.step_done(lease, "upload", '"url"', idempotent=False)
    (record,) = store.steps(task_id)
    assert (record.name, record.state, record.result, record.idempotent) == (
        "upload",
        "DONE",
        "url",
        False,
    )
    assert record.finished_at is not None and record.finished_at >= record.started_at


def test_step_started_does_not_reset_a_done_step(store):
    task_id, lease, _ = running(store)
    store.step_done(lease, "mail", '"sent"', idempotent=False)
    store.step_started(lease, "mail", checkable=False)
    assert store.load_steps(task_id)["mail"].state == "DONE"


def test_steps_are_listed_in_the_order_they_started(store):
    task_id, lease, _ = running(store)
    for name in ["one", "two", "three"]:
        store.step_done(lease, name, json.dumps(name), idempotent=True)
        # distinct start times (SQLite's clock has millisecond resolution)
        started = store.steps(task_id)[-1].started_at
        wait_until(lambda started=started: store.now() > started, message="clock ticks")
    records = store.steps(task_id)
    assert [r.name for r in records] == ["one", "two", "three"]
    assert all(r.idempotent and r.attempt == 1 for r in records)


def test_progress_is_stored_and_fenced(store):
    task_id, lease, _ = running(store)
    assert store.save_progress(lease, '{"page":3}') is not None
    assert store.load_progress(task_id) == '{"page":3}'
    assert store.get(task_id).progress == {"page": 3}


# -- expiry and the timeout policy --------------------------------------------------------


def test_expiry_of_a_safe_task_retries_it_at_once(store):
    task_id, _lease, _ = running(store)
    (expiry,) = store.expire(
        actor="reaper", reason="owner died", task_ids=[task_id], only_expired=False
    )
    assert (expiry.task_id, expiry.to_state) == (task_id, S.RETRY_WAIT)
    record = store.get(task_id)
    assert (record.state, record.recoveries) == (S.RETRY_WAIT, 1)
    assert record.next_retry_at is not None and record.next_retry_at <= store.now()
    assert trail(store, task_id)[-2:] == [(S.RUNNING, S.TIMEOUT), (S.TIMEOUT, S.RETRY_WAIT)]
    assert "owner died" in store.history(task_id)[-2].reason
    assert [p.id for p in store.take_due_retries(actor="reaper")] == [task_id]


def test_on_timeout_manual_goes_to_a_person(store):
    task_id, _, _ = running(store, on_timeout="manual")
    (expiry,) = store.expire(
        actor="reaper", reason="owner died", task_ids=[task_id], only_expired=False
    )
    assert expiry.to_state is S.WAIT_MANUAL and "manual" in expiry.reason
    record = store.get(task_id)
    assert record.state is S.WAIT_MANUAL and "manual" in record.reason
    assert trail(store, task_id)[-2:] == [(S.RUNNING, S.TIMEOUT), (S.TIMEOUT, S.WAIT_MANUAL)]


def test_poison_task_goes_to_a_person_after_max_recoveries(store):
    task_id, _, owner = running(store, max_recoveries=2)
    recover(store, task_id, owner)
    recover(store, task_id, owner)
    (expiry,) = store.expire(
        actor="reaper", reason="died again", task_ids=[task_id], only_expired=False
    )
    assert expiry.to_state is S.WAIT_MANUAL and "poison" in expiry.reason
    record = store.get(task_id)
    assert (record.state, record.recoveries, record.attempt) == (S.WAIT_MANUAL, 3, 3)
    assert store.take_due_retries(actor="reaper") == []


def test_inflight_non_idempotent_step_goes_to_a_person_naming_the_step(store):
    task_id, lease, _ = running(store)
    store.step_done(lease, "reserve", '"r1"', idempotent=True)
    store.step_started(lease, "charge_card", checkable=False)
    (expiry,) = store.expire(
        actor="reaper", reason="child lost", task_ids=[task_id], only_expired=False
    )
    assert expiry.to_state is S.WAIT_MANUAL
    assert "charge_card" in expiry.reason
    record = store.get(task_id)
    assert record.state is S.WAIT_MANUAL and "charge_card" in record.reason


def test_inflight_checkable_step_is_retried(store):
    task_id, lease, _ = running(store)
    store.step_started(lease, "upload", checkable=True)
    (expiry,) = store.expire(
        actor="reaper", reason="child lost", task_ids=[task_id], only_expired=False
    )
    assert expiry.to_state is S.RETRY_WAIT


def test_finished_non_idempotent_step_does_not_block_a_retry(store):
    task_id, lease, _ = running(store)
    store.step_started(lease, "charge", checkable=False)
    store.step_done(lease, "charge", '"c1"', idempotent=False)
    (expiry,) = store.expire(actor="reaper", reason="x", task_ids=[task_id], only_expired=False)
    assert expiry.to_state is S.RETRY_WAIT


def test_tasks_older_than_max_age_go_to_a_person(make_store):
    store = make_store(max_age=0.3)
    task_id, _, _ = running(store)
    wait_until(lambda: store.list_tasks(older_than=0.3), message="task older than max_age")
    (expiry,) = store.expire(actor="reaper", reason="x", task_ids=[task_id], only_expired=False)
    assert expiry.to_state is S.WAIT_MANUAL and "too old" in expiry.reason


def test_a_live_lease_is_not_expired_until_the_owners_heartbeat_is_older_than_the_ttl(store):
    task_id, _, _ = running(store, lease_ttl=1.5)
    assert store.expire(actor="reaper", reason="ttl") == []
    assert state(store, task_id) is S.RUNNING
    expired = wait_until(lambda: store.expire(actor="reaper", reason="ttl"), message="lease expiry")
    assert [e.task_id for e in expired] == [task_id]
    assert store.history(task_id)[-2].actor == "reaper"


def test_renewing_the_heartbeat_keeps_the_lease_alive(store):
    alive_task, _, alive_owner = running(store, lease_ttl=3.0)
    dead_task, _, _ = running(store, lease_ttl=1.0)
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.is_set():
            assert store.renew(alive_owner)
            stop.wait(0.1)

    beat = threading.Thread(target=heartbeat)
    beat.start()
    try:
        expired = wait_until(
            lambda: store.expire(actor="reaper", reason="ttl"), message="dead lease expiry"
        )
    finally:
        stop.set()
        beat.join(10)
    assert [e.task_id for e in expired] == [dead_task]
    assert state(store, alive_task) is S.RUNNING


def test_a_stopped_owner_loses_its_leases_at_once(store):
    task_id, _, owner = running(store, lease_ttl=3600)
    other_task, _, _ = running(store, lease_ttl=3600)
    assert store.expire(actor="reaper", reason="ttl") == []
    store.stop_worker(owner, "warm shutdown")
    assert [e.task_id for e in store.expire(actor="reaper", reason="owner stopped")] == [task_id]
    assert state(store, other_task) is S.RUNNING


def test_a_task_whose_owner_has_no_row_is_expired(store):
    task_id = submit(store, lease_ttl=3600)
    claim(store, task_id, owner="never-registered")
    assert [e.task_id for e in store.expire(actor="reaper", reason="unknown owner")] == [task_id]


def test_expire_filters_by_owner_and_task_id(store):
    a_task, _, a_owner = running(store)
    b_task, _, _ = running(store)
    c_task, _, _ = running(store)
    got = store.expire(actor="w", reason="dead predecessor", owners=[a_owner], only_expired=False)
    assert [e.task_id for e in got] == [a_task]
    got = store.expire(actor="w", reason="child lost", task_ids=[c_task], only_expired=False)
    assert [e.task_id for e in got] == [c_task]
    assert state(store, b_task) is S.RUNNING


def test_expire_works_in_bounded_batches(store):
    tasks = [running(store)[0] for _ in range(5)]
    first = store.expire(actor="r", reason="x", only_expired=False, limit=2)
    assert len(first) == 2
    rest = store.expire(actor="r", reason="x", only_expired=False, limit=10)
    assert sorted(e.task_id for e in first + rest) == sorted(tasks)


def test_concurrent_expiry_sweeps_move_each_task_once(store):
    tasks = [running(store)[0] for _ in range(12)]
    barrier = threading.Barrier(4)
    results: list[list[str]] = []

    def sweep() -> None:
        barrier.wait(10)
        results.append(
            [e.task_id for e in store.expire(actor="r", reason="x", only_expired=False, limit=5)]
        )
        results.append([e.task_id for e in store.expire(actor="r", reason="x", only_expired=False)])

    threads = [threading.Thread(target=sweep) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    moved = [task_id for batch in results for task_id in batch]
    assert sorted(moved) == sorted(tasks)  # every task exactly once
    for task_id in tasks:
        assert trail(store, task_id).count((S.RUNNING, S.TIMEOUT)) == 1
        assert state(store, task_id) is S.RETRY_WAIT


def test_expired_unreaped_counts_expired_running_rows(store):
    _task_id, _, owner = running(store, lease_ttl=3600)
    assert store.expired_unreaped() == 0
    store.stop_worker(owner, "gone")
    assert store.expired_unreaped() == 1
    store.expire(actor="r", reason="x")
    assert store.expired_unreaped() == 0


def test_an_expired_lease_with_a_cancel_request_is_cancelled(store):
    task_id, lease, _ = running(store)
    store.request_cancel(task_id, actor="alice", reason="not needed")
    (expiry,) = store.expire(actor="r", reason="owner died", task_ids=[task_id], only_expired=False)
    assert expiry.to_state is S.CANCELLED
    record = store.get(task_id)
    assert record.state is S.CANCELLED and record.finished_at is not None
    assert trail(store, task_id)[-2:] == [(S.RUNNING, S.TIMEOUT), (S.TIMEOUT, S.CANCELLED)]
    assert store.take_due_retries(actor="r") == []
    assert store.finish(lease, S.SUCCEEDED, actor="old", reason="late") is False


def test_an_unknown_step_outcome_wins_over_a_cancel_request(store):
    task_id, lease, _ = running(store)
    store.step_started(lease, "charge", checkable=False)
    store.request_cancel(task_id, actor="alice", reason="not needed")
    (expiry,) = store.expire(actor="r", reason="owner died", task_ids=[task_id], only_expired=False)
    assert expiry.to_state is S.WAIT_MANUAL and "charge" in expiry.reason


# -- overrun (alive but over max_runtime) -------------------------------------------------


def test_overrun_goes_to_a_person_and_the_owner_may_still_finish(store):
    task_id, lease, owner = running(store, max_runtime=1.0, lease_ttl=5.0)
    assert store.overrun(actor="reaper") == []

    def overrun() -> list[str]:
        assert store.renew(owner)  # the owner is alive throughout
        return store.overrun(actor="reaper")

    assert wait_until(overrun, message="overrun detected") == [task_id]
    record = store.get(task_id)
    assert record.state is S.WAIT_MANUAL and "max_runtime" in record.reason
    assert store.expire(actor="reaper", reason="ttl") == []  # never re-run automatically
    assert store.take_due_retries(actor="reaper") == []

    # the still-running owner keeps its lease: its steps and outcome are accepted
    assert store.step_done(lease, "last", '"x"', idempotent=True)[0] is not None
    assert store.finish(lease, S.SUCCEEDED, actor="worker", reason="finished late", result='"ok"')
    assert store.get(task_id).result == "ok"
    assert trail(store, task_id)[-2:] == [(S.RUNNING, S.WAIT_MANUAL), (S.WAIT_MANUAL, S.SUCCEEDED)]


def test_overrun_owner_may_finish_failed_but_not_after_an_operator_acted(store):
    task_id, lease, owner = running(store, max_runtime=0.2, lease_ttl=5.0)
    wait_until(lambda: store.renew(owner) and store.overrun(actor="r"), message="overrun")
    assert store.finish(lease, S.FAILED, actor="worker", reason="raised", error="E")
    assert state(store, task_id) is S.FAILED

    other, other_lease, other_owner = running(store, max_runtime=0.2, lease_ttl=5.0)
    wait_until(lambda: store.renew(other_owner) and store.overrun(actor="r"), message="overrun")
    store.operator_move(other, S.PENDING, actor="alice", reason="re-run it")
    assert store.finish(other_lease, S.SUCCEEDED, actor="worker", reason="late") is False
    assert state(store, other) is S.PENDING


def test_overrun_ignores_tasks_without_max_runtime_and_dead_owners(store):
    plain, _, plain_owner = running(store, lease_ttl=5.0)
    dead, _, dead_owner = running(store, max_runtime=0.1, lease_ttl=5.0)
    store.stop_worker(dead_owner, "gone")
    wait_until(lambda: store.list_tasks(older_than=0.3), message="time passes (database clock)")
    store.renew(plain_owner)
    assert store.overrun(actor="r") == []
    assert state(store, plain) is S.RUNNING and state(store, dead) is S.RUNNING


# -- retries ------------------------------------------------------------------------------


def to_retry_wait(store: Store, task_id: str) -> None:
    """RUNNING -> TIMEOUT -> RETRY_WAIT (due now): a lease expiry the policy retries."""
    (expiry,) = store.expire(
        actor="reaper", reason="worker lost", task_ids=[task_id], only_expired=False
    )
    assert expiry.to_state is S.RETRY_WAIT


def test_schedule_retry_is_pending_at_once_and_due_in_database_time(store):
    task_id, lease, owner = running(store)
    message = '{"v": 1, "retry": true}'
    # due in a minute: however slow the machine, the claim below comes before it
    assert store.schedule_retry(
        lease, 60.0, actor="worker", reason="retry: timeout", error="TimeoutError", message=message
    )
    record = store.get(task_id)
    # the worker publishes the retry's message itself: no reaper sweep in between
    assert (record.state, record.retries, record.error) == (S.PENDING, 1, "TimeoutError")
    assert record.message == message and record.published_at is None
    assert record.eta is not None and record.next_retry_at is None
    assert trail(store, task_id)[-2:] == [(S.RUNNING, S.RETRY_WAIT), (S.RETRY_WAIT, S.PENDING)]
    assert store.take_due_retries(actor="reaper") == []
    early = store.claim(task_id, owner, "worker:w1@host")
    assert isinstance(early, Refusal) and early.early  # before its ETA, by database time
    t = store.t.tasks
    with store.engine.begin() as conn:  # the database's clock passes the ETA
        conn.execute(update(t).where(t.c.id == task_id).values(eta=after(db_now(), -0.001)))
    got = store.claim(task_id, owner, "worker:w1@host")
    assert isinstance(got, Claim) and got.retries == 1 and got.lease.attempt == 2


def test_a_requeued_retry_is_recorded_published_and_keeps_its_message(store):
    task_id, lease, _ = running(store)
    before = store.get(task_id).message
    assert store.schedule_retry(
        lease, 0.0, actor="worker", reason="rejected with requeue", error=None, requeued=True
    )
    record = store.get(task_id)
    assert record.state is S.PENDING and record.published_at is not None
    assert record.message == before


def test_take_due_retries_respects_the_limit(store):
    tasks = [running(store) for _ in range(3)]
    for task_id, _, _ in tasks:
        to_retry_wait(store, task_id)
    first = wait_until(lambda: store.take_due_retries(actor="r", limit=2), message="due")
    second = store.take_due_retries(actor="r", limit=2)
    assert len(first) == 2 and len(second) == 1
    assert {p.id for p in first + second} == {t for t, _, _ in tasks}


def test_a_future_retry_is_published_with_its_remaining_countdown(store):
    task_id, lease, _ = running(store)
    store.schedule_retry(lease, 3600, actor="w", reason="later", error=None)
    assert store.take_due_retries(actor="r") == []
    (pub,) = wait_until(store.take_unpublished, message="grace passed")
    assert pub.id == task_id and pub.countdown is not None and 3500 < pub.countdown <= 3600


# -- the row is the outbox: (re-)publishing ------------------------------------------------


def test_unpublished_row_is_taken_after_the_grace_and_reserved(make_store):
    store = make_store(publish_grace=1.5)
    task_id = submit(store)
    assert store.take_unpublished() == []  # the producer may still publish it
    (pub,) = wait_until(store.take_unpublished, message="grace passed")
    assert (pub.id, pub.args, pub.countdown) == (task_id, "[1,2]", None)
    assert store.take_unpublished() == []  # reserved for the reaper that took it
    store.mark_published([task_id])
    assert store.get(task_id).published_at is not None


def test_published_but_unclaimed_row_is_taken_after_republish_after(make_store):
    store = make_store(republish_after=3.0)
    lost, never = submit(store), submit(store)
    store.mark_published([lost])
    first = wait_until(store.take_unpublished, message="grace passed")
    assert [p.id for p in first] == [never]  # publish_grace (0.5 s) < republish_after (3 s)
    claim(store, never, register(store))  # re-published and delivered
    again = wait_until(store.take_unpublished, timeout=15, message="republish_after passed")
    assert [p.id for p in again] == [lost]


def test_a_lost_message_of_a_retried_task_is_republished_after_republish_after(make_store):
    store = make_store(republish_after=0.5)
    task_id = submit(store)
    owner = register(store)
    for _ in range(3):  # three ordinary retries, each published once
        store.mark_published([task_id])
        lease = claim(store, task_id, owner).lease
        assert store.schedule_retry(lease, 0.0, actor="w", reason="retry", error=None)
    store.mark_published([task_id])  # this message is lost
    published_at = store.get(task_id).published_at
    (pub,) = wait_until(store.take_unpublished, timeout=10, message="re-published")
    assert pub.id == task_id
    # first re-publish of this message: after republish_after, not 2**retries times that
    assert store.now() - published_at < timedelta(seconds=1.5)


def test_claimed_rows_are_never_republished(store):
    claimed = submit(store)
    claim(store, claimed, register(store))
    control = submit(store)
    taken = wait_until(store.take_unpublished, message="grace passed")
    assert [p.id for p in taken] == [control]


def test_unpublished_row_keeps_its_eta_as_a_countdown(store):
    task_id = submit(store, countdown=30.0)
    (pub,) = wait_until(store.take_unpublished, message="grace passed")
    assert pub.id == task_id
    assert pub.countdown is not None and 25.0 < pub.countdown <= 30.0


def test_a_published_row_with_a_future_eta_is_not_republished_before_it(make_store):
    store = make_store(republish_after=1.0)
    later, now_ = submit(store, countdown=2.5), submit(store)
    store.mark_published([later, now_])
    first = wait_until(store.take_unpublished, timeout=15, message="republish_after passed")
    assert [p.id for p in first] == [now_]
    claim(store, now_, register(store))  # re-published and delivered this time
    again = wait_until(store.take_unpublished, timeout=15, message="eta + republish_after passed")
    assert [p.id for p in again] == [later]


def test_take_unpublished_respects_the_limit(store):
    tasks = {submit(store) for _ in range(3)}
    # all three past the grace (database time) before taking any
    wait_until(lambda: len(store.list_tasks(older_than=0.6)) == 3, message="grace passed")
    first = store.take_unpublished(limit=2)
    second = store.take_unpublished(limit=2)
    assert len(first) == 2 and len(second) == 1
    assert {p.id for p in first + second} == tasks


# -- the reaper lock ----------------------------------------------------------------------


def test_lock_is_exclusive_renewable_and_released_only_by_its_holder(store):
    assert store.try_lock("reaper", "a", 30)
    assert not store.try_lock("reaper", "b", 30)
    assert store.try_lock("reaper", "a", 30)  # renewal
    assert store.try_lock("other", "b", 30)  # names are independent
    store.release_lock("reaper", "b")  # not the holder: no effect
    assert not store.try_lock("reaper", "b", 30)
    store.release_lock("reaper", "a")
    assert store.try_lock("reaper", "b", 30)


def test_an_expired_lock_can_be_taken_over(store):
    assert store.try_lock("reaper", "a", 1.0)
    assert not store.try_lock("reaper", "b", 1.0)
    wait_until(lambda: store.try_lock("reaper", "b", 30), message="lock expired")
    assert not store.try_lock("reaper", "a", 30)


@pytest.mark.parametrize("existing", [False, True], ids=["fresh", "expired"])
def test_racing_lock_takers_have_one_winner(store, existing):
    if existing:
        assert store.try_lock("reaper", "old", 0.2)
        wait_until(lambda: _lock_expired(store), message="lock expiry")
    holders = [f"h{i}" for i in range(6)]
    barrier = threading.Barrier(len(holders))
    won: list[str] = []

    def take(holder: str) -> None:
        barrier.wait(10)
        if store.try_lock("reaper", holder, 30):
            won.append(holder)

    threads = [threading.Thread(target=take, args=(h,)) for h in holders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(won) == 1, won


def _lock_expired(store: Store) -> bool:
    """Whether the 'reaper' lock's expiry is in the past (database time)."""
    from sqlalchemy import select

    lk = store.t.locks
    with store.engine.connect() as conn:
        expires = conn.execute(select(lk.c.expires_at).where(lk.c.name == "reaper")).scalar()
    return expires is not None and expires < store.now()


# -- operator transitions -----------------------------------------------------------------


def waiting_manual(store: Store) -> tuple[str, Lease]:
    """A task in WAIT_MANUAL (non-idempotent step in flight when its lease expired)."""
    task_id, lease, _ = running(store)
    store.step_done(lease, "reserve", '"r"', idempotent=True)
    store.step_started(lease, "charge", checkable=False)
    (expiry,) = store.expire(actor="reaper", reason="lost", task_ids=[task_id], only_expired=False)
    assert expiry.to_state is S.WAIT_MANUAL
    return task_id, lease


def test_operator_retry_re_runs_from_the_last_done_step(store):
    task_id, old_lease = waiting_manual(store)
    assert (
        store.operator_move(task_id, S.PENDING, actor="alice", reason="charge checked: none")
        is S.WAIT_MANUAL
    )
    record = store.get(task_id)
    assert record.state is S.PENDING and record.published_at is None
    assert set(store.load_steps(task_id)) == {"reserve"}  # done steps kept, unknown one dropped
    last = store.history(task_id)[-1]
    assert (last.from_state, last.to_state, last.actor, last.reason) == (
        S.WAIT_MANUAL,
        S.PENDING,
        "alice",
        "charge checked: none",
    )
    got = claim(store, task_id, register(store, "w2@host"))
    assert got.lease.attempt == 2
    assert store.finish(old_lease, S.SUCCEEDED, actor="old", reason="late") is False


def test_operator_resolve_and_fail(store):
    resolved, _ = waiting_manual(store)
    assert store.operator_move(
        resolved, S.SUCCEEDED, actor="bob", reason="done by hand", result='{"ok":true}'
    )
    record = store.get(resolved)
    assert (record.state, record.result) == (S.SUCCEEDED, {"ok": True})
    assert record.finished_at is not None

    failed, _ = waiting_manual(store)
    store.operator_move(failed, S.FAILED, actor="bob", reason="customer refunded")
    record = store.get(failed)
    assert (record.state, record.error) == (S.FAILED, "customer refunded")
    assert store.operator_move(failed, S.PENDING, actor="bob", reason="try again") is S.FAILED


@pytest.mark.parametrize(
    ("setup", "to"),
    [
        ("pending", S.SUCCEEDED),
        ("pending", S.FAILED),
        ("running", S.PENDING),
        ("succeeded", S.PENDING),
        ("succeeded", S.CANCELLED),
        ("cancelled", S.PENDING),
    ],
)
def test_illegal_operator_move_raises_and_changes_nothing(store, setup, to):
    if setup == "pending":
        task_id = submit(store)
    else:
        task_id, lease, _ = running(store)
        if setup != "running":
            store.finish(lease, S(setup.upper()), actor="w", reason="end")
    before = snapshot(store, task_id)
    with pytest.raises(IllegalTransition) as info:
        store.operator_move(task_id, to, actor="alice", reason="nope")
    assert info.value.from_state is state(store, task_id)
    assert info.value.to_state is to and info.value.task_id == task_id
    assert snapshot(store, task_id) == before


def test_operator_move_restricted_by_allowed(store):
    task_id, _ = waiting_manual(store)
    before = snapshot(store, task_id)
    with pytest.raises(IllegalTransition):
        store.operator_move(task_id, S.CANCELLED, actor="a", reason="x", allowed=[S.FAILED])
    assert snapshot(store, task_id) == before


def test_operator_move_of_an_unknown_task_raises_and_writes_nothing(store):
    submit(store)
    counts = store.counts()
    with pytest.raises(TaskNotFound) as info:
        store.operator_move("ghost", S.PENDING, actor="alice", reason="x")
    assert info.value.task_id == "ghost"
    with pytest.raises(TaskNotFound):
        store.request_cancel("ghost", actor="alice", reason="x")
    assert store.counts() == counts
    assert store.history("ghost") == [] and store.get("ghost") is None


# -- cancel -------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["pending", "retry_wait", "failed", "wait_manual"])
def test_cancel_outside_running_is_immediate(store, where):
    if where == "pending":
        task_id = submit(store)
    elif where == "wait_manual":
        task_id, _ = waiting_manual(store)
    else:
        task_id, lease, _ = running(store)
        if where == "retry_wait":
            to_retry_wait(store, task_id)
        else:
            store.finish(lease, S.FAILED, actor="w", reason="raised")
    found = state(store, task_id)
    assert store.request_cancel(task_id, actor="alice", reason="not needed") is found
    record = store.get(task_id)
    assert record.state is S.CANCELLED and record.finished_at is not None
    assert store.history(task_id)[-1].actor == "alice"
    assert isinstance(store.claim(task_id, register(store), "w"), Refusal)


def test_a_cancel_request_that_keeps_an_earlier_one_changes_nothing_else(store):
    # the worker records a revoke with terminate as a request; the lease's own cancel
    # (an operator's, who and why) sent that revoke and must not be overwritten by it
    task_id, _, _ = running(store)
    assert (
        store.request_cancel(task_id, actor="w", reason="revoked", keep_earlier=True) is S.RUNNING
    )
    record = store.get(task_id)
    assert (record.cancel_actor, record.cancel_reason) == ("w", "revoked")
    other, _, _ = running(store)
    store.request_cancel(other, actor="alice", reason="runaway")
    store.request_cancel(other, actor="w", reason="revoked", keep_earlier=True)
    record = store.get(other)
    assert (record.cancel_actor, record.cancel_reason) == ("alice", "runaway")


def test_cancel_while_running_is_a_request_the_task_acknowledges(store):
    task_id, lease, _ = running(store)
    assert store.check_lease(lease).cancel_requested is False
    assert store.request_cancel(task_id, actor="alice", reason="wrong customer") is S.RUNNING
    record = store.get(task_id)
    assert record.state is S.RUNNING
    assert (record.cancel_actor, record.cancel_reason) == ("alice", "wrong customer")
    assert record.cancel_requested_at is not None

    seen = store.check_lease(lease)
    assert seen.cancel_requested and seen.cancel_reason == "wrong customer"
    at_step = store.step_started(lease, "next", checkable=False)
    assert at_step is not None and at_step.cancel_requested
    assert store.finish(lease, S.CANCELLED, actor="worker", reason="cancelled at a step boundary")
    assert trail(store, task_id)[-1] == (S.RUNNING, S.CANCELLED)


def test_cancel_of_a_terminal_task_is_illegal(store):
    task_id, lease, _ = running(store)
    store.finish(lease, S.SUCCEEDED, actor="w", reason="ok")
    before = snapshot(store, task_id)
    with pytest.raises(IllegalTransition) as info:
        store.request_cancel(task_id, actor="alice", reason="too late")
    assert (info.value.from_state, info.value.to_state) == (S.SUCCEEDED, S.CANCELLED)
    assert snapshot(store, task_id) == before


# -- purge --------------------------------------------------------------------------------


def test_purge_deletes_old_finished_rows_with_their_steps_and_audit(store):
    done, lease, _ = running(store)
    store.step_done(lease, "a", '"x"', idempotent=True)
    store.finish(lease, S.SUCCEEDED, actor="w", reason="ok")
    pending = submit(store)
    live, _, _ = running(store)

    assert store.purge(older_than=3600, states_=[S.SUCCEEDED]) == 0
    assert (
        wait_until(lambda: store.purge(older_than=0.05, states_=[S.SUCCEEDED]), message="purge")
        == 1
    )
    assert store.get(done) is None and store.history(done) == [] and store.steps(done) == []
    assert {r.id for r in store.list_tasks()} == {pending, live}


def test_purge_only_touches_the_given_states_in_batches(store):
    finished = []
    for _ in range(3):
        task_id, lease, _ = running(store)
        store.finish(lease, S.SUCCEEDED, actor="w", reason="ok")
        finished.append(task_id)
    failed, lease, _ = running(store)
    store.finish(lease, S.FAILED, actor="w", reason="raised")
    last = max(store.get(t).finished_at for t in [*finished, failed])
    wait_until(lambda: store.now() - last > timedelta(seconds=0.2), message="rows age")

    assert store.purge(older_than=0.1, states_=[S.SUCCEEDED], batch=2) == 2
    assert store.purge(older_than=0.1, states_=[S.SUCCEEDED], batch=2) == 1
    assert store.purge(older_than=0.1, states_=[S.SUCCEEDED], batch=2) == 0
    assert all(store.get(t) is None for t in finished)
    assert state(store, failed) is S.FAILED


def test_a_purged_dedup_key_can_be_used_again(store):
    _task_id, lease, _ = running(store, dedup_key="k")
    store.finish(lease, S.SUCCEEDED, actor="w", reason="ok")
    wait_until(lambda: store.purge(older_than=0.05, states_=[S.SUCCEEDED]), message="purge")
    again = new_task(dedup_key="k")
    assert store.submit(again) == (again.id, True)


# -- workers ------------------------------------------------------------------------------


def test_registering_a_node_again_supersedes_its_live_incarnations(store):
    old = register(store, "node@host")
    other = register(store, "other@host")
    new_id = uuid.uuid4().hex
    assert store.register_worker(new_id, "node@host", "host", 123) == [old]
    rows = {w.id: w for w in store.workers()}
    assert rows[old].stopped_at is not None and new_id in rows[old].stop_reason
    assert rows[old].alive is False
    assert rows[new_id].alive and rows[new_id].pid == 123 and rows[new_id].stopped_at is None
    assert rows[other].alive
    assert store.renew(old) is False
    assert store.renew(new_id) is True
    assert store.renew("unknown") is False


def test_a_predecessors_tasks_are_expired_by_owner(store):
    task_id, _, old = running(store, nodename="w1@host", lease_ttl=3600)
    store.register_worker(uuid.uuid4().hex, "w1@host", "host", os.getpid())
    got = store.expire(actor="worker:w1@host", reason="dead predecessor", owners=[old])
    assert [e.task_id for e in got] == [task_id]


def test_workers_report_liveness_in_database_time_and_running_counts(store):
    _task_id, _, owner = running(store)
    submit(store)
    (row,) = store.workers()
    assert row.id == owner and row.alive and row.running == 1
    wait_until(lambda: not store.workers(ttl=0.5)[0].alive, message="heartbeat ages")
    assert store.workers(ttl=3600)[0].alive
    before = store.now()
    store.renew(owner)
    # renewed in database time: no matter how long this process then takes to read it
    (row,) = store.workers(ttl=3600)
    assert row.alive and row.heartbeat_at >= before
    store.stop_worker(owner, "warm shutdown")
    (row,) = store.workers(ttl=3600)
    assert row.alive is False and row.stop_reason == "warm shutdown"


def test_workers_are_listed_newest_first(store):
    ids = []
    for i in range(3):
        ids.append(register(store, f"n{i}@host"))
        wait_until(lambda: store.now() > store.workers()[0].started_at, message="clock ticks")
    assert [w.id for w in store.workers()] == list(reversed(ids))


# -- reads --------------------------------------------------------------------------------


def test_list_tasks_filters(store):
    a = submit(store, name="tests.a")
    b, _, owner = running(store, nodename="w1@host", name="tests.b")
    assert {r.id for r in store.list_tasks()} == {a, b}
    assert [r.id for r in store.list_tasks(state=S.PENDING)] == [a]
    assert [r.id for r in store.list_tasks(state="RUNNING")] == [b]
    assert [r.id for r in store.list_tasks(name="tests.a")] == [a]
    assert [r.id for r in store.list_tasks(worker=owner)] == [b]
    assert [r.id for r in store.list_tasks(worker="w1@host")] == [b]
    assert store.list_tasks(older_than=3600) == []
    assert len(store.list_tasks(limit=1)) == 1
    wait_until(lambda: len(store.list_tasks(older_than=0.1)) == 2, message="rows age")


def test_list_tasks_is_newest_first(store):
    first = submit(store)
    wait_until(lambda: store.now() > store.get(first).created_at, message="clock ticks")
    second = submit(store)
    assert [r.id for r in store.list_tasks()] == [second, first]


def test_counts_include_every_state(store):
    submit(store)
    submit(store)
    running(store)
    counts = store.counts()
    assert set(counts) == set(State)
    assert counts[S.PENDING] == 2 and counts[S.RUNNING] == 1
    assert sum(counts.values()) == 3


def test_oldest_pending_age(store):
    assert store.oldest_pending_age() is None
    submit(store)
    first = store.oldest_pending_age()
    assert first is not None and 0.0 <= first < 60
    later = wait_until(lambda: (age := store.oldest_pending_age()) > first and age, message="ages")
    assert later > first


# -- the audit trail ----------------------------------------------------------------------


def test_audit_trail_of_a_full_life(store):
    task_id, lease, owner = running(store)
    store.step_done(lease, "a", '"1"', idempotent=True)
    lease = recover(store, task_id, owner)  # lease expiry
    store.schedule_retry(lease, 0.0, actor="worker", reason="retryable error", error="E")
    lease = claim(store, task_id, owner).lease
    store.finish(lease, S.SUCCEEDED, actor="worker", reason="ok", result="1")

    assert trail(store, task_id) == [
        (None, S.PENDING),
        (S.PENDING, S.RUNNING),
        (S.RUNNING, S.TIMEOUT),
        (S.TIMEOUT, S.RETRY_WAIT),
        (S.RETRY_WAIT, S.PENDING),
        (S.PENDING, S.RUNNING),
        (S.RUNNING, S.RETRY_WAIT),
        (S.RETRY_WAIT, S.PENDING),
        (S.PENDING, S.RUNNING),
        (S.RUNNING, S.SUCCEEDED),
    ]
    history = store.history(task_id)
    assert [r.attempt for r in history] == [0, 1, 1, 1, 1, 2, 2, 2, 3, 3]
    assert all(a.at <= b.at for a, b in itertools.pairwise(history))
    assert check_audit(store, [task_id]) == 1


def test_audit_check_catches_a_state_changed_without_an_audit_row(store):
    task_id = submit(store)
    with store.engine.begin() as conn:
        conn.execute(
            update(store.t.tasks).where(store.t.tasks.c.id == task_id).values(state="RUNNING")
        )
    with pytest.raises(AssertionError, match="last audit row"):
        check_audit(store, [task_id])
    with store.engine.begin() as conn:  # put it back for the teardown check
        conn.execute(
            update(store.t.tasks).where(store.t.tasks.c.id == task_id).values(state="PENDING")
        )


# -- database time only -------------------------------------------------------------------


@pytest.mark.parametrize("skew", [-600.0, 600.0], ids=["behind", "ahead"])
def test_decisions_do_not_depend_on_the_process_clock(store, monkeypatch, skew):
    live_task, live_lease, live_owner = running(store, lease_ttl=3.0)
    dead_task, _, _ = running(store, lease_ttl=0.3)
    retry_task, retry_lease, retry_owner = running(store, lease_ttl=3600)
    pending = submit(store)
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + skew)

    # the store's clock is the database's, within seconds of the real one
    assert abs(store.now() - datetime.fromtimestamp(real_time(), timezone.utc)) < timedelta(
        seconds=30
    )
    # a fresh lease, a future retry and a just-submitted row are judged by database time
    store.schedule_retry(retry_lease, 1.5, actor="w", reason="later", error=None)
    early = store.claim(retry_task, retry_owner, "w")
    assert isinstance(early, Refusal) and early.early
    expired = wait_until(
        lambda: store.renew(live_owner) and store.expire(actor="r", reason="ttl"), message="ttl"
    )
    assert [e.task_id for e in expired] == [dead_task]
    assert state(store, live_task) is S.RUNNING
    assert store.check_lease(live_lease) is not None
    assert pending in {p.id for p in wait_until(store.take_unpublished, message="grace")}
    wait_until(
        lambda: isinstance(store.claim(retry_task, retry_owner, "w"), Claim), message="retry due"
    )


FORBIDDEN_CLOCKS = re.compile(
    r"\btime\.time\(|\bdatetime\.(now|utcnow|today)\(|\bdate\.today\(|\btime\.time_ns\("
)


def test_store_code_never_reads_the_process_clock():
    offenders = []
    for path in Path(store_package.__file__).parent.glob("*.py"):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if FORBIDDEN_CLOCKS.search(line.split("#", 1)[0]):
                offenders.append(f"{path.name}:{lineno}: {line.strip()}")
    assert offenders == []
