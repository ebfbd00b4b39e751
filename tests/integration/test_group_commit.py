"""Group commit (PostgreSQL): single submissions that arrive while another one of the
same process is being written wait for it, then share one statement and one commit.

A first submission is held in its write by a row lock (an uncommitted insert of the
same id on another connection); the submissions made meanwhile queue up behind it,
and are written together once it is done, each answered as if it had been alone.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from sqlalchemy import event

from celery_lease.exceptions import StoreDataError
from celery_lease.states import State
from celery_lease.store import NewTask, Store

from ..helpers import wait_until

pytestmark = pytest.mark.postgres


def new_task(**overrides: Any) -> NewTask:
    values: dict[str, Any] = {
        "id": uuid.uuid4().hex,
        "name": "tests.job",
        "args": "[1,2]",
        "kwargs": "{}",
        "options": "{}",
        "lease_ttl": 1.0,
        "max_recoveries": 5,
    }
    values.update(overrides)
    return NewTask(**values)


@pytest.fixture
def pg_store(make_store: Any, backend: str) -> Store:
    if backend != "postgresql":
        pytest.skip("group commit is PostgreSQL's (SQLite has one writer at a time)")
    store: Store = make_store(db_timeout=30.0)
    return store


def _in_thread(store: Store, new: NewTask, out: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        try:
            out[new.id] = store.submit(new)
        except BaseException as error:  # handed to the test
            out[new.id] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _wait_queued(store: Store, n: int) -> None:
    wait_until(lambda: len(store._group._queue) == n, 10, message=f"{n} submissions waiting")


def test_submissions_waiting_for_a_write_share_one_statement(pg_store: Store) -> None:
    store = pg_store
    held = new_task()
    first = new_task(dedup_key="invoice-1")
    second = new_task(dedup_key="invoice-1")  # the same key as `first`: one row
    third = new_task()
    batches: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "json_to_recordset" in statement:
            batches.append(statement)

    event.listen(store.engine, "before_cursor_execute", count)
    answers: dict[str, Any] = {}
    try:
        with store.engine.begin() as blocking:
            store.submit(held, conn=blocking)  # its row locked until this block ends
            leader = _in_thread(store, held, answers)  # waits for that row's lock
            wait_until(lambda: store._group._busy, 10, message="the first submission writing")
            threads = []
            for new in (first, second, third):
                threads.append(_in_thread(store, new, answers))
                # queued in this order: the first of two rows with one key wins
                _wait_queued(store, len(threads))
        for thread in (leader, *threads):
            thread.join(30)
    finally:
        event.remove(store.engine, "before_cursor_execute", count)

    # the held one: its id was written by the other transaction, nothing more
    assert answers[held.id] == (held.id, False)
    # the three that waited: one statement, each answered as alone
    assert len(batches) == 1
    assert answers[first.id] == (first.id, True)
    assert answers[second.id] == (first.id, False)
    assert answers[third.id] == (third.id, True)
    assert store.get(second.id) is None
    for task_id in (held.id, first.id, third.id):
        record = store.get(task_id)
        assert record is not None and record.state is State.PENDING
        assert [(h.from_state, h.to_state) for h in store.history(task_id)] == [
            (None, State.PENDING)
        ]
    assert not store._group._busy and not store._group._queue


def test_a_value_refused_in_a_shared_write_fails_only_its_own_caller(pg_store: Store) -> None:
    store = pg_store
    held = new_task()
    # a value the column refuses (name is VARCHAR(255)): the shared statement fails
    bad = new_task(name="x" * 10_000)
    good = new_task()
    answers: dict[str, Any] = {}
    with store.engine.begin() as blocking:
        store.submit(held, conn=blocking)
        leader = _in_thread(store, held, answers)
        wait_until(lambda: store._group._busy, 10, message="the first submission writing")
        threads = [_in_thread(store, bad, answers)]
        wait_until(lambda: len(store._group._queue) == 1, 10, message="one waiting")
        threads.append(_in_thread(store, good, answers))
        wait_until(lambda: len(store._group._queue) == 2, 10, message="two waiting")
    for thread in (leader, *threads):
        thread.join(30)
    assert answers[held.id] == (held.id, False)
    assert isinstance(answers[bad.id], StoreDataError)
    assert store.get(bad.id) is None and store.history(bad.id) == []
    assert answers[good.id] == (good.id, True)
    assert store.get(good.id) is not None
    # the next submission writes alone again
    after = new_task()
    assert store.submit(after) == (after.id, True)
    assert not store._group._busy and not store._group._queue


def test_many_threads_submitting_at_once_get_one_row_per_id_and_key(pg_store: Store) -> None:
    store = pg_store
    threads_n, per_thread = 8, 25
    # every thread submits its own tasks, and one task of each of 5 shared dedup keys
    work = [
        [new_task() for _ in range(per_thread)] + [new_task(dedup_key=f"k{j}") for j in range(5)]
        for _ in range(threads_n)
    ]
    answers: dict[str, Any] = {}
    barrier = threading.Barrier(threads_n)

    def run(tasks: list[NewTask]) -> None:
        barrier.wait()
        for new in tasks:
            try:
                answers[new.id] = store.submit(new)
            except BaseException as error:  # handed to the test
                answers[new.id] = error

    threads = [threading.Thread(target=run, args=(tasks,)) for tasks in work]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads)
    own = [new for tasks in work for new in tasks if new.dedup_key is None]
    assert all(answers[new.id] == (new.id, True) for new in own)
    for j in range(5):
        keyed = [new for tasks in work for new in tasks if new.dedup_key == f"k{j}"]
        winners = {answers[new.id][0] for new in keyed}
        assert len(winners) == 1  # every caller of the key got the one task holding it
        created = [new for new in keyed if answers[new.id][1]]
        assert [new.id for new in created] == list(winners)
    assert store.counts()[State.PENDING] == threads_n * per_thread + 5
    assert not store._group._busy and not store._group._queue


def test_a_submission_from_inside_a_write_is_written_alone(pg_store: Store) -> None:
    store = pg_store
    inner = new_task()
    seen: list[Any] = []
    fired: list[bool] = []

    def listener(events: Any) -> None:
        # a transition listener that submits (once): it runs inside the write that
        # announced the transition, on the same thread
        if not fired:
            fired.append(True)  # before: the inner submission announces its own row
            seen.append(store.submit(inner))

    store.listeners.append(listener)
    outer = new_task()
    assert store.submit(outer) == (outer.id, True)
    assert seen == [(inner.id, True)]
    assert store.get(inner.id) is not None
