"""Uniqueness windows of a dedup key: ``unique_for``, ``unique_while``, ``on_conflict``.

On the real stores (SQLite and PostgreSQL): a key deduplicates inside its window and
states and is taken from its holder after them, in the transaction of the new row;
``"raise"`` and ``"replace"``; eight processes submitting one key at once write one
row per window; a real worker runs a debounced task once, with the last arguments.
"""

from __future__ import annotations

import multiprocessing
import os
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import select, update

from celery_lease import (
    ConfigurationError,
    DuplicateSubmission,
    InvalidSubmission,
    LeasedTask,
    State,
)
from celery_lease.config import from_mapping
from celery_lease.producer.submission import uniqueness
from celery_lease.store import Claim, NewTask, Refusal, Replacement, Store, Unique
from celery_lease.store.schema import after, db_now

from ..crash.support import CLEAN_RUN, LeaseEnv, queue_depth
from ..helpers import wait_until

S = State


def new_task(dedup_key: str = "k", args: str = "[1]", **overrides: Any) -> NewTask:
    values: dict[str, Any] = {
        "id": uuid.uuid4().hex,
        "name": "tests.job",
        "args": args,
        "kwargs": "{}",
        "options": "{}",
        "lease_ttl": 30.0,
        "max_recoveries": 5,
        "dedup_key": dedup_key,
        "message": '{"v": 1}',
    }
    values.update(overrides)
    return NewTask(**values)


def register(store: Store) -> str:
    worker_id = uuid.uuid4().hex
    store.register_worker(worker_id, f"w-{worker_id[:6]}@host", "host", os.getpid())
    return worker_id


def window_passed(store: Store, task_id: str, seconds: float) -> bool:
    """Whether ``seconds`` have passed since the row's submission, by the database's clock."""
    t = store.t.tasks
    with store.engine.connect() as conn:
        return bool(
            conn.execute(
                select(after(t.c.created_at, seconds) <= db_now()).where(t.c.id == task_id)
            ).scalar()
        )


def age(store: Store, task_id: str, seconds: float) -> None:
    """Move the row's submission ``seconds`` back: for its window, as if that much
    database time had passed (nothing else reads ``created_at`` in these tests)."""
    t = store.t.tasks
    with store.engine.begin() as conn:
        conn.execute(
            update(t).where(t.c.id == task_id).values(created_at=after(t.c.created_at, -seconds))
        )


def holder(store: Store, key: str) -> str | None:
    t = store.t.tasks
    with store.engine.connect() as conn:
        value = conn.execute(select(t.c.id).where(t.c.dedup_key == key)).scalar()
    return None if value is None else str(value)


# -- the store -----------------------------------------------------------------------------


def test_a_window_deduplicates_until_it_ends_then_a_new_task_takes_the_key(store: Store) -> None:
    window = Unique(unique_for=0.3)
    first = new_task(args="[1]")
    assert store.submit_unique(first, window).outcome == "created"
    # a window an hour long, from the same first submission: a duplicate
    dup = store.submit_unique(new_task(args="[2]"), Unique(unique_for=3600))
    assert (dup.task_id, dup.outcome, dup.state) == (first.id, "duplicate", S.PENDING)
    # a short window: waited for by the database's own clock (0.3 s, bounded)
    wait_until(lambda: window_passed(store, first.id, 0.3), timeout=10, message="window over")
    second = new_task(args="[3]")
    assert store.submit_unique(second, window).outcome == "created"
    assert holder(store, "k") == second.id
    old = store.get(first.id)
    assert old is not None and old.dedup_key is None and old.state is S.PENDING
    assert old.args == [1]
    # without options the key holds as before: the new holder answers
    assert store.submit(new_task()) == (second.id, False)
    assert len(store.list_tasks()) == 2


