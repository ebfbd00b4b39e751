"""Crash points a test aims at its own tasks: a step about to run, a step whose function
returned before its result is recorded, and a task whose outcome is not written yet.

The points themselves are in the library (:mod:`celery_lease._crashpoints`), inert in
every process that was not started with ``CELERY_LEASE_CRASH_DIR``. A worker the kit
starts has that variable; arming a point is creating a file there, at any time, even
while the worker runs. The first process to reach an armed point ends at once with
``os._exit(137)``: no ``finally`` blocks, no flushing, as if the kernel killed it
there. Each arming fires once.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .._crashpoints import ARMED_DIR_ENV, STEP_POINTS, armed_name
from ._polling import wait_until


def task_name(task: Any) -> str:
    """The registered name of a task object, or the name itself."""
    name = getattr(task, "name", task)
    if not isinstance(name, str) or not name:
        raise TypeError(f"expected a task or a task name, got {task!r}")
    return name


@dataclasses.dataclass(frozen=True)
class CrashPoint:
    """Where to kill a task's process: ``where`` is one of ``before_step``,
    ``after_step`` (both with a ``step`` name) or ``before_outcome`` (no step)."""

    where: str
    task: str
    step: str | None = None

    def __post_init__(self) -> None:
        if self.where not in STEP_POINTS:
            raise ValueError(f"crash point must be one of {STEP_POINTS}, got {self.where!r}")
        if (self.step is None) != (self.where == "before_outcome"):
            need = "need a" if self.step is None else "take no"
            raise ValueError(f"{self.where} crash points {need} step name")

    @classmethod
    def before_step(cls, task: Any, step: str) -> CrashPoint:
        """Kill the process as step ``step`` of ``task`` is about to run."""
        return cls("before_step", task_name(task), step)

    @classmethod
    def after_step(cls, task: Any, step: str) -> CrashPoint:
        """Kill the process after the step's function returned, before its result is recorded."""
        return cls("after_step", task_name(task), step)

    @classmethod
    def before_outcome(cls, task: Any) -> CrashPoint:
        """Kill the process after the task's function returned, before its outcome is written."""
        return cls("before_outcome", task_name(task))

    @property
    def label(self) -> str:
        """A short label, e.g. ``after_step:charge`` (handy as a pytest id)."""
        return self.where if self.step is None else f"{self.where}:{self.step}"

    def __str__(self) -> str:
        return f"{self.label} of {self.task}"


def crash_points(task: Any, steps: Iterable[str]) -> list[CrashPoint]:
    """Every crash point of a task whose steps are ``steps``: before and after each step,
    in order, then before the outcome."""
    name = task_name(task)
    points: list[CrashPoint] = []
    for step in steps:
        points += [CrashPoint.before_step(name, step), CrashPoint.after_step(name, step)]
    points.append(CrashPoint.before_outcome(name))
    return points


class CrashPoints:
    """The crash points one test armed: a directory its workers watch.

    ``env`` is what a worker needs to see them (the kit's workers have it).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    @property
    def env(self) -> dict[str, str]:
        return {ARMED_DIR_ENV: str(self.directory)}

    def _path(self, point: CrashPoint) -> Path:
        return self.directory / armed_name(point.where, point.task, point.step)

    def arm(self, point: CrashPoint) -> CrashPoint:
        """Arm ``point``: the next process to reach it dies there. Returns ``point``."""
        self._fired_path(point).unlink(missing_ok=True)
        self._path(point).write_text(json.dumps(dataclasses.asdict(point)))
        return point

    def before_step(self, task: Any, step: str) -> CrashPoint:
        """Arm :meth:`CrashPoint.before_step`."""
        return self.arm(CrashPoint.before_step(task, step))

    def after_step(self, task: Any, step: str) -> CrashPoint:
        """Arm :meth:`CrashPoint.after_step`."""
        return self.arm(CrashPoint.after_step(task, step))

    def before_outcome(self, task: Any) -> CrashPoint:
        """Arm :meth:`CrashPoint.before_outcome`."""
        return self.arm(CrashPoint.before_outcome(task))

    def disarm(self, point: CrashPoint) -> bool:
        """Disarm ``point`` if it has not fired; whether it was still armed."""
        try:
            self._path(point).unlink()
        except FileNotFoundError:
            return False
        return True

    def is_armed(self, point: CrashPoint) -> bool:
        return self._path(point).exists()

    def fired(self, point: CrashPoint) -> bool:
        """Whether ``point`` fired since it was last armed."""
        return self._fired_path(point).exists()

    def fired_pid(self, point: CrashPoint) -> int | None:
        """The pid of the process that died at ``point`` (``None``: not fired)."""
        try:
            text = self._fired_path(point).read_text()
        except FileNotFoundError:
            return None
        return int(text) if text.isdigit() else None

    def wait_fired(self, point: CrashPoint, timeout: float = 30.0) -> int:
        """Wait until ``point`` fired; return the pid of the process it killed."""
        return wait_until(
            lambda: self.fired_pid(point),
            timeout=timeout,
            message=f"crash point {point} never fired",
        )

    def _fired_path(self, point: CrashPoint) -> Path:
        path = self._path(point)
        return path.with_name(path.name + ".fired")
