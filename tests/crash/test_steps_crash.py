"""Crash-point matrix rows 4, 5, 6, 7, 8 and 18 of DESIGN.md, with real workers.

A pool child dies (``os._exit(137)``, what the kernel's OOM killer leaves behind) at a
named crash point, once; the worker's main process sees the child lost and expires its
lease at once; the reaper and the next attempt do the rest. A counting stub of an
external system, outside every worker process, counts the real calls (and honours
idempotency keys). Each test asserts the final state and the exact number of real
external effects, on SQLite and PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from celery_lease import State, admin
from celery_lease.store import Store

from ..helpers import ExternalSystem, WorkerProcess, WorkerProject, wait_step, wait_until

pytestmark = pytest.mark.crash

TASKS = """
import os
import time

from celery import signals

from celery_lease import LeasedTask
from tests.helpers import ExternalSystem

external = ExternalSystem.from_env()


def crash_point(name):
    # dies here the first time only, and only if the test named this point
    if os.environ.get("CELERY_LEASE_CRASH_AT") != name:
        return
    mark = os.path.join(os.environ["CELERY_LEASE_CRASH_MARKS"], name)
    try:
        os.close(os.open(mark, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return
    os._exit(137)


def wait_for(name, limit=60.0):
    deadline = time.monotonic() + limit
    while external.count(name) == 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"gate {name!r} never opened")
        time.sleep(0.02)


def load_order(order_id):
    external.call("load", payload=str(order_id))
    return {"id": order_id, "total": 42}


def charge(total, idempotency_key=None):
    effect = external.call("charge", key=idempotency_key, payload=str(total))
    crash_point("after_charge")  # the money moved; the step is not recorded yet
    return {"id": effect}


def find_charge(total, idempotency_key=None):
    # "query first, then decide": ask the payment system whether the call happened
    for effect in external.effects("charge"):
        if effect.key == idempotency_key:
            return {"id": effect.id}
    return None


def ship(order_id):
    external.call("ship", payload=str(order_id))
    return "shipped"


def run_fulfil(task, order_id, mode):
    order = task.step("load", load_order, order_id, idempotent=True)
    key = task.idempotency_key("charge")
    if mode == "idempotent":
        paid = task.step("charge", charge, order["total"], idempotency_key=key, idempotent=True)
    elif mode == "checked":
        paid = task.step("charge", charge, order["total"], idempotency_key=key, check=find_charge)
    else:
        paid = task.step("charge", charge, order["total"])
    crash_point("between_steps")
    if mode == "gated":
        wait_for("go")
    task.step("ship", ship, order_id)
    crash_point("before_outcome")
    return paid["id"]


@app.task(base=LeasedTask, bind=True, name="fulfil")
def fulfil(self, order_id, mode="plain"):
    return run_fulfil(self, order_id, mode)


@app.task(base=LeasedTask, bind=True, name="fulfil_late", acks_late=True,
          reject_on_worker_lost=True)
def fulfil_late(self, order_id, mode="plain"):
    return run_fulfil(self, order_id, mode)


@signals.task_postrun.connect
def _after_outcome(sender=None, **kwargs):
    # the outcome is written (inside the task's __call__); the ack has not happened
    if getattr(sender, "name", None) == "fulfil_late":
        crash_point("after_outcome")


@app.task(base=LeasedTask, bind=True, name="flaky_charge")
def flaky_charge(self, order_id):
    order = self.step("load", load_order, order_id, idempotent=True)
    if self.request.retries == 0:
        try:
            self.step("charge", declined)
        except RuntimeError as error:
            raise self.retry(exc=error, countdown=0)
    crash_point("second_attempt")  # attempt 2 dies before it reaches the charge again
    paid = self.step("charge", charge, order["total"])
    self.step("ship", ship, order_id)
    return paid["id"]


def declined():
    external.call("declined")
    raise RuntimeError("card declined")


@app.task(base=LeasedTask, bind=True, name="sentinel")
def sentinel(self):
    return external.call("sentinel")
"""


class Crash:
    """One crash test: the store, a project whose workers crash at ``point``, the module."""

    def __init__(
        self, project: WorkerProject, store: Store, point: str | None, marks: Path
    ) -> None:
        self.project = project
        self.store = store
        self.mod = project.load()
        self.env = {"CELERY_LEASE_CRASH_MARKS": str(marks)}
        if point is not None:
            self.env["CELERY_LEASE_CRASH_AT"] = point
        self.marks = marks

    def worker(self, name: str = "w1") -> WorkerProcess:
        return self.project.worker(name, env=self.env).wait_ready(store=self.store)

    def crashed(self, point: str) -> bool:
        return (self.marks / point).exists()

    def final(self, task_id: str, state: State, timeout: float = 30.0) -> Any:
        def reached() -> bool:
            record = self.store.get(task_id)
            return record is not None and record.state is state

        wait_until(reached, timeout=timeout, message=f"task {task_id} never reached {state}")
        return self.store.get(task_id)

    def sentinel(self, external: ExternalSystem) -> None:
        """One more task through the same queue: everything queued before it was
        delivered by the time it ran (one worker slot), and a reaper sweep ran."""
        before = external.count("sentinel")
        self.final(self.mod.sentinel.delay().id, State.SUCCEEDED)
        assert external.count("sentinel") == before + 1
        admin(self.mod.app).reap()


@pytest.fixture
def crash(
    celery_project: Callable[..., WorkerProject],
    lease_config: Any,
    make_store: Any,
    tmp_path: Path,
) -> Callable[[str | None], Crash]:
    def make(point: str | None) -> Crash:
        marks = tmp_path / "crash-marks"
        marks.mkdir(exist_ok=True)
        project = celery_project(TASKS, config=lease_config())
        return Crash(project, make_store(), point, marks)

    return make


def test_row4_non_idempotent_side_effect_then_crash_goes_to_a_person(crash, external):
    c = crash("after_charge")
    c.worker()
    result = c.mod.fulfil.delay(7)

    record = c.final(result.id, State.WAIT_MANUAL)
    assert c.crashed("after_charge")
    assert record.reason is not None and "outcome of step 'charge' unknown" in record.reason
    c.sentinel(external)  # never re-run automatically
    record = c.store.get(result.id)
    assert record.state is State.WAIT_MANUAL and record.attempt == 1
    assert (external.count("load"), external.count("charge"), external.count("ship")) == (1, 1, 0)
    steps = {s.name: s.state for s in c.store.steps(result.id)}
    assert steps == {"load": "DONE", "charge": "STARTED"}


def test_row4_with_a_check_the_unknown_outcome_is_looked_up_and_the_task_resumes(crash, external):
    c = crash("after_charge")
    c.worker()
    result = c.mod.fulfil.delay(7, "checked")

    record = c.final(result.id, State.SUCCEEDED)
    assert c.crashed("after_charge")
    assert record.attempt == 2
    charge = external.effects("charge")
    assert len(charge) == 1 and external.calls("charge") == 1  # found, not called again
    assert record.result == charge[0].id
    assert (external.count("load"), external.count("ship")) == (1, 1)
    step = {s.name: s for s in c.store.steps(result.id)}["charge"]
    assert step.state == "DONE" and step.result == {"id": charge[0].id}


def test_row5_idempotent_step_is_retried_and_downstream_sees_one_effect(crash, external):
    c = crash("after_charge")
    c.worker()
    result = c.mod.fulfil.delay(7, "idempotent")

    record = c.final(result.id, State.SUCCEEDED)
    assert c.crashed("after_charge")
    assert record.attempt == 2 and record.recoveries == 1
    assert external.count("charge") == 1  # one real charge...
    assert external.calls("charge") == 2  # ...though the API was called twice, same key
    assert (external.count("load"), external.count("ship")) == (1, 1)
    assert record.result == external.effects("charge")[0].id


def test_row6_crash_between_two_recorded_steps_resumes_at_the_next_step(crash, external):
    c = crash("between_steps")
    c.worker()
    result = c.mod.fulfil.delay(7)

    record = c.final(result.id, State.SUCCEEDED)
    assert c.crashed("between_steps")
    assert record.attempt == 2
    counts = (external.calls("load"), external.calls("charge"), external.calls("ship"))
    assert counts == (1, 1, 1)  # done steps were not re-run
    steps = {s.name: s.attempt for s in c.store.steps(result.id)}
    assert steps == {"load": 1, "charge": 1, "ship": 2}


def test_row7_crash_after_the_last_step_reruns_skipping_every_step(crash, external):
    c = crash("before_outcome")
    c.worker()
    result = c.mod.fulfil.delay(7)

    record = c.final(result.id, State.SUCCEEDED)
    assert c.crashed("before_outcome")
    assert record.attempt == 2
    counts = (external.calls("load"), external.calls("charge"), external.calls("ship"))
    assert counts == (1, 1, 1)
    assert {s.attempt for s in c.store.steps(result.id)} == {1}
    assert record.result == external.effects("charge")[0].id


def test_row8_crash_after_the_outcome_write_redelivery_is_dropped(crash, external):
    c = crash("after_outcome")
    worker = c.worker()
    result = c.mod.fulfil_late.delay(7)

    record = c.final(result.id, State.SUCCEEDED)
    wait_until(lambda: c.crashed("after_outcome"), message="the child died after the outcome")
    # acks_late + reject_on_worker_lost: the unacked message comes back and is dropped
    worker.wait_log(rf"fulfil_late\[{result.id}\]: delivery dropped without running", 30)
    c.sentinel(external)
    after = c.store.get(result.id)
    assert after.state is State.SUCCEEDED and after.attempt == 1 and after.recoveries == 0
    assert after.finished_at == record.finished_at and after.result == record.result
    assert [h.to_state for h in c.store.history(result.id)] == [
        State.PENDING,
        State.RUNNING,
        State.SUCCEEDED,
    ]
    counts = (external.calls("load"), external.calls("charge"), external.calls("ship"))
    assert counts == (1, 1, 1)


def test_row18_cancel_while_pending_never_runs(crash, external):
    c = crash(None)
    result = c.mod.fulfil.delay(7)
    assert admin(c.mod.app).cancel(result.id, actor="ops", reason="order withdrawn") is (
        State.PENDING
    )
    c.worker()
    c.sentinel(external)

    record = c.store.get(result.id)
    assert record.state is State.CANCELLED and record.attempt == 0
    assert external.count() == 1  # the sentinel only
    assert c.store.history(result.id)[-1].actor == "ops"


def test_row18_cancel_while_running_stops_at_the_next_step(crash, external):
    c = crash(None)
    c.worker()
    result = c.mod.fulfil.delay(7, "gated")
    # recorded DONE, not only called: a kill between the call and its record leaves
    # the charge's outcome unknown, which rightly wins over the cancel (WAIT_MANUAL)
    wait_step(c.store, result.id, "charge")

    admin(c.mod.app).cancel(result.id, actor="ops", reason="order withdrawn")
    external.call("go")

    record = c.final(result.id, State.CANCELLED)
    assert record.attempt == 1
    assert (external.count("load"), external.count("charge"), external.count("ship")) == (1, 1, 0)
    last = c.store.history(result.id)[-1]
    assert last.from_state is State.RUNNING and "order withdrawn" in (last.reason or "")
    c.sentinel(external)
    assert c.store.get(result.id).state is State.CANCELLED
    assert external.count("ship") == 0


def test_row18_cancel_requested_then_the_worker_dies_ends_cancelled(crash, external):
    c = crash(None)
    worker = c.worker()
    result = c.mod.fulfil.delay(7, "gated")
    # recorded DONE, not only called: a kill between the call and its record leaves
    # the charge's outcome unknown, which rightly wins over the cancel (WAIT_MANUAL)
    wait_step(c.store, result.id, "charge")
    admin(c.mod.app).cancel(result.id, actor="ops", reason="order withdrawn")

    worker.kill_group()  # before the task reached a boundary
    worker.wait_group_gone()
    c.worker("w2")  # another worker's reaper expires the lease after the TTL

    record = c.final(result.id, State.CANCELLED)
    assert record.attempt == 1 and record.recoveries == 1
    assert (external.count("charge"), external.count("ship")) == (1, 0)


def test_a_step_that_raised_in_an_earlier_attempt_does_not_block_recovery(crash, external):
    c = crash("second_attempt")
    c.worker()
    result = c.mod.flaky_charge.delay(7)

    record = c.final(result.id, State.SUCCEEDED)
    assert c.crashed("second_attempt")
    # attempt 1: the charge raised (declined) and the task retried; attempt 2 died before
    # reaching the charge: nothing was in flight, so attempt 3 ran it
    assert record.attempt == 3
    assert (external.count("declined"), external.count("charge"), external.count("ship")) == (
        1,
        1,
        1,
    )
