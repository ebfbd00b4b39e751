"""Cancellation with real workers (issue 3, "Cancellation"; DESIGN.md crash row 18 is in
tests/crash/test_steps_crash.py).

A RUNNING task sees a cancel request at its next ``self.step()`` / ``save_progress()`` /
``check_cancelled()`` and ends CANCELLED with the operator's actor and reason in the
audit trail; ``terminate=True`` kills a task that never reaches a boundary, and the
row ends CANCELLED, or WAIT_MANUAL when a non-idempotent step was in flight. A
cancelled task is never run again.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import pytest
from celery.bin.base import CLIContext
from click.testing import CliRunner

from celery_lease import IllegalTransition, State, TaskNotFound, admin
from celery_lease.cli import lease
from celery_lease.store import Store

from ..helpers import ExternalSystem, WorkerProject, pid_alive, wait_step, wait_until

TASKS = """
import time

from celery_lease import LeasedTask
from tests.helpers import ExternalSystem

external = ExternalSystem.from_env()


def call(name, key=None):
    return external.call(name, key)


def wait_for(name, limit=60.0):
    # block until the test calls external.call(name); a bounded loop, not a guess
    deadline = time.monotonic() + limit
    while external.count(name) == 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"gate {name!r} never opened")
        time.sleep(0.02)
    return name


@app.task(base=LeasedTask, bind=True, name="ticker")
def ticker(self, boundary):
    self.step("first", call, "first")
    for i in range(100_000):
        if boundary == "step":
            self.step(f"tick:{i}", call, "tick", idempotent=True)
        elif boundary == "progress":
            call("tick")
            self.save_progress(i)
        else:
            call("tick")
            self.check_cancelled()
        time.sleep(0.01)
    call("unreachable")


@app.task(base=LeasedTask, bind=True, name="stuck")
def stuck(self, where):
    # never reaches a boundary while "blocked": only terminate=True stops it
    self.step("first", call, "first")
    if where == "idempotent-step":
        self.step("block", wait_for, "never", idempotent=True)
    elif where == "step":
        self.step("block", wait_for, "never")
    else:
        wait_for("never")
    call("unreachable")


@app.task(base=LeasedTask, bind=True, name="deaf")
def deaf(self):
    self.step("first", call, "first")
    wait_for("release")
    call("finished")
    return "done"


@app.task(base=LeasedTask, bind=True, name="retry_after_cancel")
def retry_after_cancel(self):
    call("body")
    if self.request.retries == 0:
        wait_for("cancel-requested")
        raise self.retry(countdown=0)
    call("unreachable")


@app.task(base=LeasedTask, bind=True, name="gated_charge")
def gated_charge(self):
    self.step("first", call, "first")
    wait_for("go")
    self.step("charge", call, "charge")
    call("unreachable")


@app.task(base=LeasedTask, bind=True, name="sentinel")
def sentinel(self):
    return call("sentinel")
