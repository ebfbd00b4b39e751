"""``LeaseWorker``: a real worker of the user's app, on the test's store, with its levers."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..records import TaskRecord
from ..states import State
from ..store import Store
from ._crash import CrashPoints
from ._polling import wait_until
from ._pool import PREFORK
from ._procs import RUNNING_ENV, WorkerProcess, pid_alive, pid_state

#: States after which a task never moves again without an operator.
SETTLED = frozenset({State.SUCCEEDED, State.FAILED, State.CANCELLED, State.WAIT_MANUAL})


def _task_id(task: Any) -> str:
    """A task id from an ``AsyncResult`` (or anything with ``.id``) or an id string."""
    value = getattr(task, "id", task)
    if not isinstance(value, str) or not value:
        raise TypeError(f"expected an AsyncResult or a task id, got {task!r}")
    return value


class LeaseWorker(WorkerProcess):
    """A ``celery -A <app> worker`` subprocess of the user's app on the test's store.

    Started through the kit's launcher: the test's settings (store, broker, queue,
    short timings) are applied to the app in the worker, crash points armed in
    :attr:`crash` reach it, and it records which pool process runs which task.
    ``pool="prefork"`` (the default) is Celery's prefork pool checking for dead pool
    processes every 0.5 s instead of every 5 s (:mod:`celery_lease.testing._pool`).

    Args:
        app: what ``celery -A`` takes.
        store: the test's store (the worker's ``lease_database_url`` points at it).
        crash: the test's armed crash points.
        run_dir: where its log and bookkeeping go.
        conf: the ``app.conf`` settings applied in the worker.
        **options: :class:`WorkerProcess` options (pool, concurrency, nodename, env, ...).
    """

    def __init__(
        self,
        app: str,
        *,
        store: Store,
        crash: CrashPoints,
        run_dir: str | os.PathLike[str],
        conf: Mapping[str, Any],
        cwd: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        **options: Any,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.running_dir = self.run_dir / "running"
        self.running_dir.mkdir(parents=True, exist_ok=True)
        self.store = store
        self.crash = crash
        super().__init__(
            app,
            cwd=cwd if cwd is not None else Path.cwd(),
            log_path=self.run_dir / "worker.log",
            env={
                **crash.env,
                RUNNING_ENV: str(self.running_dir),
                "CELERY_CUSTOM_WORKER_POOL": PREFORK,
                **(env or {}),
            },
            conf=conf,
            **options,
        )

    @property
    def argv(self) -> list[str]:
        argv = super().argv
        if self.pool == "prefork":
            # Celery's command line takes a pool class only as "custom"
            argv[argv.index("-P") + 1] = "custom"
        return argv

    # -- start, stop, restart ---------------------------------------------------------

    def wait_ready(self, timeout: float = 60.0) -> LeaseWorker:
        """Wait for the ``ready.`` line and this start's live row in the workers table."""
        self.wait_ready_line(timeout)
        pid = self.require_pid()

        def registered() -> bool:
            return any(
                w.nodename == self.nodename and w.pid == pid and w.stopped_at is None
                for w in self.store.workers()
            )

        wait_until(
            registered, timeout=timeout, message=f"{self!r} has no live row in the workers table"
        )
        return self

    def incarnation(self) -> str:
        """The id of this start's row in the workers table (a fresh one per start)."""
        pid = self.require_pid()
        for w in self.store.workers():
            if w.nodename == self.nodename and w.pid == pid:
                return w.id
        raise AssertionError(f"{self!r} has no row in the workers table")

    def restart(self, timeout: float = 60.0) -> LeaseWorker:
        """Start again under the same node name (after :meth:`kill`, or killing it first).

        The new start expires the leases of its dead predecessor at once: the fast
        path a supervisor restarting a crashed worker takes.
        """
        if self.is_alive():
            self.kill()
        self.signal_group(signal.SIGKILL)
        self.wait_group_gone(timeout=timeout)
        self.start()
        return self.wait_ready(timeout)

    # -- crashes ----------------------------------------------------------------------

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Kill the whole worker (main process and every pool process) and wait until it
        is gone: a node lost at once, nothing flushed."""
        self.signal_group(signal.SIGCONT)
        self.signal_group(sig)
        if sig == signal.SIGKILL:
            self.wait_group_gone()

    def task_pid(self, task: Any, timeout: float = 30.0) -> int:
        """Wait until a live pool process of this worker runs ``task`` (claimed: its row
        is RUNNING); return that process's pid."""
        task_id = _task_id(task)
        path = self.running_dir / task_id
        main = self.require_pid()

        def running() -> int | None:
            if not self.is_alive():
                raise AssertionError(f"{self!r} exited:\n{self.log_tail()}")
            try:
                pid = int(path.read_text())
            except (FileNotFoundError, ValueError):
                return None
            record = self.store.get(task_id)
            if record is None or record.state is not State.RUNNING or not pid_alive(pid):
                return None
            return pid if pid == main or pid in self.children() else None

        return wait_until(running, timeout=timeout, message=f"{task_id} never ran on {self!r}")

    def kill_task(self, task: Any, sig: int = signal.SIGKILL, timeout: float = 30.0) -> int:
        """SIGKILL the pool process running ``task`` (wait until it runs, then until the
        process is gone); return its pid.

        With the ``solo`` or ``threads`` pool the task runs in the main process: this
        kills the whole worker.
        """
        pid = self.task_pid(task, timeout)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        if pid == self.pid:
            self.kill(sig)
        elif sig == signal.SIGKILL:
            wait_until(lambda: not pid_alive(pid), timeout=10, message=f"pid {pid} survived")
        return pid

    def freeze(self) -> None:
        """SIGSTOP the whole worker: alive to the kernel, silent to everyone else."""
        self.signal_group(signal.SIGSTOP)
        self.require_pid()
        wait_until(
            lambda: all(pid_state(p) == "T" for p in self.group()),
            timeout=10,
            message=f"{self!r} never froze",
        )

    def thaw(self) -> None:
        """SIGCONT the whole worker after :meth:`freeze`."""
        self.signal_group(signal.SIGCONT)

    # -- the store, as the test sees it ------------------------------------------------

    def record(self, task: Any) -> TaskRecord:
        """The task's row now."""
        task_id = _task_id(task)
        record = self.store.get(task_id)
        if record is None:
            raise AssertionError(f"task {task_id} has no row in the store")
        return record

    def wait_state(
        self,
        task: Any,
        *states: State | str,
        timeout: float = 60.0,
        restart: bool = False,
    ) -> TaskRecord:
        """Wait until the task's row is in one of ``states`` (default: any settled state:
        SUCCEEDED, FAILED, CANCELLED, WAIT_MANUAL); return its record, read from the store.

        With ``restart``, a worker found dead meanwhile (a crash point in a ``solo``
        pool, say) is restarted under the same node name, as a supervisor would.

        Raises:
            AssertionError: the timeout passed (with the row and the log tail).
        """
        task_id = _task_id(task)
        wanted = frozenset(State(s) for s in states) if states else SETTLED
        last: list[TaskRecord | None] = [None]

        def reached() -> TaskRecord | None:
            record = last[0] = self.store.get(task_id)
            if record is not None and record.state in wanted:
                return record
            if restart and not self.is_alive():
                self.restart()
            return None

        try:
            return wait_until(reached, timeout=timeout, interval=0.05)
        except AssertionError:
            names = ", ".join(sorted(s.value for s in wanted))
            raise AssertionError(
                f"task {task_id} never reached {names} within {timeout:g} s; its row: "
                f"{last[0]!r}\n--- {self.nodename} log (tail) ---\n{self.log_tail(30)}"
            ) from None


def log_report(workers: Sequence[WorkerProcess], lines: int = 60) -> str:
    """The tail of each worker's log, for a failing test's report."""
    parts = []
    for w in workers:
        parts.append(
            f"--- {w.nodename} (pid {w.pid}, exit {w.returncode}) {w.log_path} "
            f"(last {lines} lines) ---\n{w.log_tail(lines)}"
        )
    return "\n".join(parts)
