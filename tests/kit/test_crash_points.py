"""Crash points aimed at one task's step: they fire once, where aimed, and nowhere else."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from celery_lease import State
from celery_lease._crashpoints import ARMED_DIR_ENV, EXIT_STATUS, step_crash_point
from celery_lease.testing import (
    CrashPoint,
    CrashPoints,
    LeaseWorker,
    SideEffects,
    assert_crash_safe,
    crash_points,
)

from .kitapp import double, notify, other, pay


def _reach(directory: str) -> None:
    os.environ[ARMED_DIR_ENV] = directory
    step_crash_point("after_step", "kit.pay", "charge")
    os._exit(0)  # not armed (or already fired): the process goes on


def _run_in_child(directory: Path) -> int | None:
    proc = multiprocessing.get_context("fork").Process(target=_reach, args=(str(directory),))
    proc.start()
    proc.join(30)
    return proc.exitcode


def test_an_armed_point_ends_the_first_process_to_reach_it_once(tmp_path: Path):
    points = CrashPoints(tmp_path / "armed")
    point = points.after_step("kit.pay", "charge")
    other_step = points.after_step("kit.pay", "reserve")

    assert _run_in_child(points.directory) == EXIT_STATUS
    assert points.fired(point) and not points.is_armed(point)
    assert points.fired_pid(point) not in (None, os.getpid())
    assert _run_in_child(points.directory) == 0  # fired once: the next process goes on
    assert points.is_armed(other_step) and not points.fired(other_step)


def test_points_are_inert_without_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    points = CrashPoints(tmp_path / "armed")
    points.arm(CrashPoint.before_outcome("kit.pay"))
    monkeypatch.delenv(ARMED_DIR_ENV, raising=False)
    step_crash_point("before_outcome", "kit.pay")  # would end this process if armed
    assert not points.fired(CrashPoint.before_outcome("kit.pay"))


def test_crash_point_names_are_checked():
    with pytest.raises(ValueError, match="must be one of"):
        CrashPoint("after_lunch", "kit.pay", "charge")
    with pytest.raises(ValueError, match="need a step"):
        CrashPoint("after_step", "kit.pay")
    with pytest.raises(ValueError, match="take no step"):
        CrashPoint("before_outcome", "kit.pay", "charge")
    assert [p.label for p in crash_points(pay, ["a", "b"])] == [
        "before_step:a",
        "after_step:a",
        "before_step:b",
        "after_step:b",
        "before_outcome",
    ]


def test_a_point_hits_only_the_task_it_names(
    lease_worker: LeaseWorker, lease_crash: CrashPoints, lease_effects: SideEffects
):
    point = lease_crash.after_step(pay, "charge")
    lease_worker.wait_state(other.delay(), State.SUCCEEDED)  # same step name, other task
    assert not lease_crash.fired(point)

    result = pay.delay(1)
    record = lease_worker.wait_state(result, State.WAIT_MANUAL)
    assert lease_crash.fired(point)
    # a pool process died, not the worker
    assert lease_crash.fired_pid(point) != lease_worker.pid and lease_worker.is_alive()
    assert record.reason is not None and "'charge'" in record.reason
    assert lease_effects.count("charge") == 1 and record.attempt == 1


@pytest.mark.lease_worker(pool="solo")
def test_a_point_in_a_solo_worker_takes_the_worker_down_and_restart_recovers(
    lease_worker: LeaseWorker, lease_crash: CrashPoints, lease_effects: SideEffects
):
    point = lease_crash.before_step(pay, "charge")
    result = pay.delay(2)
    main = lease_worker.pid
    lease_crash.wait_fired(point)
    assert lease_crash.fired_pid(point) == main

    record = lease_worker.wait_state(result, State.SUCCEEDED, restart=True)
    assert lease_worker.starts == 2 and record.attempt == 2
    assert lease_effects.count("charge") == 1


def test_assert_crash_safe_passes_a_safe_task_and_names_the_unsafe_point(
    lease_worker: LeaseWorker, lease_effects: SideEffects
):
    with pytest.raises(AssertionError, match=r"before_outcome: effects \{'attempt': 2"):
        # "attempt" is counted outside any step: every re-run repeats it
        assert_crash_safe(
            lease_worker,
            lambda: pay.delay(3),
            effects=lease_effects,
            manual={"after_step:charge"},
            points=[CrashPoint.before_outcome(pay)],
        )
    matrix = assert_crash_safe(
        lease_worker,
        lambda: pay.delay(3),
        effects=lease_effects,
        manual={"after_step:charge"},
        ignore_effects={"attempt"},
    )
    assert [r.label for r in matrix.runs] == [
        p.label for p in crash_points(pay, ["reserve", "charge"])
    ]
    assert matrix["after_step:charge"].record.state is State.WAIT_MANUAL
    assert all(r.effects.get("charge") == 1 for r in matrix.runs)

    # an "idempotent" step that repeats its effect on a re-run is caught
    with pytest.raises(AssertionError, match=r"after_step:send: effects \{'send': 2\}"):
        assert_crash_safe(lease_worker, double.delay, effects=lease_effects)


def test_a_key_from_the_arguments_fails_the_matrix_and_idempotency_key_passes(
    lease_worker: LeaseWorker, lease_effects: SideEffects
):
    # the counter spans every run of the matrix and each run sends the same arguments:
    # a key built from them is answered from the baseline's effect in every later run
    # (docs/testing.md, "Every crash point at once")
    point = [CrashPoint.before_step(notify, "notify")]
    with pytest.raises(
        AssertionError, match=r"before_step:notify: effects \{\}, expected \{'notify': 1\}"
    ):
        assert_crash_safe(
            lease_worker, lambda: notify.delay(7, False), effects=lease_effects, points=point
        )
    matrix = assert_crash_safe(
        lease_worker, lambda: notify.delay(7, True), effects=lease_effects, points=point
    )
    assert matrix.baseline.effects == matrix["before_step:notify"].effects == {"notify": 1}
