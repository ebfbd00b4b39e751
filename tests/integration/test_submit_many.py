"""Bulk submission: ``LeasedTask.submit_many`` and ``celery_lease.bulk()``.

The rows are written in multi-row statements (counted with SQLAlchemy events), before
any message is published; duplicates by dedup key are reported per item; real
workers then run every task once, a group's and a chord's too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import chord, group
from sqlalchemy import event

import celery_lease
from celery_lease import InvalidSubmission, NotSerializable, State, Submitted
from celery_lease._runtime import runtime
from celery_lease.store import NewTask, Store
from celery_lease.store._submit import BATCH_SIZE

from ..crash.support import LeaseEnv, queue_depth
from ..helpers import wait_until


class Inserts:
    """Statements inserting into the tasks table of ``store`` (executemany counts once)."""

    def __init__(self, store: Store) -> None:
        self.count = 0
        self.table = store.t.tasks.name
        self.engine = store.engine

    def __enter__(self) -> Inserts:
        event.listen(self.engine, "before_cursor_execute", self._seen)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(self.engine, "before_cursor_execute", self._seen)

    def _seen(self, conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        # PostgreSQL writes one row with its audit row as one statement, "WITH ... INSERT"
        # (the table's name may be schema-qualified)
        if re.search(rf"INSERT INTO (\S+\.)?\"?{self.table}\b", statement, re.IGNORECASE):
            self.count += 1


def new_task(task_id: str, dedup_key: str | None = None, countdown: float | None = None) -> NewTask:
    return NewTask(
        id=task_id,
        name="tests.job",
        args="[1]",
        kwargs="{}",
        options=None,
        lease_ttl=30.0,
        max_recoveries=5,
        dedup_key=dedup_key,
        countdown=countdown,
        message='{"v": 1}',
    )


# -- the store ----------------------------------------------------------------------------


def test_rows_go_in_one_statement_per_batch_with_their_audit_rows(store: Store) -> None:
    rows = [new_task(f"bulk-{i}") for i in range(BATCH_SIZE + 7)]
    with Inserts(store) as inserts:
        answers = store.submit_many(rows)
    assert answers == [(r.id, True) for r in rows]
    assert inserts.count == 2  # two batches: 500 + 7 rows
    assert len(store.list_tasks(state=State.PENDING, limit=10_000)) == len(rows)
    history = store.history("bulk-3")
    assert [(h.from_state, h.to_state, h.actor) for h in history] == [
        (None, State.PENDING, "producer")
    ]
    assert store.get("bulk-3").message == '{"v": 1}'


def test_duplicates_are_reported_per_item_within_and_across_calls(store: Store) -> None:
    (first,) = store.submit_many([new_task("a", dedup_key="order:1")])
    answers = store.submit_many(
        [
            new_task("b", dedup_key="order:1"),  # an earlier call's key
            new_task("c", dedup_key="order:2"),
            new_task("d", dedup_key="order:2"),  # the same key earlier in this call
            new_task("a"),  # an existing id
            new_task("e"),
        ]
    )
    assert first == ("a", True)
    assert answers == [("a", False), ("c", True), ("c", False), ("a", False), ("e", True)]
    assert {r.id for r in store.list_tasks(limit=100)} == {"a", "c", "e"}
    assert [h.to_state for h in store.history("c")] == [State.PENDING]


def test_a_countdown_is_an_eta_in_database_time(store: Store) -> None:
    store.submit_many([new_task("later", countdown=3600), new_task("now")])
    later, now = store.get("later"), store.get("now")
    assert later.eta is not None and now.eta is None
    assert 3500 < (later.eta - later.created_at).total_seconds() <= 3600


def test_every_column_of_a_batch_is_stored_as_submit_stores_it(store: Store) -> None:
    from dataclasses import replace
    from datetime import datetime, timezone

    eta = datetime(2031, 5, 6, 7, 8, 9, 123456, tzinfo=timezone.utc)
    full = replace(
        new_task("full", dedup_key="k:é\u2603"),
        args='[1, "two \\" \u00e9"]',
        kwargs='{"x": null}',
        options='{"queue": "q"}',
        eta=eta,
        max_runtime=12.5,
        max_retries=7,
        on_timeout="manual",
        on_exhausted="manual",
        lease_ttl=42.0,
        max_recoveries=3,
        message='{"v": 1, "quote": "\\"", "nl": "a\\nb"}',
    )
    store.submit_many([full])
    store.submit(replace(full, id="single", dedup_key="other"))
    got, single = store.get("full"), store.get("single")
    for record in (got, single):
        assert (
            record.eta == eta
            and record.args == [1, 'two " \u00e9']
            and record.kwargs == {"x": None}
        )
        assert (record.max_runtime, record.max_retries, record.lease_ttl) == (12.5, 7, 42.0)
        assert (record.on_timeout, record.on_exhausted, record.max_recoveries) == (
            "manual",
            "manual",
            3,
        )
        assert record.message == full.message and record.reason == "submitted"
        assert record.state is State.PENDING and record.published_at is None
    assert got.dedup_key == "k:é\u2603"


# -- real workers -------------------------------------------------------------------------

PROJECT = """
from celery_lease import LeasedTask

