"""``python -m celery_lease.demo``: watch celery-lease recover from real crashes.

Needs no server: the store is a SQLite file and the broker is kombu's filesystem
transport, both in a data directory (``./demo-data`` by default). The demo writes a
small Celery project there, starts a real ``celery worker`` (prefork, two pool
processes), submits orders that each run three steps with a real side effect, then

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
import importlib.util
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from ._runtime import runtime
from .admin import Admin, admin
from .records import TaskRecord, TransitionRecord

T = TypeVar("T")

STEPS = ("reserve", "charge", "ship")
NODENAME = "demo@%h"
MARKER = ".celery-lease-demo"
SUMMARY_OK = "OK"
SUMMARY_FAILED = "FAILED"

APP_TEMPLATE = '''\
"""A small Celery project written by `python -m celery_lease.demo` (safe to delete).

Broker: kombu's filesystem transport (a folder). Store: a SQLite file. No server.
"""

import os
import sqlite3
import time
from pathlib import Path

from celery import Celery

from celery_lease import LeasedTask

HERE = Path(__file__).resolve().parent
EXTERNAL = HERE / "external.sqlite3"  # stands in for a payment API, a mailer, ...
STEP_SECONDS = {step_seconds!r}

app = Celery("demo_app", broker="filesystem://localhost/")
app.conf.update(
    broker_transport_options={{
        "data_folder_in": str(HERE / "broker"),
        "data_folder_out": str(HERE / "broker"),
        "polling_interval": 0.05,
    }},
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    # Celery waits this long (default 10 s) before reporting a dead pool process, in case
    # it sent its result first; the outcome is in the lease store, so nothing is lost.
    worker_lost_wait=1,
    # celery-lease, with short timings so that the demo is quick
    lease_database_url=f"sqlite:///{{HERE / 'lease.sqlite3'}}",
    lease_ttl=3,  # default 30
    lease_heartbeat_interval=0.5,  # default 5
    lease_reaper_interval=0.5,  # default 5
    lease_republish_after=4,  # default 60
    lease_publish_grace=1,  # default 10
    lease_beat_reaper=False,  # no beat here: each worker's embedded reaper sweeps
)


def external(sql, params=()):
    conn = sqlite3.connect(EXTERNAL, timeout=30, isolation_level=None)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def perform(task_id, step):
    """One step's real side effect: slow work, then one row in the external system."""
    time.sleep(STEP_SECONDS)
    external(
        "INSERT INTO effects (task_id, step, pid, at) VALUES (?, ?, ?, ?)",
        (task_id, step, os.getpid(), time.time()),
    )
    return f"{{step}}: done"


def already_performed(task_id, step):
    """Asked on a re-run when a crash hit this step: did the effect happen?"""
    rows = external("SELECT 1 FROM effects WHERE task_id = ? AND step = ?", (task_id, step))
    return f"{{step}}: done" if rows else None  # None: it did not, run it


@app.task(base=LeasedTask, bind=True, name="demo.process_order")
def process_order(self, order):
    # demo instrumentation: tells the demo which process to kill
    external(
        "INSERT INTO runs (task_id, pid, at) VALUES (?, ?, ?)",
        (self.request.id, os.getpid(), time.time()),
    )
    for step in {steps!r}:
        self.step(step, perform, self.request.id, step, check=already_performed)
    return f"order {{order}} done"
