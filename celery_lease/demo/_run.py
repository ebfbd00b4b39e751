"""``python -m celery_lease.demo``: watch celery-lease recover from real crashes.

Needs no server: the store is a SQLite file and the broker is kombu's filesystem
transport, both in a data directory (``./demo-data`` by default). The demo starts a
real ``celery worker`` (prefork, two pool processes) of its project, the module
:mod:`celery_lease.demo.app`, submits orders that each run three steps with a real
side effect, then

1. SIGKILLs the pool process running one order in the middle of a step,
2. SIGKILLs the whole worker (main process and pool) while orders run,
3. starts a new worker under the same node name, as a supervisor would,

waits until every order is finished and prints the timeline (from the audit trail)
and a table: final state, attempts, recovery time, and the side effects counted in a
separate "external system" database. Exit status 0 only if every order SUCCEEDED and
every side effect happened exactly once. POSIX only (it sends signals).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import shutil
import signal
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from .._runtime import runtime
from ..operations import Admin, admin
from ..records import TaskRecord, TransitionRecord
from ..testing import SideEffects, WorkerProcess, pid_alive, wait_until
from ._names import DATA_ENV, STEP_SECONDS_ENV, STEPS

T = TypeVar("T")

NODENAME = "demo@%h"
MARKER = ".celery-lease-demo"
SUMMARY_OK = "OK"
SUMMARY_FAILED = "FAILED"


class DemoError(Exception):
    """The demo could not do what it set out to do (not a celery-lease verdict)."""


def _wait(
    predicate: Callable[[], T | None], timeout: float, what: str, interval: float = 0.05
) -> T:
    """Poll ``predicate`` until it returns something truthy; ``DemoError`` after ``timeout``."""
    try:
        return wait_until(predicate, timeout=timeout, interval=interval, message=what)
    except AssertionError:
        raise DemoError(f"timed out after {timeout:g} s waiting for {what}") from None


# -- what the external system saw (the project records each order's runs and steps) ----


def effects_by_step(external: SideEffects) -> dict[tuple[str, str], int]:
    """(task id, step) -> how many times the side effect really happened."""
    out: dict[tuple[str, str], int] = {}
    for effect in external.effects():
        if effect.name in STEPS and effect.payload is not None:
            out[(effect.payload, effect.name)] = out.get((effect.payload, effect.name), 0) + 1
    return out


def effect_count(external: SideEffects, task_id: str) -> int:
    return sum(1 for e in external.effects() if e.name in STEPS and e.payload == task_id)


def last_run(external: SideEffects, task_id: str) -> tuple[int, float] | None:
    """(pid, start time) of the latest execution of ``task_id``."""
    runs = [e for e in external.effects("run") if e.payload == task_id]
    return (runs[-1].pid, runs[-1].at) if runs else None


def last_effect_at(external: SideEffects, task_id: str) -> float | None:
    times = [e.at for e in external.effects() if e.name in STEPS and e.payload == task_id]
    return max(times) if times else None


@dataclasses.dataclass
class Event:
    """One line of the timeline."""

    at: float
    text: str
    crash: bool = False


@dataclasses.dataclass
class Crash:
    """A kill the demo made, and what it hit."""

    label: str
    short: str
    at: float
    task_ids: list[str]
    lost_messages: list[str] = dataclasses.field(default_factory=list)


class Worker(WorkerProcess):
    """A real ``celery worker`` of the demo's project (the testing kit's process)."""

    def __init__(self, number: int, data_dir: Path, step_seconds: float) -> None:
        self.number = number
        self.started_at = 0.0
        super().__init__(
            "celery_lease.demo.app",
            cwd=data_dir,
            log_path=data_dir / f"worker{number}.log",
            env={DATA_ENV: str(data_dir), STEP_SECONDS_ENV: repr(step_seconds)},
            pool="prefork",
            concurrency=2,
            nodename=NODENAME,
        )

    def start(self) -> Worker:
        self.started_at = time.time()
        super().start()
        return self

    @property
    def main_pid(self) -> int:
        return self.require_pid()

    def kill_group(self) -> None:
        """SIGKILL the main process and its pool at once (one process group)."""
        self.signal_group(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=10)

    def request_stop(self) -> None:
        """Ask for a warm shutdown (SIGTERM to the main process) without waiting."""
        if self.is_alive():
            self.signal_main(signal.SIGTERM)

    def log_tail(self, lines: int = 25) -> str:
        return super().log_tail(lines)

    def dropped_deliveries(self) -> int:
        """Deliveries the worker dropped at claim without running them (duplicates)."""
        return self.log_text().count("delivery dropped without running")


# -- the demo -------------------------------------------------------------------------------


class Demo:
    """One run of the demo: set-up, the crash scenario, and the report."""

    def __init__(self, data_dir: Path, tasks: int, step_seconds: float, out: Any) -> None:
        self.data_dir = data_dir
        self.n_tasks = tasks
        self.step_seconds = step_seconds
        self.out = out
        self.t0 = time.time()
        self.events: list[Event] = []
        self.crashes: list[Crash] = []
        self.workers: list[Worker] = []
        self.external: Any = None  # the project's side-effect counter, Celery app, task
        self.task: Any = None
        self._admin: Admin | None = None
        self.orders: dict[str, int] = {}  # task id -> order number

    # -- output ---------------------------------------------------------------------------

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def note(self, text: str, *, at: float | None = None, crash: bool = False) -> None:
        when = time.time() if at is None else at
        self.events.append(Event(when, text, crash))
        self.say(f"  {when - self.t0:6.2f}s  {'*** ' if crash else ''}{text}")

    def label(self, task_id: str) -> str:
        order = self.orders.get(task_id)
        return f"order {order}" if order is not None else task_id[:8]

    # -- set-up ---------------------------------------------------------------------------

    def prepare(self) -> None:
        data = self.data_dir
        if data.exists() and any(data.iterdir()):
            if not (data / MARKER).exists():
                raise DemoError(
                    f"{data} exists and was not made by the demo: choose another --data-dir"
                )
            shutil.rmtree(data)
        (data / "broker").mkdir(parents=True)
        (data / MARKER).write_text("made by python -m celery_lease.demo; safe to delete\n")
        # the project reads where its data goes when it is imported, as its workers do
        os.environ[DATA_ENV] = str(data)
        os.environ[STEP_SECONDS_ENV] = repr(self.step_seconds)
        module = importlib.import_module("celery_lease.demo.app")
        loaded_for = (module.DATA, module.STEP_SECONDS)
        if loaded_for != (data, self.step_seconds):
            module = importlib.reload(module)  # a second run in one process
        self.external = module.external()
        self.app = module.app
        self.task = module.process_order
        self._admin = admin(self.app)
        runtime(self.app).store.migrate()

    def start_worker(self) -> Worker:
        number = len(self.workers) + 1
        known = {w.id for w in self.admin.workers()}
        worker = Worker(number, self.data_dir, self.step_seconds)
        self.workers.append(worker)
        worker.start()

        def registered() -> Any:
            if not worker.is_alive():
                raise DemoError(
                    f"worker {number} exited with status {worker.returncode}:\n" + worker.log_tail()
                )
            fresh = [w for w in self.admin.workers() if w.id not in known and w.alive]
            return fresh[0] if fresh else None

        record = _wait(registered, 60, f"worker {number} to start")
        self.note(
            f"worker {number} started: node {record.nodename}, pid {worker.main_pid} "
            f"(registered {record.started_at.timestamp() - worker.started_at:.1f} s after launch)",
            at=record.started_at.timestamp(),
        )
        return worker

    # -- reading the store ----------------------------------------------------------------

    @property
    def admin(self) -> Admin:
        if self._admin is None:
            raise DemoError("the demo project is not set up")
        return self._admin

    def record(self, task_id: str) -> TaskRecord:
        found = self.admin.get(task_id)
        if found is None:
            raise DemoError(f"{self.label(task_id)} has no row")
        return found

    def states(self) -> dict[str, str]:
        return {tid: self.record(tid).state.value for tid in self.orders}

    def running(self) -> list[str]:
        return [tid for tid, state in self.states().items() if state == "RUNNING"]

    def all_finished(self) -> bool:
        final = {"SUCCEEDED", "FAILED", "CANCELLED", "WAIT_MANUAL"}
        return all(state in final for state in self.states().values())

    def queued_ids(self) -> set[str]:
        """Task ids of the messages still waiting in the broker folder."""
        ids: set[str] = set()
        for path in (self.data_dir / "broker").glob("*.msg"):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                ids.add(str(json.loads(path.read_text())["headers"]["id"]))
        return ids

    # -- the scenario ---------------------------------------------------------------------

    def submit(self) -> None:
        for order in range(1, self.n_tasks + 1):
            result = self.task.apply_async((order,), dedup_key=f"order-{order}")
            self.orders[result.id] = order
        again = self.task.apply_async((1,), dedup_key="order-1")
        first = next(tid for tid, order in self.orders.items() if order == 1)
        if again.id != first:
            raise DemoError("a second submission with the same dedup_key made a new task")
        self.note(
            f"submitted {self.n_tasks} orders ({STEPS[0]} -> {STEPS[1]} -> {STEPS[2]}, "
            f"~{self.step_seconds:g} s per step); order 1 submitted again with the same "
            "dedup_key: same task id, nothing published"
        )

    def kill_pool_child(self, worker: Worker) -> None:
        """SIGKILL the pool process of an order that is in the middle of its second step."""

        def victim() -> tuple[str, int] | None:
            for tid in self.running():
                run = last_run(self.external, tid)
                done_at = last_effect_at(self.external, tid)
                if run is None or done_at is None or not pid_alive(run[0]):
                    continue
                # first step's effect happened in this run and the second step is under way
                if (
                    effect_count(self.external, tid) == 1
                    and done_at > run[1]
                    and time.time() - done_at >= self.step_seconds * 0.4
                ):
                    return tid, run[0]
            return None

        task_id, pid = _wait(victim, 30, "an order in the middle of a step")
        os.kill(pid, signal.SIGKILL)
        crash = Crash("pool process SIGKILL", "pool process kill", time.time(), [task_id])
        self.crashes.append(crash)
        self.note(
            f"SIGKILL pool process {pid} of worker {worker.number} in the middle of "
            f"{self.label(task_id)} (step '{STEPS[0]}' done)",
            at=crash.at,
            crash=True,
        )
        # go on once the lease is expired and the order is back in the queue
        _wait(
            lambda: any(r.to_state.value == "PENDING" for r in self.admin.history(task_id)[1:]),
            30,
            f"{self.label(task_id)} to be recovered",
        )

    def kill_worker(self, worker: Worker) -> None:
        """SIGKILL the worker's whole process group while two orders run."""

        def busy() -> list[str] | None:
            running = []
            for tid in self.running():
                run = last_run(self.external, tid)
                # a live pool process well inside a step, not just claiming
                if (
                    run is not None
                    and pid_alive(run[0])
                    and time.time() - run[1] >= self.step_seconds * 0.5
                ):
                    running.append(tid)
            return running if len(running) >= 2 else None

        running = _wait(busy, 30, "two orders running at once")
        worker.kill_group()
        at = time.time()
        # nothing consumes the broker folder now: a PENDING row without a message in it
        # had its message prefetched by the dead worker
        queued = self.queued_ids()
        states = self.states()
        lost = sorted(
            tid for tid, state in states.items() if state == "PENDING" and tid not in queued
        )
        self.crashes.append(Crash("worker SIGKILL", "worker kill", at, running, lost))
        names = ", ".join(self.label(t) for t in running)
        self.note(
            f"SIGKILL worker {worker.number}'s process group (main process {worker.main_pid} "
            f"and its pool): {names} running",
            at=at,
            crash=True,
        )
        if lost:
            self.note(
                "  messages the dead worker had prefetched are gone with it: "
                + ", ".join(self.label(t) for t in lost)
                + " (their rows are PENDING: the reaper re-publishes them)",
                at=at,
            )

    def run(self) -> int:
        self.say("celery-lease demo: real worker, real SIGKILLs, no server needed")
        self.say(f"data directory: {self.data_dir}\n")
        self.say("what the demo does (seconds since start):")
        self.prepare()
        try:
            first = self.start_worker()
            self.submit()
            self.kill_pool_child(first)
            self.kill_worker(first)
            self.start_worker()
            _wait(self.all_finished, 60, "every order to finish", interval=0.1)
            self.note("every order finished")
            for w in self.workers:
                w.request_stop()  # a warm shutdown takes a few seconds: report meanwhile
            return self.report()
        except DemoError:
            for w in self.workers:
                self.say(f"\n--- worker {w.number} log (tail) ---\n{w.log_tail()}")
            raise
        finally:
            for w in self.workers:
                w.stop()

    # -- the report -----------------------------------------------------------------------

    @staticmethod
    def _first(rows: list[TransitionRecord], state: str, since: float) -> float | None:
        """Seconds from ``since`` to the first transition into ``state`` among ``rows``."""
        found = [r.at.timestamp() for r in rows if r.to_state.value == state]
        return min(found) - since if found else None

    def report(self) -> int:
        history = {tid: self.admin.history(tid) for tid in self.orders}
        records = {tid: self.record(tid) for tid in self.orders}
        effects = effects_by_step(self.external)

        self.say("\ntimeline of the orders hit by a crash, from the audit trail (database time):")
        crashed = sorted(
            {t for c in self.crashes for t in c.task_ids + c.lost_messages},
            key=lambda t: self.orders[t],
        )
        lines: list[Event] = [e for e in self.events if e.crash]
        for tid in crashed:
            for row in history[tid]:
                if row.from_state is None:
                    continue
                reason = (row.reason or "").replace("\n", " ")
                if len(reason) > 70:
                    reason = reason[:67] + "..."
                lines.append(
                    Event(
                        row.at.timestamp(),
                        f"{self.label(tid):9} {row.from_state.value:>10} -> "
                        f"{row.to_state.value:<11} attempt {row.attempt}  {reason}",
                    )
                )
        for e in sorted(lines, key=lambda e: e.at):
            self.say(f"  {e.at - self.t0:6.2f}s  {'*** ' if e.crash else ''}{e.text}")

        self.say(
            "\nrecovery, measured from each kill (running again = back in the queue, then "
            "waiting its turn behind the orders queued before it):"
        )
        recovered: dict[str, list[str]] = {}
        for crash in self.crashes:
            for tid in crash.task_ids + crash.lost_messages:
                rows = [r for r in history[tid] if r.at.timestamp() >= crash.at - 0.01]
                expired = self._first(rows, "TIMEOUT", crash.at)
                queued = self._first(rows, "PENDING", crash.at)
                rerun = self._first(rows, "RUNNING", crash.at)
                lost = tid in crash.lost_messages
                parts = [f"  {crash.label}, {self.label(tid)}:"]
                if lost:
                    parts.append("its prefetched message died with the worker;")
                if expired is not None:
                    parts.append(f"lease expired after {expired:.2f} s,")
                if queued is not None:
                    parts.append(f"back in the queue after {queued:.2f} s,")
                parts.append(
                    f"running again after {rerun:.2f} s" if rerun is not None else "never ran again"
                )
                self.say(" ".join(parts))
                recovered.setdefault(tid, []).append("lost message" if lost else crash.short)
        self.say("")
        header = (
            f"{'task':9} {'final state':12} {'attempts':>8}  "
            f"{'side effects ' + '/'.join(STEPS):30} recovered from"
        )
        self.say(header)
        self.say("-" * len(header))
        succeeded = 0
        exact = 0
        total = 0
        for tid in sorted(self.orders, key=lambda t: self.orders[t]):
            record = records[tid]
            counts = [effects.get((tid, step), 0) for step in STEPS]
            total += len(counts)
            exact += sum(1 for c in counts if c == 1)
            succeeded += record.state.value == "SUCCEEDED"
            self.say(
                f"{self.label(tid):9} {record.state.value:12} {record.attempt:>8}  "
                f"{'/'.join(str(c) for c in counts):30} {', '.join(recovered.get(tid, ['-']))}"
            )
        dropped = sum(w.dropped_deliveries() for w in self.workers)
        self.say(
            f"\nduplicate deliveries dropped at claim without running: {dropped}"
            "\nside effects are counted in external.sqlite3, outside celery-lease's store"
        )
        ok = succeeded == len(self.orders) and exact == total and len(self.crashes) == 2
        verdict = SUMMARY_OK if ok else SUMMARY_FAILED
        self.say(
            f"\n{verdict}: {succeeded}/{len(self.orders)} tasks SUCCEEDED, "
            f"{exact}/{total} side effects ran exactly once, "
            f"{len(recovered)} tasks recovered from {len(self.crashes)} crashes"
        )
        example = next(iter(recovered), next(iter(self.orders)))
        self.say(
            f"\neverything is kept in {self.data_dir}: the store lease.sqlite3, the side "
            "effects external.sqlite3, the worker logs worker1.log and worker2.log (the "
            "project is the module celery_lease.demo.app). To see the row, steps and "
            f"history of {self.label(example)}:\n"
            f"  {DATA_ENV}={self.data_dir} celery -A celery_lease.demo.app lease show {example}"
        )
        return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m celery_lease.demo",
        description=textwrap.dedent(__doc__ or "").split("\n\n")[0],
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path("demo-data"),
        help="where the demo project, the SQLite store and the broker folder go "
        "(default: ./demo-data, emptied first)",
    )
    parser.add_argument("--tasks", type=int, default=8, help="orders to submit (default 8)")
    parser.add_argument(
        "--step-seconds", type=float, default=0.7, help="duration of each step (default 0.7)"
    )
    args = parser.parse_args(argv)
    if os.name != "posix":
        print("the demo sends POSIX signals: run it on Linux or macOS", file=sys.stderr)
        return 2
    if args.tasks < 4:
        parser.error("--tasks must be at least 4 (two crashes need orders to hit)")
    demo = Demo(args.data_dir.resolve(), args.tasks, args.step_seconds, sys.stdout)
    try:
        return demo.run()
    except DemoError as error:
        print(f"\n{SUMMARY_FAILED}: the demo could not complete: {error}", file=sys.stdout)
        return 1


if __name__ == "__main__":
    sys.exit(main())
