#!/usr/bin/env python
"""Plain Celery and celery-lease at the same crash points, measured with the same harness.

    python scripts/compare_celery.py [--repeat 3] [--task-seconds 4] [--freeze-seconds 15]

One task, Redis broker, prefork workers (concurrency 1, prefetch 1), real processes
(the crash suite's harness: generated projects, real ``celery worker`` subprocesses and
the counting stub of an external system). The task records that it started, makes one
external call (a charge), works a few seconds (the crash lands there), then records
that it completed. With celery-lease the charge and the completion are steps.

Crash points:

1. a pool child SIGKILLed mid-task: default acks, ``acks_late``, ``acks_late`` +
   ``task_reject_on_worker_lost``, celery-lease;
2. the whole worker SIGKILLed while another worker is up: ``acks_late`` +
   ``task_reject_on_worker_lost`` with Redis' ``visibility_timeout`` at its default
   (3600 s) and lowered to 10 s, celery-lease;
3. the worker frozen (SIGSTOP) past the visibility timeout while another worker is
   up, then resumed: the same three;
4. no fault at all: a task running longer than the lowered visibility timeout, another
   worker up (plain Celery redelivers what is merely slow).

For each: whether the task was lost or re-run, how many runs started, how many times
the external effect was charged, how many runs completed, and the time from the fault
to the re-run's start. Prints a markdown table. Services as for ``scripts/soak.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import statistics
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from celery_lease import State
from tests.crash.standalone import Standalone
from tests.helpers import ExternalSystem, WorkerProcess, WorkerProject, wait_until

PLAIN_SOURCE = """
import time

from tests.helpers import ExternalSystem

external = ExternalSystem.from_env()


@app.task(bind=True, name="cmp.job")
def job(self, key, seconds):
    external.call(f"start:{key}", payload=repr(time.time()))
    external.call(f"charge:{key}")  # the external effect (a payment)
    time.sleep(seconds)  # the crash lands here
    external.call(f"done:{key}")
"""

LEASED_SOURCE = """
import time

from celery_lease import LeasedTask
from tests.helpers import ExternalSystem

external = ExternalSystem.from_env()


@app.task(base=LeasedTask, bind=True, name="cmp.job")
def job(self, key, seconds):
    external.call(f"start:{key}", payload=repr(time.time()))
    self.step("charge", external.call, f"charge:{key}")  # recorded: a re-run skips it
    time.sleep(seconds)  # the crash lands here
    self.step("done", external.call, f"done:{key}")