'''

EXTERNAL_SCHEMA = """
CREATE TABLE IF NOT EXISTS effects (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id TEXT NOT NULL, step TEXT NOT NULL, pid INTEGER NOT NULL, at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id TEXT NOT NULL, pid INTEGER NOT NULL, at REAL NOT NULL
);
"""


class DemoError(Exception):
    """The demo could not do what it set out to do (not a celery-lease verdict)."""


# -- small helpers --------------------------------------------------------------------------


def wait_for(
    predicate: Callable[[], T | None], timeout: float, what: str, interval: float = 0.05
) -> T:
    """Poll ``predicate`` until it returns something truthy; ``DemoError`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise DemoError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat[stat.rindex(")") + 2] not in "ZX"


class External:
    """The demo's stand-in for an external system: counts every real side effect."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        try:
            yield conn
        finally:
            conn.close()

    def create(self) -> None:
        with self._connect() as conn:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(EXTERNAL_SCHEMA)

    def effects(self) -> dict[tuple[str, str], int]:
        """(task id, step) -> how many times the side effect really happened."""
        with self._connect() as conn:
            rows = conn.execute(
                "SELECT task_id, step, count(*) FROM effects GROUP BY task_id, step"
            ).fetchall()
        return {(str(r[0]), str(r[1])): int(r[2]) for r in rows}

    def effect_count(self, task_id: str) -> int:
        with self._connect() as conn:
            row = conn.execute("SELECT count(*) FROM effects WHERE task_id = ?", (task_id,))
            return int(row.fetchone()[0])

    def last_run(self, task_id: str) -> tuple[int, float] | None:
        """(pid, start time) of the latest execution of ``task_id``."""
        with self._connect() as conn:
            row = conn.execute(
                "SELECT pid, at FROM runs WHERE task_id = ? ORDER BY id DESC LIMIT 1", (task_id,)
            ).fetchone()
        return None if row is None else (int(row[0]), float(row[1]))

    def last_effect_at(self, task_id: str) -> float | None:
        with self._connect() as conn:
            row = conn.execute("SELECT max(at) FROM effects WHERE task_id = ?", (task_id,))
            value = row.fetchone()[0]
        return None if value is None else float(value)


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


class Worker:
    """A real ``celery worker`` subprocess in its own process group."""

    def __init__(self, number: int, data_dir: Path, env: dict[str, str]) -> None:
        self.number = number
        self.log_path = data_dir / f"worker{number}.log"
        self._log = self.log_path.open("wb")
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "demo_app",
            "worker",
            "--pool=prefork",
            "--concurrency=2",
            f"--hostname={NODENAME}",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "--loglevel=INFO",
        ]
        self.started_at = time.time()
        self.proc = subprocess.Popen(
            cmd,
            cwd=data_dir,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: one killpg hits main + pool
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def request_stop(self) -> None:
        """Ask for a warm shutdown (SIGTERM to the main process) without waiting."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 15.0) -> None:
        """Warm shutdown (SIGTERM), SIGKILL if it does not finish in time."""
        if self.proc.poll() is None:
            self.request_stop()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill_group()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # stray pool children, if any
        self._log.close()

    def log_tail(self, lines: int = 25) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def dropped_deliveries(self) -> int:
        """Deliveries the worker dropped at claim without running them (duplicates)."""
        text = self.log_path.read_text(errors="replace")
        return text.count("delivery dropped without running")


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
        self.external = External(data_dir / "external.sqlite3")
        self.app: Any = None  # the generated project's Celery app and task
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
        source = APP_TEMPLATE.format(step_seconds=self.step_seconds, steps=STEPS)
        (data / "demo_app.py").write_text(source)
        self.external.create()
        spec = importlib.util.spec_from_file_location("demo_app", data / "demo_app.py")
        if spec is None or spec.loader is None:
            raise DemoError("cannot load the generated demo_app.py")
        module: ModuleType = importlib.util.module_from_spec(spec)
        sys.modules["demo_app"] = module
        spec.loader.exec_module(module)
        self.app = module.app
        self.task = module.process_order
        self._admin = admin(self.app)
        runtime(self.app).store.migrate()

    def worker_env(self) -> dict[str, str]:
        env = dict(os.environ)
        paths = [str(self.data_dir)]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        return env

    def start_worker(self) -> Worker:
        number = len(self.workers) + 1
        known = {w.id for w in self.admin.workers()}
        worker = Worker(number, self.data_dir, self.worker_env())
        self.workers.append(worker)

        def registered() -> Any:
            if worker.proc.poll() is not None:
                raise DemoError(
                    f"worker {number} exited with status {worker.proc.returncode}:\n"
                    + worker.log_tail()
                )
            fresh = [w for w in self.admin.workers() if w.id not in known and w.alive]
            return fresh[0] if fresh else None

        record = wait_for(registered, 60, f"worker {number} to start")
        self.note(
            f"worker {number} started: node {record.nodename}, pid {worker.pid} "
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
                run = self.external.last_run(tid)
                done_at = self.external.last_effect_at(tid)
                if run is None or done_at is None or not pid_alive(run[0]):
                    continue
                # first step's effect happened in this run and the second step is under way
                if (
                    self.external.effect_count(tid) == 1
                    and done_at > run[1]
                    and time.time() - done_at >= self.step_seconds * 0.4
                ):
                    return tid, run[0]
            return None

        task_id, pid = wait_for(victim, 30, "an order in the middle of a step")
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
        wait_for(
            lambda: any(r.to_state.value == "PENDING" for r in self.admin.history(task_id)[1:]),
            30,
            f"{self.label(task_id)} to be recovered",
        )

    def kill_worker(self, worker: Worker) -> None:
        """SIGKILL the worker's whole process group while two orders run."""

        def busy() -> list[str] | None:
            running = []
            for tid in self.running():
                run = self.external.last_run(tid)
                # a live pool process well inside a step, not just claiming
                if (
                    run is not None
                    and pid_alive(run[0])
                    and time.time() - run[1] >= self.step_seconds * 0.5
                ):
                    running.append(tid)
            return running if len(running) >= 2 else None

        running = wait_for(busy, 30, "two orders running at once")
        os.killpg(worker.pid, signal.SIGKILL)
        at = time.time()
        worker.proc.wait(timeout=10)
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
            f"SIGKILL worker {worker.number}'s process group (main process {worker.pid} "
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
            wait_for(self.all_finished, 60, "every order to finish", interval=0.1)
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
        effects = self.external.effects()

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
            f"\neverything is kept in {self.data_dir}: the project demo_app.py, the store "
            "lease.sqlite3, the worker logs worker1.log and worker2.log. To see the row, "
            f"steps and history of {self.label(example)}:\n"
            f"  cd {self.data_dir} && celery -A demo_app lease show {example}"
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
