"""Steps, idempotency keys and progress cursors with real workers (issue 3, "Steps").

Each test runs on SQLite and PostgreSQL (the ``backend`` fixture) with a real
``celery worker`` and counts the real calls with the external stub. Crashes are in
tests/crash/test_steps_crash.py; here re-runs come from ``self.retry()`` or from a
lease taken away from a running task.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from celery_lease import State, admin
from celery_lease.store import Store

from ..helpers import WorkerProject, wait_until

TASKS = """
import json
import time

from celery_lease import DuplicateStep, LeasedTask, NotSerializable
from tests.helpers import ExternalSystem

external = ExternalSystem.from_env()


def call(name, key=None, payload=None):
    return external.call(name, key, payload)


def wait_for(name, limit=60.0):
    deadline = time.monotonic() + limit
    while external.count(name) == 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"gate {name!r} never opened")
        time.sleep(0.02)


def shaped():
    external.call("shaped")
    return {"pair": (1, 2), 3: "int key", "nested": [{"x": 1.5}], "none": None}


def nothing():
    external.call("nothing")


@app.task(base=LeasedTask, bind=True, name="shapes")
def shapes(self):
    a = self.step("shaped", shaped, idempotent=True)
    b = self.step("plain", call, "plain")
    c = self.step("nothing", nothing)
    external.call("seen", payload=json.dumps([a, b, c], sort_keys=True))
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return [a, b, c]


@app.task(base=LeasedTask, bind=True, name="bad_result")
def bad_result(self, idempotent):
    try:
        self.step("bad", lambda: {"when": object()}, idempotent=idempotent)
    except NotSerializable as error:
        return str(error)
    return "stored?"


@app.task(base=LeasedTask, bind=True, name="twice")
def twice(self):
    self.step("same", call, "same", idempotent=True)
    try:
        self.step("same", call, "same", idempotent=True)
    except DuplicateStep as error:
        return error.name
    return "allowed?"


@app.task(base=LeasedTask, bind=True, name="notify_all")
def notify_all(self, users):
    for user in users:
        self.step(f"send:{user}", call, "send", self.idempotency_key(f"send:{user}"))
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return len(users)


@app.task(base=LeasedTask, bind=True, name="keys")
def keys(self):
    pair = [self.idempotency_key("charge"), self.idempotency_key("ship")]
    external.call("keys", payload=json.dumps(pair))
    if self.request.retries == 0:
        raise self.retry(countdown=0)


@app.task(base=LeasedTask, bind=True, name="notify")
def notify(self, total, stop_at):
    start = self.load_progress(0)
    external.call("start", payload=str(start))
    for i in range(start, total):
        external.call("notify", payload=str(i))
        self.save_progress(i + 1)
        if i + 1 == stop_at and self.request.retries == 0:
            raise self.retry(countdown=0)
    return self.load_progress()


@app.task(base=LeasedTask, bind=True, name="slow")
def slow(self, boundaries, seconds):
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        if boundaries == "step":
            self.step(f"tick:{i}", call, "tick", idempotent=True)
        elif boundaries == "progress":
            self.save_progress(i)
        time.sleep(0.05)
        i += 1
    return i


@app.task(base=LeasedTask, bind=True, name="gated")
def gated(self):
    self.step("a", call, "a")
    wait_for("go")
    self.step("b", call, "b")
    return "done"