"""


@pytest.fixture
def setup(
    celery_project: Callable[..., WorkerProject], lease_config: Any, make_store: Any
) -> Callable[..., tuple[WorkerProject, Store, Any]]:
    def make(**overrides: Any) -> tuple[WorkerProject, Store, Any]:
        store = make_store(**overrides)
        project = celery_project(TASKS, config=lease_config(**overrides))
        return project, store, project.load()

    return make


def state_of(store: Store, task_id: str) -> State | None:
    record = store.get(task_id)
    return None if record is None else record.state


def wait_state(store: Store, task_id: str, state: State, timeout: float = 20.0) -> None:
    wait_until(
        lambda: state_of(store, task_id) is state,
        timeout=timeout,
        message=f"task {task_id} never reached {state}",
    )


def run_sentinel(mod: Any, store: Store, external: ExternalSystem) -> None:
    """Run one more task through the same queue and single worker slot: once it is done,
    anything queued before it was delivered (and dropped or run)."""
    before = external.count("sentinel")
    result = mod.sentinel.delay()
    wait_state(store, result.id, State.SUCCEEDED)
    assert external.count("sentinel") == before + 1


@pytest.mark.parametrize("boundary", ["step", "progress", "check"])
def test_running_task_stops_at_its_next_boundary_and_ends_cancelled(setup, external, boundary):
    project, store, mod = setup()
    project.worker().wait_ready(store=store)
    result = mod.ticker.delay(boundary)
    wait_until(lambda: external.count("tick") >= 3, message="the task is ticking")

    found = admin(mod.app).cancel(result.id, actor="alice", reason="customer asked")

    assert found is State.RUNNING
    wait_state(store, result.id, State.CANCELLED)
    record = store.get(result.id)
    assert record is not None
    assert record.attempt == 1
    assert record.cancel_actor == "alice" and record.cancel_reason == "customer asked"
    assert external.count("unreachable") == 0
    assert external.count("first") == 1
    last = store.history(result.id)[-1]
    assert (last.from_state, last.to_state) == (State.RUNNING, State.CANCELLED)
    assert "customer asked" in (last.reason or "")
    ticks = external.count("tick")
    run_sentinel(mod, store, external)
    assert external.count("tick") == ticks  # stopped for good, not re-run
    assert store.get(result.id).state is State.CANCELLED  # type: ignore[union-attr]


def test_cancel_before_the_worker_starts_drops_the_message_at_claim(setup, external):
    project, store, mod = setup()
    result = mod.ticker.delay("step")
    assert admin(mod.app).cancel(result.id, actor="bob", reason="not needed") is State.PENDING
    assert state_of(store, result.id) is State.CANCELLED

    project.worker().wait_ready(store=store)
    run_sentinel(mod, store, external)

    assert external.count("first") == 0 and external.count("tick") == 0
    assert [h.to_state for h in store.history(result.id)] == [State.PENDING, State.CANCELLED]
    assert store.history(result.id)[-1].actor == "bob"


def test_cancelling_a_finished_or_unknown_task_raises_and_changes_nothing(setup, external):
    project, store, mod = setup()
    project.worker().wait_ready(store=store)
    done = mod.sentinel.delay()
    wait_state(store, done.id, State.SUCCEEDED)
    gone = mod.ticker.delay("step")
    admin(mod.app).cancel(gone.id, actor="bob")
    wait_state(store, gone.id, State.CANCELLED)
    trail = {tid: len(store.history(tid)) for tid in (done.id, gone.id)}

    with pytest.raises(IllegalTransition) as succeeded:
        admin(mod.app).cancel(done.id, actor="bob")
    with pytest.raises(IllegalTransition) as cancelled:
        admin(mod.app).cancel(gone.id, actor="bob")
    with pytest.raises(TaskNotFound):
        admin(mod.app).cancel("no-such-task", actor="bob")

    assert succeeded.value.from_state is State.SUCCEEDED
    assert cancelled.value.from_state is State.CANCELLED
    assert {tid: len(store.history(tid)) for tid in trail} == trail


def test_a_task_that_never_reaches_a_boundary_keeps_running_with_the_request_visible(
    setup, external
):
    project, store, mod = setup()
    project.worker().wait_ready(store=store)
    result = mod.deaf.delay()
    # recorded DONE, not only called: a cancel requested before that record is seen
    # by the step's own write, and the task would stop there
    wait_step(store, result.id, "first")

    admin(mod.app).cancel(result.id, actor="carol", reason="too late?")
    record = store.get(result.id)
    assert record is not None and record.state is State.RUNNING
    assert record.cancel_requested_at is not None and record.cancel_actor == "carol"
    assert admin(mod.app).get(result.id).cancel_reason == "too late?"  # type: ignore[union-attr]

    external.call("release")  # it finishes without a boundary: the work was done
    wait_state(store, result.id, State.SUCCEEDED)
    assert external.count("finished") == 1


@pytest.mark.parametrize(
    ("where", "final"),
    [
        ("no-step", State.CANCELLED),
        ("idempotent-step", State.CANCELLED),
        ("step", State.WAIT_MANUAL),
    ],
)
def test_terminate_kills_the_child_and_the_expiry_policy_decides(setup, external, where, final):
    project, store, mod = setup()
    worker = project.worker().wait_ready(store=store)
    (child,) = worker.wait_children(1)
    result = mod.stuck.delay(where)
    # the recorded state, not the counter: "first" is counted before it is recorded
    # DONE, and a kill in between leaves its outcome unknown (WAIT_MANUAL, rightly)
    wait_step(store, result.id, "first")
    if where == "step":  # a non-idempotent step records its start
        wait_step(store, result.id, "block", state="STARTED")

    found = admin(mod.app).cancel(result.id, actor="dave", reason="runaway", terminate=True)

    assert found is State.RUNNING
    wait_state(store, result.id, final)
    wait_until(lambda: not pid_alive(child), message="the pool child was killed")
    record = store.get(result.id)
    assert record is not None and record.attempt == 1 and record.recoveries == 1
    if final is State.WAIT_MANUAL:
        assert record.reason is not None and "outcome of step 'block' unknown" in record.reason
    else:
        assert record.reason is not None and "cancel requested" in record.reason
    assert worker.is_alive()
    run_sentinel(mod, store, external)  # the worker goes on; the task is not re-run
    assert external.count("first") == 1 and external.count("unreachable") == 0
    assert store.get(result.id).attempt == 1  # type: ignore[union-attr]
    assert [h.to_state for h in store.history(result.id)][-2:] == [State.TIMEOUT, final]


def test_the_cli_cancel_terminate_kills_a_task_that_never_reaches_a_boundary(setup, external):
    # reference-cli.md, operators-guide.md: `celery -A proj lease cancel ID --terminate`
    project, store, mod = setup()
    worker = project.worker().wait_ready(store=store)
    (child,) = worker.wait_children(1)
    result = mod.stuck.delay("no-step")
    wait_step(store, result.id, "first")

    obj = CLIContext(app=mod.app, no_color=True, workdir=None)
    args = ["cancel", result.id, "--terminate", "--actor", "dave", "--reason", "runaway"]
    done = CliRunner().invoke(lease, args, obj=obj, catch_exceptions=False)

    assert done.exit_code == 0, done.output
    assert done.stdout.strip() == f"{result.id}: RUNNING, cancel requested (killed)"
    wait_state(store, result.id, State.CANCELLED)
    wait_until(lambda: not pid_alive(child), message="the pool child was killed")
    record = store.get(result.id)
    assert record is not None and record.attempt == 1
    # the operator's request (who, why) is kept: the revoke it sent is not a new one
    assert (record.cancel_actor, record.cancel_reason) == ("dave", "runaway")
    assert worker.is_alive()
    run_sentinel(mod, store, external)  # the task is not run again
    assert external.count("first") == 1 and external.count("unreachable") == 0


def test_terminate_is_ignored_for_a_task_that_is_not_running(setup, external):
    project, store, mod = setup()
    result = mod.ticker.delay("step")
    assert admin(mod.app).cancel(result.id, terminate=True) is State.PENDING
    assert state_of(store, result.id) is State.CANCELLED
    project.worker().wait_ready(store=store)
    run_sentinel(mod, store, external)
    assert external.count("first") == 0


def test_a_cancel_requested_before_a_retry_is_honoured_before_the_body_runs_again(setup, external):
    project, store, mod = setup()
    project.worker().wait_ready(store=store)
    result = mod.retry_after_cancel.delay()
    wait_until(lambda: external.count("body") == 1, message="first attempt running")
    admin(mod.app).cancel(result.id, actor="erin", reason="stop it")
    external.call("cancel-requested")  # the task now retries without seeing a boundary

    wait_state(store, result.id, State.CANCELLED)
    assert external.count("body") == 1
    assert external.count("unreachable") == 0


def test_a_child_killed_by_someone_else_is_retried_not_cancelled(setup, external):
    project, store, mod = setup()
    worker = project.worker().wait_ready(store=store)
    (child,) = worker.wait_children(1)
    result = mod.stuck.delay("no-step")
    wait_step(store, result.id, "first")  # recorded DONE, not only called

    os.kill(child, signal.SIGKILL)

    def second_attempt_running() -> bool:
        record = store.get(result.id)
        return record is not None and record.state is State.RUNNING and record.attempt == 2

    wait_until(second_attempt_running, message="re-run after the child was lost")
    assert external.count("first") == 1  # the done step was not run again
    admin(mod.app).cancel(result.id, actor="frank", reason="enough", terminate=True)
    wait_state(store, result.id, State.CANCELLED)
    assert external.count("unreachable") == 0


def test_a_cancel_seen_when_a_step_starts_records_no_call_that_never_happened(setup, external):
    # a long heartbeat interval: the boundary does not read the row, the step's own
    # fenced write is what brings the cancel back
    project, store, mod = setup(heartbeat_interval=5.0, ttl=30.0)
    project.worker().wait_ready(store=store)
    result = mod.gated_charge.delay()
    wait_step(store, result.id, "first")  # then it waits at the gate
    admin(mod.app).cancel(result.id, actor="gina", reason="stop")
    external.call("go")

    wait_state(store, result.id, State.CANCELLED)
    assert external.count("charge") == 0 and external.count("unreachable") == 0
    assert [(s.name, s.state) for s in store.steps(result.id)] == [("first", "DONE")]