@app.task(base=LeasedTask, shared=False, name="b.double")
def double(x):
    return 2 * x

@app.task(base=LeasedTask, shared=False, name="b.total")
def total(values):
    return sum(values)

@app.task(shared=False, name="b.plain_double")
def plain_double(x):
    return 2 * x
"""


@pytest.fixture
def bulk_project(lease_env: LeaseEnv, broker_url: str, tmp_path: Path) -> Iterator[Any]:
    backend = f"db+sqlite:///{tmp_path / 'results.sqlite3'}"
    yield lease_env.project(
        broker_url=broker_url, source=PROJECT, settings={"result_backend": backend}
    )


@pytest.mark.parametrize("broker_url", ["redis", "amqp"], indirect=True)
def test_submit_many_runs_every_item_once_and_reports_duplicates(
    bulk_project: Any, broker_url: str, queue_name: str
) -> None:
    p = bulk_project
    double = p.module.app.tasks["b.double"]
    items: list[Any] = [((i,), {}) for i in range(40)]
    items += [{"args": (100,), "dedup_key": "once"}, {"args": (200,), "dedup_key": "once"}]
    items.append({"kwargs": {"x": 7}, "countdown": 0.2})

    submitted = double.submit_many(items)

    assert all(isinstance(s, Submitted) for s in submitted)
    assert [s.created for s in submitted] == [True] * 41 + [False, True]
    assert submitted[41].task_id == submitted[40].task_id  # the first task's handle
    # rows first, then one message per created task (the duplicate published nothing)
    wait_until(lambda: queue_depth(broker_url, queue_name) == 42, message="42 messages queued")
    p.worker(concurrency=2)
    for s in submitted:
        p.wait_state(s.task_id, State.SUCCEEDED, timeout=60)
    assert [s.result.get(timeout=30) for s in submitted[:3]] == [0, 2, 4]
    assert p.get(submitted[40].task_id).result == 200
    assert p.get(submitted[42].task_id).result == 14
    assert all(p.get(s.task_id).attempt == 1 for s in submitted)


@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_a_group_and_a_chord_inside_bulk_are_written_then_run_once(bulk_project: Any) -> None:
    p = bulk_project
    app = p.module.app
    double, total = app.tasks["b.double"], app.tasks["b.total"]
    store = p.store
    with Inserts(runtime(app).store) as inserts, celery_lease.bulk(app) as submitted:
        grouped = group(double.s(i) for i in range(30)).apply_async()
        chorded = chord(double.s(i) for i in range(5))(total.s())
        # collected, not written yet: the rows exist once the block ends
        assert store.get(grouped.results[0].id) is None
    assert inserts.count == 1  # 35 rows, one multi-row statement
    header_ids = [r.id for r in grouped.results]
    assert len(submitted) == 30 + 5 and all(s.created for s in submitted)
    assert {s.task_id for s in submitted} >= set(header_ids)
    p.worker(concurrency=2)
    assert grouped.get(timeout=60) == [2 * i for i in range(30)]
    assert chorded.get(timeout=60) == sum(2 * i for i in range(5))
    for task_id in header_ids:
        assert p.get(task_id).attempt == 1


@pytest.mark.parametrize("broker_url", ["redis", "amqp"], indirect=True)
def test_a_plain_group_and_a_chord_header_write_their_rows_together(
    bulk_project: Any, broker_url: str, queue_name: str
) -> None:
    # no bulk() block: the project's existing canvas code, unchanged
    p = bulk_project
    app = p.module.app
    double, total = app.tasks["b.double"], app.tasks["b.total"]
    plain = app.tasks["b.plain_double"]
    store = runtime(app).store
    with Inserts(store) as inserts:
        grouped = group([double.s(i) for i in range(30)]).apply_async()
    assert inserts.count == 1  # 30 rows, one multi-row statement
    # written and published before apply_async returned, as plain Celery's are sent
    assert all(p.get(r.id).state is State.PENDING for r in grouped.results)
    wait_until(lambda: queue_depth(broker_url, queue_name) == 30, message="30 messages queued")
    with Inserts(store) as inserts:
        chorded = chord([double.s(i) for i in range(5)])(total.s())
    assert inserts.count == 1  # the header; the body is sent when the header is done
    with Inserts(store) as inserts:
        mixed = group(double.s(1), plain.s(2), double.s(3)).apply_async()
    assert inserts.count == 1  # the two leased members; the plain one is Celery's
    assert p.store.get(mixed.results[1].id) is None
    assert [p.get(mixed.results[i].id).state for i in (0, 2)] == [State.PENDING] * 2

    p.worker(concurrency=2)
    assert grouped.get(timeout=60) == [2 * i for i in range(30)]
    assert chorded.get(timeout=60) == sum(2 * i for i in range(5))
    assert mixed.get(timeout=60) == [2, 4, 6]
    for r in grouped.results:
        assert p.get(r.id).attempt == 1


@pytest.mark.parametrize("broker_url", ["redis", "amqp"], indirect=True)
def test_a_generator_chord_header_is_streamed_member_by_member(
    lease_env: LeaseEnv, broker_url: str, redis_url: str
) -> None:
    # Celery sends a generator header's members as the generator yields them (#3021,
    # with the Redis result backend): this generator yields its second member only once
    # the first one has run, which never happens if the members are collected and
    # published at the end
    p = lease_env.project(
        broker_url=broker_url, source=PROJECT, settings={"result_backend": redis_url}
    )
    app = p.module.app
    double, total = app.tasks["b.double"], app.tasks["b.total"]
    p.worker(concurrency=2)

    def first_ran() -> bool:
        rows = p.store.list_tasks(name="b.double")
        return any(r.args == [1] and r.state is State.SUCCEEDED for r in rows)

    def header() -> Iterator[Any]:
        # Celery's loop looks one member ahead: the first is sent once the second is
        # yielded
        yield double.s(1)
        yield double.s(2)
        wait_until(first_ran, timeout=30, message="the first member ran")
        yield double.s(3)

    with Inserts(runtime(app).store) as inserts:
        chorded = chord(header())(total.s())
    assert inserts.count == 3  # one committed row per member, each sent at once
    assert chorded.get(timeout=60) == 12


@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_lease_batch_groups_off_writes_a_groups_rows_one_by_one(
    lease_env: LeaseEnv, broker_url: str, tmp_path: Path
) -> None:
    backend = f"db+sqlite:///{tmp_path / 'results.sqlite3'}"
    p = lease_env.project(
        broker_url=broker_url,
        source=PROJECT,
        settings={"result_backend": backend},
        batch_groups=False,
    )
    app = p.module.app
    double = app.tasks["b.double"]
    with Inserts(runtime(app).store) as inserts:
        grouped = group([double.s(i) for i in range(10)]).apply_async()
    assert inserts.count == 10  # Celery's loop as it is: one committed row per member
    p.worker(concurrency=2)
    assert grouped.get(timeout=60) == [2 * i for i in range(10)]


@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_a_bad_item_or_a_failing_block_writes_and_publishes_nothing(
    bulk_project: Any, broker_url: str, queue_name: str
) -> None:
    p = bulk_project
    app = p.module.app
    double = app.tasks["b.double"]
    with pytest.raises(NotSerializable):
        double.submit_many([((1,), {}), ((object(),), {})])
    with pytest.raises(InvalidSubmission):
        double.submit_many([((1,), {}), {"args": (2,), "dedup_key": "x" * 300}])
    with pytest.raises(TypeError, match="unknown keys"):
        double.submit_many([{"args": (1,), "queue": "elsewhere"}])
    with pytest.raises(RuntimeError, match="boom"), celery_lease.bulk(app):
        double.delay(1)
        raise RuntimeError("boom")
    assert p.store.list_tasks(limit=10) == []
    assert queue_depth(broker_url, queue_name) == 0
    # the check above can fail: the same calls with good items do write and publish
    (ok,) = double.submit_many([((1,), {})])
    assert ok.created and p.get(ok.task_id).state is State.PENDING
    wait_until(lambda: queue_depth(broker_url, queue_name) == 1, message="one message queued")
    assert json.loads(p.get(ok.task_id).message)["v"] == 1