def test_unique_while_deduplicates_only_in_the_states_named(store: Store) -> None:
    live = Unique(unique_while=frozenset({S.PENDING, S.RUNNING}))
    first = new_task()
    assert store.submit_unique(first, live).outcome == "created"
    assert store.submit_unique(new_task(), live).task_id == first.id
    owner = register(store)
    claim = store.claim(first.id, owner, "worker:w")
    assert isinstance(claim, Claim)
    dup = store.submit_unique(new_task(), live)
    assert (dup.task_id, dup.outcome, dup.state) == (first.id, "duplicate", S.RUNNING)
    assert store.finish(claim.lease, S.SUCCEEDED, actor="w", reason="done", result="1")
    again = new_task()
    assert store.submit_unique(again, live).outcome == "created"
    assert holder(store, "k") == again.id
    # a PENDING holder outside unique_while={RUNNING} gives the key up at once
    running_only = Unique(unique_while=frozenset({S.RUNNING}))
    third = new_task()
    assert store.submit_unique(third, running_only).outcome == "created"
    assert [r.state for r in store.list_tasks()].count(S.PENDING) == 2
    assert holder(store, "k") == third.id


def test_a_window_and_states_together_deduplicate_while_both_hold(store: Store) -> None:
    first = new_task()
    both = Unique(unique_for=3600, unique_while=frozenset({S.PENDING}))
    assert store.submit_unique(first, both).outcome == "created"
    assert store.submit_unique(new_task(), both).outcome == "duplicate"
    store.request_cancel(first.id, actor="operator:test", reason="not needed")
    assert store.submit_unique(new_task(), both).outcome == "created"


def replacement(args: str, revision: str) -> Any:
    return lambda task_id: Replacement(
        args=args,
        kwargs="{}",
        options="{}",
        message=f'{{"v": 1, "args": {args}}}',
        revision=revision,
    )


def test_replace_writes_the_new_arguments_and_a_stale_message_is_refused(store: Store) -> None:
    first = new_task(args="[1]")
    debounce = Unique(on_conflict="replace")
    assert store.submit_unique(first, debounce, replacement("[0]", "r0")).outcome == "created"
    answer = store.submit_unique(new_task(args="[2]"), debounce, replacement("[2]", "r2"))
    assert (answer.task_id, answer.outcome) == (first.id, "replaced")
    answer = store.submit_unique(new_task(args="[3]"), debounce, replacement("[3]", "r3"))
    assert (answer.task_id, answer.outcome) == (first.id, "replaced")
    row = store.get(first.id)
    assert row is not None and row.state is S.PENDING and row.args == [3]
    assert row.message == '{"v": 1, "args": [3]}' and row.published_at is None
    owner = register(store)
    # the first message (no revision) and the second (an older one) are refused
    for stale in (None, "r2"):
        refusal = store.claim(first.id, owner, "worker:w", revision=stale)
        assert isinstance(refusal, Refusal) and "stale" in refusal.why
    claims = store.claim_many([(first.id, uuid.uuid4().hex)], owner, "worker:w")
    assert claims == {}  # a claim ahead is for a message without a revision: refused
    claim = store.claim(first.id, owner, "worker:w", revision="r3")
    assert isinstance(claim, Claim) and claim.lease.attempt == 1
    # claimed: nothing more to replace, the submission returns the task
    late = store.submit_unique(new_task(args="[4]"), debounce, replacement("[4]", "r4"))
    assert (late.task_id, late.outcome, late.state) == (first.id, "duplicate", S.RUNNING)
    assert store.get(first.id).args == [3]  # type: ignore[union-attr]
    assert store.finish(claim.lease, S.SUCCEEDED, actor="w", reason="done", result="3")
    assert [h.to_state for h in store.history(first.id)] == [S.PENDING, S.RUNNING, S.SUCCEEDED]


def test_a_task_id_already_taken_is_the_answer(store: Store) -> None:
    first = new_task()
    assert store.submit_unique(first, Unique(unique_for=60)).outcome == "created"
    same = replace(first, dedup_key="other")
    answer = store.submit_unique(same, Unique(unique_for=60))
    assert (answer.task_id, answer.outcome) == (first.id, "duplicate")


