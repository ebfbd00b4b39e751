"""Run a task once without a crash and once per crash point; compare the final states."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import Any

from ..records import TaskRecord
from ..states import State
from ._assertions import assert_audit_trail, assert_check_clean
from ._crash import CrashPoint, crash_points
from ._effects import SideEffects
from ._worker import LeaseWorker, _task_id


@dataclasses.dataclass(frozen=True)
class CrashRun:
    """One run of the task: where it was killed (``None``: no crash) and how it ended."""

    point: CrashPoint | None
    record: TaskRecord
    #: step name -> state (DONE, STARTED), in the order the steps started
    steps: dict[str, str]
    #: real side effects of this run, per name (empty without a counter)
    effects: dict[str, int]

    @property
    def label(self) -> str:
        return "no crash" if self.point is None else self.point.label

    def describe(self) -> str:
        effects = ", ".join(f"{k}={v}" for k, v in sorted(self.effects.items())) or "-"
        return (
            f"{self.label:28} {self.record.state.value:12} attempt {self.record.attempt}  "
            f"steps {self.steps}  effects {effects}"
        )


@dataclasses.dataclass
class CrashMatrix:
    """The runs of :func:`assert_crash_safe`: the baseline first, then one per point."""

    baseline: CrashRun
    runs: list[CrashRun]

    def __getitem__(self, point: CrashPoint | str) -> CrashRun:
        """The run killed at ``point`` (a :class:`CrashPoint` or its label)."""
        for run in self.runs:
            if run.point == point or (run.point is not None and run.point.label == point):
                return run
        raise KeyError(point)

    def table(self) -> str:
        """One line per run, the baseline first."""
        return "\n".join(r.describe() for r in [self.baseline, *self.runs])


def _matches(point: CrashPoint, wanted: Collection[CrashPoint | str]) -> bool:
    return point in wanted or point.label in wanted


def _run(
    worker: LeaseWorker,
    submit: Callable[[], Any],
    point: CrashPoint | None,
    effects: SideEffects | None,
    ignored: frozenset[str],
    timeout: float,
) -> CrashRun:
    before = effects.counts() if effects is not None else {}
    if point is not None:
        worker.crash.arm(point)
    try:
        task_id = _task_id(submit())
        record = worker.wait_state(task_id, timeout=timeout, restart=True)
        if point is not None:
            assert worker.crash.fired(point), (
                f"crash point {point} was never reached: task {task_id} ended "
                f"{record.state.value} without passing it (is the step name right?)"
            )
    finally:
        if point is not None:
            worker.crash.disarm(point)
    after = effects.counts() if effects is not None else {}
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    steps = {s.name: s.state for s in worker.store.steps(task_id)}
    counted = {k: v for k, v in delta.items() if v and k not in ignored}
    return CrashRun(point, record, steps, counted)


def assert_crash_safe(
    worker: LeaseWorker,
    submit: Callable[[], Any],
    *,
    effects: SideEffects | None = None,
    points: Sequence[CrashPoint] | None = None,
    manual: Collection[CrashPoint | str] = (),
    compare_results: bool = True,
    ignore_effects: Collection[str] = (),
    timeout: float = 60.0,
) -> CrashMatrix:
    """Run a task without a crash, then once per crash point, and compare the ends.

    ``submit()`` sends one new task (returns its ``AsyncResult`` or id); it is called
    once per run, so every run is a task of its own. Each crashed run arms one point,
    waits until the task settles (restarting the worker if the crash took it down) and
    checks that the point fired. Then, for every crashed run:

    * a point in ``manual`` (a :class:`CrashPoint` or its label, e.g.
      ``"after_step:charge"``) must end in WAIT_MANUAL, handed to a person;
    * any other must end as the baseline did: same state, same steps in the same
      states, the same result (unless ``compare_results=False``);
    * with a counter (``effects``), no side effect happens more often than in the
      baseline, and outside ``manual`` exactly as often.

    Every task's audit trail must be consistent and the store's invariants hold.

    Args:
        worker: the worker (``lease_worker``).
        submit: sends one task.
        effects: the side-effect counter the task's code calls (``lease_effects``).
        points: where to crash (default: every point of the task's steps, as the
            baseline run recorded them; see :func:`crash_points`).
        manual: the points after which a person must decide.
        compare_results: compare the tasks' results with the baseline's.
        ignore_effects: names counted for the test's own bookkeeping (attempts, say),
            which a re-run legitimately repeats.
        timeout: seconds each run may take.

    Returns:
        The runs, to assert more on (``matrix["after_step:charge"].record``).

    Raises:
        AssertionError: listing every run that differs, with the whole table.
    """
    ignored = frozenset(ignore_effects)
    baseline = _run(worker, submit, None, effects, ignored, timeout)
    if points is None:
        points = crash_points(baseline.record.name, list(baseline.steps))
    runs = [_run(worker, submit, point, effects, ignored, timeout) for point in points]
    matrix = CrashMatrix(baseline, runs)
    problems: list[str] = []
    for run in runs:
        assert run.point is not None
        if _matches(run.point, manual):
            if run.record.state is not State.WAIT_MANUAL:
                problems.append(f"{run.label}: {run.record.state.value}, expected WAIT_MANUAL")
            for name, count in run.effects.items():
                if count > baseline.effects.get(name, 0):
                    problems.append(f"{run.label}: {name} happened {count} times")
            continue
        base = baseline.record
        if run.record.state is not base.state:
            problems.append(
                f"{run.label}: {run.record.state.value}, expected {base.state.value} "
                f"(reason: {run.record.reason!r})"
            )
        if run.steps != baseline.steps:
            problems.append(f"{run.label}: steps {run.steps}, expected {baseline.steps}")
        if compare_results and run.record.result != base.result:
            problems.append(f"{run.label}: result {run.record.result!r}, expected {base.result!r}")
        if effects is not None and run.effects != baseline.effects:
            problems.append(f"{run.label}: effects {run.effects}, expected {baseline.effects}")
    assert_audit_trail(worker.store, [r.record.id for r in [baseline, *runs]])
    assert_check_clean(worker.store)
    if problems:
        raise AssertionError(
            "not crash-safe:\n  " + "\n  ".join(problems) + "\n\nruns:\n" + matrix.table()
        )
    return matrix