"""

#: celery-lease's timings in this comparison (LeaseConfig fields)
LEASE = {"ttl": 3.0, "heartbeat_interval": 0.5, "reaper_interval": 0.5}
LOWERED_VT = 10.0


@dataclasses.dataclass(frozen=True)
class Setup:
    name: str
    leased: bool = False
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)


def _vt(seconds: float | None) -> dict[str, Any]:
    if seconds is None:
        return {}
    # kombu scans for expired unacked messages every interval x throttle (10 x 10 s by
    # default): both at 1 give the lowered timeout its best case
    return {
        "broker_transport_options": {
            "visibility_timeout": seconds,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        }
    }


DEFAULT_ACKS = Setup("plain Celery, default (early) acks")
ACKS_LATE = Setup("plain Celery, acks_late", settings={"task_acks_late": True})
REJECT = {"task_acks_late": True, "task_reject_on_worker_lost": True}
REJECT_VT_DEFAULT = Setup(
    "plain Celery, acks_late + reject_on_worker_lost, visibility_timeout 3600 s (default)",
    settings=REJECT,
)
REJECT_VT_LOW = Setup(
    f"plain Celery, acks_late + reject_on_worker_lost, visibility_timeout {LOWERED_VT:g} s",
    settings={**REJECT, **_vt(LOWERED_VT)},
)
LEASED = Setup(
    f"celery-lease (ttl {LEASE['ttl']:g} s, heartbeat {LEASE['heartbeat_interval']:g} s, "
    f"reaper {LEASE['reaper_interval']:g} s)",
    leased=True,
)

CHILD = "pool child SIGKILL mid-task"
WORKER = "whole worker SIGKILL, another worker up"
FROZEN = "worker frozen past the visibility timeout, another worker up, then resumed"
SLOW = f"no fault: a task running {LOWERED_VT + 5:g} s (past the lowered visibility timeout)"

CASES: list[tuple[str, Setup]] = [
    (CHILD, DEFAULT_ACKS),
    (CHILD, ACKS_LATE),
    (CHILD, Setup("plain Celery, acks_late + reject_on_worker_lost", settings=REJECT)),
    (CHILD, LEASED),
    (WORKER, REJECT_VT_DEFAULT),
    (WORKER, REJECT_VT_LOW),
    (WORKER, LEASED),
    (FROZEN, REJECT_VT_DEFAULT),
    (FROZEN, REJECT_VT_LOW),
    (FROZEN, LEASED),
    (SLOW, REJECT_VT_LOW),
    (SLOW, LEASED),
]


@dataclasses.dataclass
class Outcome:
    crash: str
    setup: str
    runs: int
    charged: int
    completed: int
    rerun_after: float | None
    window: float
    state: str | None = None

    @property
    def verdict(self) -> str:
        if self.state is not None and self.state.startswith("WAIT_MANUAL"):
            return "handed to a person"
        if self.completed == 0 and self.runs < 2:
            return f"**lost**: not redelivered within {self.window:.0f} s"
        if self.completed >= 2:
            return "**ran twice**"
        if self.runs >= 2:
            return "re-run" + (", **effect repeated**" if self.charged > 1 else "")
        if self.crash == FROZEN:
            return "ran once, only when the frozen worker resumed"
        if self.crash == SLOW:
            return "ran once"
        return "ran once (no re-run)"


class Case:
    """One crash point under one setup, in a project of its own."""

    def __init__(self, env: Standalone, setup: Setup, args: argparse.Namespace) -> None:
        self.env = env
        self.setup = setup
        self.args = args
        self.settings = {"task_ignore_result": True, **setup.settings}
        self.leased = None
        self.project: WorkerProject
        self.external: ExternalSystem
        if setup.leased:
            self.leased = env.leased_project(LEASED_SOURCE, settings=self.settings, **LEASE)
            self.project, self.external = self.leased.project, self.leased.external
        else:
            self.project, self.external = env.plain_project(PLAIN_SOURCE, settings=self.settings)
        self.key = uuid.uuid4().hex[:8]

    def worker(self, name: str) -> WorkerProcess:
        w = self.project.worker(name, pool="prefork", concurrency=1)
        w.wait_ready(timeout=90, store=self.leased.store if self.leased else None)
        return w

    def starts(self) -> list[float]:
        return [float(e.payload or 0) for e in self.external.effects(f"start:{self.key}")]

    def run(self, crash: str) -> Outcome:
        a = self.worker("a")
        module = self.leased.module if self.leased is not None else self.project.load()
        task = module.app.tasks["cmp.job"]
        # no fault: a task merely longer than the lowered visibility timeout
        seconds = LOWERED_VT + 5.0 if crash == SLOW else self.args.task_seconds
        task_id = str(task.apply_async((self.key, seconds)).id)
        wait_until(lambda: self.starts(), timeout=60, message="the task never started")
        # the crash lands in the work, after the charge (and, leased, after its step record)
        wait_until(
            lambda: self.external.count(f"charge:{self.key}"), timeout=30, message="no charge"
        )
        if self.leased is not None:
            store = self.leased.store
            wait_until(
                lambda: any(s.name == "charge" and s.state == "DONE" for s in store.steps(task_id)),
                timeout=30,
                message="the charge step was never recorded",
            )
        time.sleep(0.3)
        (first,) = self.external.effects(f"start:{self.key}")
        if crash == CHILD:
            window = 25.0
            fault = time.time()
            os.kill(first.pid, signal.SIGKILL)
        else:
            self.worker("b")
            fault = time.time()
            if crash == WORKER:
                window = 40.0 if self.setup is REJECT_VT_DEFAULT else LOWERED_VT + 25.0
                a.kill_group(signal.SIGKILL)
            elif crash == SLOW:
                fault = float(first.payload or fault)  # measured from the task's start
                window = seconds + 10.0
            else:
                window = self.args.freeze_seconds + self.args.task_seconds + 8.0
                a.kill_group(signal.SIGSTOP)
        thawed = crash != FROZEN
        deadline = fault + window
        while time.time() < deadline:
            if not thawed and time.time() >= fault + self.args.freeze_seconds:
                a.kill_group(signal.SIGCONT)
                thawed = True
            done = self.external.count(f"done:{self.key}")
            # finished, and nothing else on its way (a resumed worker finishes its own run)
            quiet = 3.0
            if crash == FROZEN:
                quiet += self.args.freeze_seconds + self.args.task_seconds
            elif crash == SLOW:
                quiet += seconds
            if thawed and done and time.time() > fault + quiet:
                break
            time.sleep(0.1)
        if not thawed:
            a.kill_group(signal.SIGCONT)
        starts = self.starts()
        state = None
        if self.leased is not None:
            store = self.leased.store
            settled = (State.SUCCEEDED, State.FAILED, State.WAIT_MANUAL, State.CANCELLED)
            with contextlib.suppress(AssertionError):  # report the row as it is
                wait_until(
                    lambda: (r := store.get(task_id)) is not None and r.state in settled,
                    timeout=15,
                )
            record = store.get(task_id)
            if record is None:
                state = "missing"
            elif record.state is State.SUCCEEDED:
                state = record.state.value
            else:
                state = f"{record.state.value} ({record.reason})"
        return Outcome(
            crash=crash,
            setup=self.setup.name,
            runs=len(starts),
            charged=self.external.count(f"charge:{self.key}"),
            completed=self.external.count(f"done:{self.key}"),
            rerun_after=starts[1] - fault if len(starts) > 1 else None,
            window=window,
            state=state,
        )


def _spread(values: list[int]) -> str:
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}-{high}"


def table(outcomes: list[Outcome]) -> str:
    """One row per crash point and setup; repeated runs are summarized (counts as
    ranges, times as median and range, outcomes with how often each happened)."""
    lines = [
        "| crash point | setup | outcome | runs started | effect charged | runs completed "
        "| fault -> re-run started |",
        "|---|---|---|---|---|---|---|",
    ]
    cases = list(dict.fromkeys((o.crash, o.setup) for o in outcomes))
    for crash, setup in cases:
        reps = [o for o in outcomes if (o.crash, o.setup) == (crash, setup)]
        verdicts = Counter(o.verdict + (f"; row {o.state}" if o.state else "") for o in reps)
        if len(verdicts) == 1:
            verdict = next(iter(verdicts))
        else:
            verdict = "; ".join(f"{v} ({n} of {len(reps)})" for v, n in verdicts.items())
        times = sorted(o.rerun_after for o in reps if o.rerun_after is not None)
        if not times:
            rerun = "-"
        elif len(times) == 1:
            rerun = f"{times[0]:.1f} s"
        else:
            rerun = f"{statistics.median(times):.1f} s ({times[0]:.1f}-{times[-1]:.1f})"
        runs = _spread([o.runs for o in reps])
        charged = _spread([o.charged for o in reps])
        completed = _spread([o.completed for o in reps])
        n = f" x{len(reps)}" if len(reps) > 1 else ""
        lines.append(
            f"| {crash} | {setup}{n} | {verdict} | {runs} | {charged} | {completed} | {rerun} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task-seconds", type=float, default=4.0)
    parser.add_argument("--freeze-seconds", type=float, default=15.0)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each case")
    parser.add_argument("--keep", action="store_true", help="keep the workers' logs")
    parser.add_argument("--only", default="", help="run only cases whose setup contains this")
    args = parser.parse_args(argv)
    if args.freeze_seconds <= LOWERED_VT:
        parser.error(f"--freeze-seconds must exceed the lowered visibility timeout ({LOWERED_VT})")
    outcomes = []
    with Standalone(keep=args.keep) as env:
        for crash, setup in CASES:
            if args.only and args.only not in setup.name:
                continue
            # a window in which nothing can come is watched once
            reps = 1 if setup is REJECT_VT_DEFAULT else args.repeat
            for rep in range(reps):
                print(f"-- {crash}: {setup.name} ({rep + 1}/{reps})", flush=True)
                case = Case(env, setup, args)
                try:
                    outcome = case.run(crash)
                finally:
                    env.registry.close()
                    env.registry.workers.clear()
                    env.registry.apps.clear()
                    env.registry.modules.clear()
                    env.flush_redis()  # unacked messages of this case must not reach the next
                print(f"   {outcome}", flush=True)
                outcomes.append(outcome)
    print()
    print(
        f"Task: start, one external charge, {args.task_seconds:g} s of work (the crash lands "
        "there), complete. Redis broker, prefork workers (concurrency 1, prefetch 1); "
        f"frozen for {args.freeze_seconds:g} s."
    )
    print()
    print(table(outcomes))
    print()
    print(
        "A pool child's death is noticed by Celery's prefork pool (billiard), at once or at "
        "its next pool check (up to ~5 s), for plain Celery and celery-lease alike; "
        "celery-lease then expires the lease at once. A lost or frozen worker is detected "
        f"after the lease TTL ({LEASE['ttl']:g} s here, 30 s by default), plain Celery + "
        "Redis redelivers after the visibility timeout, counted from the delivery."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