"""


@pytest.fixture
def setup(
    celery_project: Callable[..., WorkerProject], lease_config: Any, make_store: Any
) -> Callable[..., tuple[WorkerProject, Store, Any]]:
    def make(**overrides: Any) -> tuple[WorkerProject, Store, Any]:
        store = make_store(**overrides)
        project = celery_project(TASKS, config=lease_config(**overrides))
        project.worker().wait_ready(store=store)
        return project, store, project.load()

    return make


def finished(store: Store, task_id: str, state: State = State.SUCCEEDED) -> Any:
    def done() -> bool:
        record = store.get(task_id)
        return record is not None and record.state is state

    wait_until(done, timeout=30, message=f"task {task_id} never reached {state}")
    return store.get(task_id)


def test_step_results_have_the_stored_json_shape_on_first_run_and_rerun(setup, external):
    _, store, mod = setup()
    result = mod.shapes.delay()
    record = finished(store, result.id)

    expected_a = {"pair": [1, 2], "3": "int key", "nested": [{"x": 1.5}], "none": None}
    plain = external.effects("plain")[0].id  # the stub answers with the effect's id
    first, second = (json.loads(e.payload) for e in external.effects("seen"))
    assert first == second == [expected_a, plain, None]
    assert record.result == [expected_a, plain, None]
    assert record.attempt == 2  # the re-run skipped every step
    assert (external.count("shaped"), external.count("plain"), external.count("nothing")) == (
        1,
        1,
        1,
    )
    steps = {s.name: s for s in admin(mod.app).steps(result.id)}
    assert list(steps) == ["shaped", "plain", "nothing"]
    assert steps["shaped"].idempotent and not steps["plain"].idempotent
    for step in steps.values():
        assert step.state == "DONE" and step.attempt == 1
        assert step.started_at is not None and step.finished_at is not None
        assert step.finished_at >= step.started_at
    assert steps["shaped"].result == expected_a and steps["nothing"].result is None


@pytest.mark.parametrize("idempotent", [True, False])
def test_a_result_that_cannot_be_stored_names_the_step_and_is_not_marked_done(setup, idempotent):
    _, store, mod = setup()
    result = mod.bad_result.delay(idempotent)
    record = finished(store, result.id)

    assert "step 'bad'" in record.result and "JSON" in record.result
    steps = admin(mod.app).steps(result.id)
    assert all(s.state != "DONE" for s in steps)
    # a non-idempotent step did call out: its start stays recorded
    assert [s.state for s in steps] == ([] if idempotent else ["STARTED"])


def test_a_step_name_used_twice_in_one_run_is_an_error(setup, external):
    _, store, mod = setup()
    result = mod.twice.delay()
    assert finished(store, result.id).result == "same"
    assert external.count("same") == 1


def test_a_loop_uses_distinct_step_names_and_keys(setup, external):
    _, store, mod = setup()
    result = mod.notify_all.delay(["u1", "u2", "u3"])
    assert finished(store, result.id).result == 3
    # the re-run (retry) skipped every send; each user got exactly one
    assert external.count("send") == 3 and external.calls("send") == 3
    assert len({e.key for e in external.effects("send")}) == 3


def test_idempotency_key_is_stable_across_attempts_and_processes(setup, external):
    _, store, mod = setup()
    one, two = mod.keys.delay(), mod.keys.delay()
    finished(store, one.id)
    finished(store, two.id)

    seen = [json.loads(e.payload) for e in external.effects("keys")]
    assert len(seen) == 4
    per_task = {tuple(pair) for pair in seen}
    assert len(per_task) == 2  # each task: the same keys in both attempts
    for charge, ship in per_task:
        assert charge != ship
    mod.keys.push_request(id=one.id)  # this process computes the same key
    try:
        here = (mod.keys.idempotency_key("charge"), mod.keys.idempotency_key("ship"))
    finally:
        mod.keys.pop_request()
    assert here in per_task


def test_a_progress_cursor_lets_a_rerun_continue_where_the_last_attempt_stopped(setup, external):
    _, store, mod = setup()
    result = mod.notify.delay(10, 6)
    record = finished(store, result.id)

    assert [e.payload for e in external.effects("start")] == ["0", "6"]
    assert sorted(int(e.payload) for e in external.effects("notify")) == list(range(10))
    assert record.result == 10 and record.progress == 10


@pytest.mark.parametrize("boundaries", ["step", "progress"])
def test_step_and_progress_writes_count_as_progress_for_max_runtime(setup, boundaries):
    _, store, mod = setup(max_runtime=1.5)
    busy = mod.slow.delay(boundaries, 4.5)  # three times max_runtime, progressing
    assert finished(store, busy.id).attempt == 1
    # an overrun would have passed through WAIT_MANUAL (the owner may still finish)
    assert State.WAIT_MANUAL not in [h.to_state for h in store.history(busy.id)]


def test_no_progress_past_max_runtime_goes_to_a_person(setup):
    _, store, mod = setup(max_runtime=1.5)
    idle = mod.slow.delay("none", 6.0)
    record = finished(store, idle.id, State.WAIT_MANUAL)
    assert "max_runtime" in (record.reason or "")


def test_a_lost_lease_stops_the_execution_at_its_next_step_and_it_writes_nothing_more(
    setup, external
):
    project, store, mod = setup()
    result = mod.gated.delay()
    wait_until(lambda: external.count("a") == 1, message="step a called")
    # the stub counts the call before the step's result commits, and an expiry skips a
    # row whose lock a step write holds: wait until step a is recorded done
    wait_until(
        lambda: any(s.name == "a" and s.state == "DONE" for s in store.steps(result.id)),
        message="step a recorded",
    )

    # the lease is taken away while the task runs (as a reaper would after a freeze)
    expired = store.expire(
        actor="test", reason="taken away", task_ids=[result.id], only_expired=False
    )
    assert [e.to_state for e in expired] == [State.RETRY_WAIT]
    external.call("go")

    record = finished(store, result.id)
    assert record.attempt == 2
    assert external.count("a") == 1 and external.count("b") == 1
    steps = {s.name: s for s in store.steps(result.id)}
    assert steps["a"].attempt == 1 and steps["b"].attempt == 2
    # attempt 1 was fenced off at step b: its only writes after the expiry were refused
    assert [(h.to_state, h.attempt) for h in store.history(result.id)][-2:] == [
        (State.RUNNING, 2),
        (State.SUCCEEDED, 2),
    ]
    project.registry.workers[-1].wait_log(r"lease lost")


@pytest.mark.parametrize(("idempotent", "writes"), [(True, 1), (False, 2)])
def test_a_step_costs_one_write_if_idempotent_else_two(store, idempotent, writes):
    from sqlalchemy import event

    from celery_lease.store import Claim, NewTask
    from celery_lease.worker.pool.execution import Execution

    store.submit(
        NewTask(
            id="t",
            name="t",
            args="[]",
            kwargs="{}",
            options="{}",
            lease_ttl=30.0,
            max_recoveries=5,
        )
    )
    claim = store.claim("t", "owner", "worker:test")
    assert isinstance(claim, Claim)
    ex = Execution(store=store, claim=claim, fenced=lambda: False, check_interval=3600.0)
    transactions: list[object] = []

    def on_commit(conn: Any) -> None:
        transactions.append(conn)

    def on_statement(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        # a write in autocommit is a transaction of its own, with no commit event
        autocommit = conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT"
        if autocommit and statement.lstrip().upper().startswith(("INSERT", "UPDATE", "WITH")):
            transactions.append(conn)

    event.listen(store.engine, "commit", on_commit)
    event.listen(store.engine, "before_cursor_execute", on_statement)
    try:
        for i in range(5):
            ex.step(f"s{i}", dict, (), {"i": i}, idempotent=idempotent, check=None)
    finally:
        event.remove(store.engine, "commit", on_commit)
        event.remove(store.engine, "before_cursor_execute", on_statement)
    assert len(transactions) == 5 * writes
    assert [s.state for s in store.steps("t")] == ["DONE"] * 5
