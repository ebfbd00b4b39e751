"""``Execution``: steps, boundaries and progress of one attempt, on a real SQLite file.

No sockets: the store is a SQLite file in ``tmp_path``. Statement and commit counts
come from SQLAlchemy's own engine events.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from celery_lease import (
    CeleryLeaseError,
    DuplicateStep,
    LeaseLost,
    NotSerializable,
    State,
    TaskCancelled,
)
from celery_lease.config import LeaseConfig
from celery_lease.store import Claim, NewTask, Store
from celery_lease.worker.pool.execution import Execution, encode


@pytest.fixture
def store(tmp_path: Path, harness: Any) -> Store:
    made = harness.track(Store(LeaseConfig(database_url=f"sqlite:///{tmp_path / 'l.sqlite3'}")))
    made.migrate()
    return made  # type: ignore[no-any-return]


def claim(store: Store, task_id: str = "t1") -> Claim:
    store.submit(
        NewTask(
            id=task_id,
            name="t",
            args="[]",
            kwargs="{}",
            options="{}",
            lease_ttl=30.0,
            max_recoveries=5,
        )
    )
    got = store.claim(task_id, "owner", "worker:test")
    assert isinstance(got, Claim)
    return got


def reclaim(store: Store, task_id: str = "t1") -> Claim:
    store.expire(actor="test", reason="test", task_ids=[task_id], only_expired=False)
    store.take_due_retries(actor="test")
    got = store.claim(task_id, "owner", "worker:test")
    assert isinstance(got, Claim)
    return got


def execution(
    store: Store, c: Claim, *, interval: float = 3600.0, fenced: bool = False
) -> Execution:
    return Execution(store=store, claim=c, fenced=lambda: fenced, check_interval=interval)


class Counter:
    def __init__(self) -> None:
        self.statements: list[str] = []
        self.commits = 0

    @property
    def writes(self) -> int:
        verbs = ("INSERT", "UPDATE", "DELETE")
        return sum(1 for s in self.statements if s.lstrip().upper().startswith(verbs))

    @property
    def reads(self) -> int:
        return sum(1 for s in self.statements if s.lstrip().upper().startswith("SELECT"))


@pytest.fixture
def counted(store: Store) -> Iterator[Counter]:
    counter = Counter()

    def on_statement(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if not statement.startswith("BEGIN"):
            counter.statements.append(statement)

    def on_commit(conn: Any) -> None:
        counter.commits += 1

    event.listen(store.engine, "before_cursor_execute", on_statement)
    event.listen(store.engine, "commit", on_commit)
    yield counter
    event.remove(store.engine, "before_cursor_execute", on_statement)
    event.remove(store.engine, "commit", on_commit)


# -- encoding ---------------------------------------------------------------------------


def test_encode_is_compact_json():
    assert encode("x", {"a": [1, 2], "b": None}) == '{"a":[1,2],"b":null}'


@pytest.mark.parametrize("value", [object(), {1j: 1}, {"n": math.nan}, {"n": math.inf}])
def test_encode_refuses_what_json_cannot_hold_naming_the_value(value):
    with pytest.raises(NotSerializable, match="result of step 'charge' cannot be stored as JSON"):
        encode("result of step 'charge'", value)


def test_encode_refuses_a_value_over_the_limit():
    with pytest.raises(NotSerializable, match="over the 10-byte limit"):
        encode("result", "x" * 20, limit=10)


def test_duplicate_step_is_a_value_error_that_says_what_to_do():
    error = DuplicateStep("t1", "send")
    assert isinstance(error, ValueError) and isinstance(error, CeleryLeaseError)
    assert error.task_id == "t1" and error.name == "send"
    assert "f'send:{user_id}'" in str(error)


# -- write costs ------------------------------------------------------------------------


def test_an_idempotent_step_costs_one_write_transaction(store, counted):
    ex = execution(store, claim(store))
    counted.statements.clear()
    counted.commits = 0
    assert ex.step("load", lambda: {"a": 1}, (), {}, idempotent=True, check=None) == {"a": 1}
    assert counted.commits == 1


def test_a_non_idempotent_step_costs_two_write_transactions(store, counted):
    ex = execution(store, claim(store))
    counted.statements.clear()
    counted.commits = 0
    ex.step("charge", lambda: 7, (), {}, idempotent=False, check=None)
    assert counted.commits == 2


def test_a_done_step_on_a_rerun_costs_one_read_for_all_steps_and_no_write(store, counted):
    first = execution(store, claim(store))
    for name in ("a", "b", "c"):
        first.step(name, lambda n=name: n, (), {}, idempotent=True, check=None)
    second = execution(store, reclaim(store))
    counted.statements.clear()
    counted.commits = 0

    values = [second.step(n, pytest.fail, (), {}, idempotent=True, check=None) for n in "abc"]

    assert values == ["a", "b", "c"]
    assert counted.writes == 0 and counted.reads == 1


# -- boundaries -------------------------------------------------------------------------


def test_a_boundary_reads_the_row_at_most_once_per_interval(store, counted):
    quiet = execution(store, claim(store, "t1"), interval=3600.0)
    eager = execution(store, claim(store, "t2"), interval=0.0)
    counted.statements.clear()
    for _ in range(5):
        quiet.boundary()
    assert counted.reads == 0
    for _ in range(5):
        eager.boundary()
    assert counted.reads == 5


def test_a_cancel_requested_before_the_claim_stops_at_the_first_boundary(store):
    c = claim(store)
    store.request_cancel("t1", actor="ops", reason="no longer needed")
    store.schedule_retry(c.lease, 0.0, actor="w", reason="retry", error=None)
    again = store.claim("t1", "owner", "worker:test")
    assert isinstance(again, Claim) and again.cancel_requested
    with pytest.raises(TaskCancelled):
        execution(store, again).boundary()


def test_a_cancel_comes_back_with_a_step_write_and_stops_the_next_boundary(store):
    ex = execution(store, claim(store))
    store.request_cancel("t1", actor="ops", reason="stop")
    assert ex.step("a", lambda: 1, (), {}, idempotent=True, check=None) == 1  # done, kept
    with pytest.raises(TaskCancelled) as cancelled:
        ex.step("b", pytest.fail, (), {}, idempotent=True, check=None)
    assert cancelled.value.reason == "stop"


def test_a_self_fenced_worker_stops_at_the_boundary_and_writes_nothing(store, counted):
    ex = execution(store, claim(store), fenced=True)
    counted.statements.clear()
    with pytest.raises(LeaseLost, match="self-fenced"):
        ex.step("a", pytest.fail, (), {}, idempotent=False, check=None)
    assert counted.writes == 0 and ex.finished


def test_a_lost_lease_never_calls_a_non_idempotent_step(store):
    stale = execution(store, claim(store))
    reclaim(store)
    with pytest.raises(LeaseLost):
        stale.step("charge", pytest.fail, (), {}, idempotent=False, check=None)
    with pytest.raises(LeaseLost):
        stale.save_progress(3)
    assert store.steps("t1") == [] and store.get("t1").progress is None  # type: ignore[union-attr]


# -- steps ------------------------------------------------------------------------------


def test_step_names_are_checked(store):
    ex = execution(store, claim(store))
    with pytest.raises(TypeError):
        ex.step("", lambda: 1, (), {}, idempotent=True, check=None)
    ex.step("a", lambda: 1, (), {}, idempotent=True, check=None)
    with pytest.raises(DuplicateStep):
        ex.step("a", pytest.fail, (), {}, idempotent=True, check=None)


def test_an_unstorable_result_is_not_marked_done(store):
    ex = execution(store, claim(store))
    with pytest.raises(NotSerializable, match="step 'a'"):
        ex.step("a", object, (), {}, idempotent=True, check=None)
    assert store.steps("t1") == []


def test_the_first_run_returns_the_stored_shape(store):
    ex = execution(store, claim(store))
    value = ex.step("a", lambda: {1: (2, 3)}, (), {}, idempotent=False, check=None)
    assert value == {"1": [2, 3]}


def test_a_check_answers_for_a_started_step_and_its_answer_is_recorded(store):
    first = execution(store, claim(store))
    with pytest.raises(RuntimeError):
        first.step("charge", _boom, ("k1",), {}, idempotent=False, check=_lookup)
    second = execution(store, reclaim(store))

    assert second.step("charge", pytest.fail, ("k1",), {}, idempotent=False, check=_lookup) == {
        "found": "k1"
    }
    (step,) = store.steps("t1")
    assert step.state == "DONE" and step.result == {"found": "k1"} and step.attempt == 2


def test_a_check_that_finds_nothing_lets_the_step_run_again(store):
    first = execution(store, claim(store))
    with pytest.raises(RuntimeError):
        first.step("charge", _boom, ("k1",), {}, idempotent=False, check=lambda key: None)
    second = execution(store, reclaim(store))
    assert second.step("charge", str.upper, ("k1",), {}, idempotent=False, check=_none) == "K1"


def test_progress_is_saved_and_loaded(store):
    ex = execution(store, claim(store))
    assert ex.load_progress(default=0) == 0
    ex.save_progress({"next": 6001})
    again = execution(store, reclaim(store))
    assert again.load_progress() == {"next": 6001}
    assert store.get("t1").state is State.RUNNING  # type: ignore[union-attr]


def _boom(key: str) -> None:
    raise RuntimeError("connection reset: did the charge happen?")


def _lookup(key: str) -> dict[str, str]:
    return {"found": key}


def _none(key: str) -> None:
    return None