# -- eight processes, one key --------------------------------------------------------------


def submit_unique_in_process(
    config: Any, new: NewTask, unique: Unique, barrier: Any, results: Any
) -> None:
    """Child process: submit ``new`` with ``unique`` once every child is ready."""
    store = Store(config)
    try:
        store.ping()
        barrier.wait(60)
        answer = store.submit_unique(new, unique)
        results.put((answer.task_id, answer.outcome))
    except BaseException as exc:
        results.put(("error", repr(exc)))
        raise
    finally:
        store.dispose()


def race(store: Store, unique: Unique, n: int = 8) -> list[tuple[str, str]]:
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [
        ctx.Process(
            target=submit_unique_in_process,
            args=(store.config, new_task(args=f"[{i}]"), unique, barrier, results),
        )
        for i in range(n)
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    results.close()
    results.join_thread()
    assert all(p.exitcode == 0 for p in procs), outcomes
    return outcomes


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_eight_processes_submitting_one_key_write_one_row_per_window(store: Store) -> None:
    window = Unique(unique_for=3600, unique_while=frozenset({S.PENDING, S.RUNNING}))
    first = race(store, window)
    winners = [tid for tid, outcome in first if outcome == "created"]
    assert len(winners) == 1, first
    assert {tid for tid, _ in first} == set(winners)
    # the window of the first row ends (its submission two hours back): the next race
    # takes the key from it, once
    age(store, winners[0], 7200)
    second = race(store, window)
    new = [tid for tid, outcome in second if outcome == "created"]
    assert len(new) == 1 and new != winners, second
    assert {tid for tid, _ in second} == set(new)
    # the first row leaves unique_while's states: the third race takes the key, once
    store.request_cancel(new[0], actor="operator:test", reason="out of the states")
    third = race(store, window)
    last = [tid for tid, outcome in third if outcome == "created"]
    assert len(last) == 1 and last[0] not in winners + new, third
    rows = store.list_tasks()
    assert sorted(r.id for r in rows) == sorted(winners + new + last)
    assert holder(store, "k") == last[0]
    for r in rows:
        assert len(store.history(r.id)) in (1, 2)  # created (and the cancel)


# -- apply_async with real workers -----------------------------------------------------------

PROJECT = """
from celery_lease import LeasedTask, State

@app.task(base=LeasedTask, shared=False, name="u.echo")
def echo(x):
    return x

@app.task(base=LeasedTask, shared=False, name="u.once", unique_for=3600,
          unique_while=[State.PENDING, State.RUNNING], on_conflict="raise")
def once(x):
    return x
"""


@pytest.fixture
def project(lease_env: LeaseEnv, tmp_path: Path) -> Any:
    backend = f"db+sqlite:///{tmp_path / 'results.sqlite3'}"
    return lease_env.project(source=PROJECT, settings={"result_backend": backend})


def test_on_conflict_raise_and_return_and_task_defaults(project: Any) -> None:
    app = project.module.app
    echo, once = app.tasks["u.echo"], app.tasks["u.once"]
    first = once.apply_async((1,), dedup_key="d")
    with pytest.raises(DuplicateSubmission) as info:
        once.apply_async((2,), dedup_key="d")
    assert info.value.task_id == first.id and first.id in str(info.value)
    assert isinstance(info.value, ValueError)
    # a call's option wins over the task's default
    assert once.apply_async((3,), dedup_key="d", on_conflict="return").id == first.id
    e = echo.apply_async((1,), dedup_key="e", unique_for=60)
    assert echo.apply_async((2,), dedup_key="e", unique_for=60).id == e.id
    assert len(project.store.list_tasks()) == 2


def test_bad_options_fail_before_anything_is_written(project: Any) -> None:
    app = project.module.app
    echo = app.tasks["u.echo"]
    bad: list[dict[str, Any]] = [
        {"dedup_key": "x", "unique_for": 0},
        {"dedup_key": "x", "unique_for": -1},
        {"dedup_key": "x", "unique_for": float("inf")},
        {"dedup_key": "x", "unique_for": float("nan")},
        {"dedup_key": "x", "unique_for": "60"},
        {"dedup_key": "x", "unique_while": ["PENDING", "NAPPING"]},
        {"dedup_key": "x", "unique_while": "PENDING"},
        {"dedup_key": "x", "unique_while": []},
        {"dedup_key": "x", "on_conflict": "ignore"},
        {"unique_for": 60},
        {"unique_while": [State.PENDING]},
        {"on_conflict": "raise"},
    ]
    for options in bad:
        with pytest.raises(InvalidSubmission) as info:
            echo.apply_async((1,), **options)
        assert isinstance(info.value, ValueError), options
        named = next(k for k in options if k != "dedup_key")
        assert info.value.argument == named and named in str(info.value), options
    with pytest.raises(InvalidSubmission, match="submit_many"):
        echo.submit_many([{"args": (1,), "dedup_key": "x"}], unique_for=5)
    # refused, not ignored: a task's defaults where they do not apply yet
    once = app.tasks["u.once"]
    with pytest.raises(InvalidSubmission, match="submit_many"):
        once.submit_many([{"args": (1,), "dedup_key": "x"}])
    with project.store.engine.connect() as conn, conn.begin():
        with pytest.raises(InvalidSubmission, match="connection="):
            echo.apply_async((1,), dedup_key="x", unique_for=5, connection=conn)
        with pytest.raises(InvalidSubmission, match="connection="):
            once.apply_async((1,), dedup_key="x", connection=conn)
    assert project.store.list_tasks() == []


@pytest.mark.parametrize(
    "options",
    [
        {"unique_for": -5},
        {"unique_for": True},
        {"unique_while": ["DONE"]},
        {"on_conflict": "merge"},
    ],
)
def test_bad_task_options_are_refused_at_submission(options: dict[str, Any]) -> None:
    # binding keeps the error (a worker of the app refuses to start with it: exit 78,
    # tests/integration/test_durations.py); a submission raises it before any write
    app = Celery("bad", set_as_current=False)

    @app.task(base=LeasedTask, shared=False, name="bad.task", **options)
    def task() -> None:
        pass

    app.finalize()
    name = next(iter(options))
    with pytest.raises(ConfigurationError, match=name):
        task.lease_options(from_mapping(app.conf))
    with pytest.raises(ConfigurationError, match=name):
        uniqueness(task, "k")  # what apply_async with a dedup_key checks first


@pytest.mark.parametrize("broker_url", ["redis", "amqp"], indirect=True)
def test_a_debounced_task_runs_once_with_the_last_arguments(
    lease_env: LeaseEnv, broker_url: str, queue_name: str, tmp_path: Path
) -> None:
    backend = f"db+sqlite:///{tmp_path / 'results.sqlite3'}"
    p = lease_env.project(
        broker_url=broker_url, source=PROJECT, settings={"result_backend": backend}
    )
    echo = p.module.app.tasks["u.echo"]
    handles = [
        echo.apply_async((i,), dedup_key="debounce", on_conflict="replace") for i in range(4)
    ]
    assert {h.id for h in handles} == {handles[0].id}
    task_id = handles[0].id
    # four messages sent (the first task's, then one per replacement), one row
    wait_until(lambda: queue_depth(broker_url, queue_name) == 4, message="4 messages queued")
    assert p.get(task_id).args == [3]
    p.worker(concurrency=2)
    record = p.wait_state(task_id, S.SUCCEEDED, timeout=60)
    assert record.result == 3 and record.attempt == 1
    assert handles[-1].get(timeout=30) == 3
    wait_until(lambda: queue_depth(broker_url, queue_name) == 0, message="queue drained")
    assert p.trail(task_id) == CLEAN_RUN
    assert len(p.store.list_tasks()) == 1
    # the key still holds (no window): a later submission returns the task
    assert echo.apply_async((9,), dedup_key="debounce").id == task_id
