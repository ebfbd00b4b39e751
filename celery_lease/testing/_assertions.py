"""Assertions that read as celery-lease's guarantees, against the store a test used."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .. import states
from ..check import check
from ..records import TaskRecord
from ..states import State
from ..store import REOPENABLE, Store
from ._worker import _task_id


def assert_audit_trail(store: Store, tasks: Iterable[Any] | None = None) -> int:
    """Assert the audit trail of every task (or of ``tasks``) is consistent.

    Every row is a legal transition with an actor, the first creates the row
    (``None -> PENDING``), each starts where the previous one ended, attempts never
    go back, and the task's state is the last row's. A task id submitted again after
    its run finished (SUCCEEDED or FAILED) has a fresh row: its trail goes on with a
    new ``None -> PENDING`` and attempts from zero. Returns how many tasks it checked.
    """
    ids = (
        [_task_id(t) for t in tasks]
        if tasks is not None
        else [r.id for r in store.list_tasks(limit=100_000)]
    )
    for task_id in ids:
        record = store.get(task_id)
        assert record is not None, f"task {task_id} has no row"
        trail = store.history(task_id)
        assert trail, f"task {task_id} has no audit rows"
        assert trail[0].from_state is None and trail[0].to_state is State.PENDING, trail[0]
        for prev, row in itertools.pairwise(trail):
            if row.from_state is None:  # a new run of the id: a fresh row
                assert prev.to_state in REOPENABLE and row.to_state is State.PENDING, (
                    f"{task_id}: a new row after {prev}: {row}"
                )
                continue
            assert row.from_state is prev.to_state, f"{task_id}: audit gap {prev} -> {row}"
            assert row.attempt >= prev.attempt, f"{task_id}: attempt went back in {row}"
        for row in trail:
            assert states.is_legal(row.from_state, row.to_state), (
                f"{task_id}: illegal audit row {row}"
            )
            assert row.actor, f"{task_id}: audit row without actor {row}"
        assert record.state is trail[-1].to_state, (
            f"task {task_id} is {record.state} but its last audit row says {trail[-1].to_state}"
        )
    return len(ids)


def assert_steps(
    store: Store, task: Any, expected: Sequence[str] | Mapping[str, str]
) -> dict[str, str]:
    """Assert the task's recorded steps: a list of names (each DONE, in that order) or
    a mapping of name to state (``"DONE"``, ``"STARTED"``). Returns name -> state."""
    task_id = _task_id(task)
    recorded = store.steps(task_id)
    found = {s.name: s.state for s in recorded}
    if isinstance(expected, Mapping):
        assert found == dict(expected), f"task {task_id}: steps {found}, expected {expected}"
    else:
        names = [s.name for s in recorded]
        assert names == list(expected), f"task {task_id}: steps {names}, expected {expected}"
        undone = {n: st for n, st in found.items() if st != "DONE"}
        assert not undone, f"task {task_id}: steps not done: {undone}"
    return found


def assert_finished(
    store: Store,
    task: Any,
    state: State | str = State.SUCCEEDED,
    *,
    steps: Sequence[str] | Mapping[str, str] | None = None,
    attempts: int | None = None,
) -> TaskRecord:
    """Assert a task ended in ``state`` with a consistent audit trail; return its record.

    Args:
        store: the test's store.
        task: an ``AsyncResult`` or a task id.
        state: the state it must be in (default SUCCEEDED).
        steps: its recorded steps, as :func:`assert_steps` takes them.
        attempts: how many attempts it took.
    """
    task_id = _task_id(task)
    record = store.get(task_id)
    assert record is not None, f"task {task_id} has no row"
    want = State(state)
    assert record.state is want, (
        f"task {task_id} is {record.state.value}, expected {want.value}"
        f" (reason: {record.reason!r}, error: {record.error!r})"
    )
    assert_audit_trail(store, [task_id])
    if steps is not None:
        assert_steps(store, task_id, steps)
    if attempts is not None:
        assert record.attempt == attempts, (
            f"task {task_id} took {record.attempt} attempts, expected {attempts}"
        )
    return record


def assert_check_clean(app_or_store: Any, *, liveness: bool = False) -> None:
    """Assert :func:`celery_lease.check.check` finds no broken invariant.

    Liveness checks (a row stuck longer than its deadlines) are off by default: a test
    that just killed a worker may hold rows that are legitimately waiting for it.
    """
    found = check(app_or_store, liveness=liveness)
    assert found == [], "invariant violations:\n" + "\n".join(map(str, found))
