"""Real ``celery worker`` subprocesses, each in its own process group, and /proc helpers."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ._polling import wait_until

#: JSON object of ``app.conf`` settings the kit's launcher applies in the worker.
CONF_ENV = "CELERY_LEASE_TESTING_CONF"
#: Directory where the launcher's hooks record which pool process runs which task.
RUNNING_ENV = "CELERY_LEASE_TESTING_RUNNING"


_HAS_PROC = Path("/proc/self/stat").exists()


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgrp) of a process, or ``None`` when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name is in parentheses and may contain spaces
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[2])


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    if not _HAS_PROC:
        # without /proc (macOS): a zombie still counts as alive here
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def pid_state(pid: int) -> str | None:
    """The one-letter /proc state (R, S, T for stopped, Z for zombie...), ``None`` if gone."""
    stat = _proc_stat(pid)
    return None if stat is None else stat[0]


def child_pids(pid: int) -> list[int]:
    """Live direct children of ``pid``."""
    found: set[int] = set()
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                found.update(int(c) for c in (task / "children").read_text().split())
    except FileNotFoundError:
        return []
    return sorted(p for p in found if pid_alive(p))


#: The process name (``/proc/PID/comm``) of a worker's lease agent
#: (``celery_lease.worker.main.agent``): a child of the worker's main process that is
#: not a pool process.
LEASE_AGENT_NAME = "lease-agent"


def _is_lease_agent(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == LEASE_AGENT_NAME
    except OSError:
        return False


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _proc_stat(int(entry.name))
        if stat is not None and stat[2] == pgid and stat[0] not in ("Z", "X"):
            out.append(int(entry.name))
    return sorted(out)


class WorkerProcess:
    """One real ``celery -A <app> worker`` subprocess, in a process group of its own.

    Output (stdout and stderr) goes to ``log_path``, appended at every start. With
    ``conf``, the worker runs through the kit's launcher, which applies those
    ``app.conf`` settings to the app before Celery starts the worker (the test's store,
    broker and queue), and records which pool process runs which task.

    Args:
        app: what ``celery -A`` takes (``"proj"``, ``"proj.celery:app"``).
        cwd: the working directory (also put first on ``PYTHONPATH``).
        log_path: where the output goes.
        env: variables added to a copy of this process's environment.
        pool, concurrency, nodename, queues, loglevel: the worker's options.
        extra_args: more ``celery worker`` arguments.
        conf: ``app.conf`` settings applied in the worker (JSON values).
        pythonpath: more directories for ``PYTHONPATH``.
        python: the interpreter (default: this one).
    """

    READY = re.compile(r" ready\.\s*$", re.MULTILINE)

    def __init__(
        self,
        app: str,
        *,
        cwd: str | os.PathLike[str],
        log_path: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        pool: str = "prefork",
        concurrency: int = 1,
        nodename: str = "w1@lease-test",
        queues: Sequence[str] = (),
        loglevel: str = "INFO",
        extra_args: Sequence[str] = (),
        conf: Mapping[str, Any] | None = None,
        pythonpath: Sequence[str | os.PathLike[str]] = (),
        python: str | None = None,
    ) -> None:
        self.app = app
        self.python = python or sys.executable
        self.cwd = Path(cwd)
        self.log_path = Path(log_path)
        self.env = dict(env or {})
        self.pool = pool
        self.concurrency = concurrency
        self.nodename = nodename
        self.queues = list(queues)
        self.loglevel = loglevel
        self.extra_args = list(extra_args)
        self.conf = None if conf is None else dict(conf)
        self.pythonpath = [str(p) for p in pythonpath]
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._log_offset = 0

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.nodename} pid={self.pid} pool={self.pool}>"

    # -- life cycle -------------------------------------------------------------------

    @property
    def argv(self) -> list[str]:
        """The command line (the kit's launcher takes the same arguments as ``celery``)."""
        entry = ["-m", "celery"] if self.conf is None else ["-m", "celery_lease.testing._launch"]
        return [self.python, *entry, "-A", self.app, *self.command()]

    def command(self) -> list[str]:
        """The ``celery`` command and its options (after ``-A <app>``)."""
        queues = ["-Q", ",".join(self.queues)] if self.queues else []
        return [
            "worker",
            f"--loglevel={self.loglevel}",
            "-P",
            self.pool,
            "-c",
            str(self.concurrency),
            "-n",
            self.nodename,
            *queues,
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            *self.extra_args,
        ]

    def process_env(self) -> dict[str, str]:
        """The environment the worker runs with."""
        env = dict(os.environ)
        # the test process's pytest plumbing must not leak into workers
        for key in ("PYTEST_CURRENT_TEST", "PYTEST_ADDOPTS", "PYTHONWARNINGS"):
            env.pop(key, None)
        path = [str(self.cwd), *self.pythonpath]
        if env.get("PYTHONPATH"):
            path.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(path)
        env["PYTHONUNBUFFERED"] = "1"
        env["C_FORCE_ROOT"] = "1"
        if self.conf is not None:
            env[CONF_ENV] = json.dumps(self.conf)
        env.update(self.env)
        return env

    def start(self) -> WorkerProcess:
        """Start the process (appending to its log); returns ``self``."""
        if self.is_alive():
            raise RuntimeError(f"{self!r} is already running")
        self.starts += 1
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"\n===== start #{self.starts}: {' '.join(self.argv[1:])}\n".encode())
            log.flush()
            self._log_offset = log.tell()
            self.proc = subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                env=self.process_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int | None:
        """The main process's pid (``None`` before the first start)."""
        return None if self.proc is None else self.proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def is_alive(self) -> bool:
        """Whether the main process runs (it may be frozen)."""
        return self.proc is not None and self.proc.poll() is None

    def require_pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self!r} was never started")
        return self.proc.pid

    def wait_log(self, pattern: str, timeout: float = 10.0) -> re.Match[str]:
        """Wait until the current start's log matches the regular expression ``pattern``."""
        regex = re.compile(pattern, re.MULTILINE)
        return wait_until(
            lambda: regex.search(self.log_text(since_start=True)),
            timeout=timeout,
            message=f"{self!r} log never matched {pattern!r}",
        )

    def wait_ready_line(self, timeout: float = 30.0) -> None:
        """Wait for the :attr:`READY` line of the current start (needs INFO logs).

        Raises:
            AssertionError: the process exited first (with its log tail), or the
                timeout passed.
        """

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(
                    f"{self!r} exited with {self.proc.returncode} before it was ready:\n"
                    + self.log_tail()
                )
            return bool(self.READY.search(self.log_text(since_start=True)))

        wait_until(ready, timeout=timeout, message=f"{self!r} never logged {self.READY.pattern!r}")

    # -- signals ----------------------------------------------------------------------

    def signal_main(self, sig: int) -> None:
        """Send ``sig`` to the main process only."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.require_pid(), sig)

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the whole process group (main process and pool processes)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def children(self) -> list[int]:
        """Live pool process pids of the main process (its lease agent left out)."""
        return [p for p in child_pids(self.require_pid()) if not _is_lease_agent(p)]

    def lease_agent(self) -> int | None:
        """The pid of the worker's lease agent (``None``: it has none, or it is gone)."""
        found = [p for p in child_pids(self.require_pid()) if _is_lease_agent(p)]
        return found[0] if found else None

    def wait_children(self, count: int, timeout: float = 15.0) -> list[int]:
        """Wait until the main process has at least ``count`` live children; return them."""

        def enough() -> list[int] | None:
            kids = self.children()
            return kids if len(kids) >= count else None

        return wait_until(
            enough,
            timeout=timeout,
            message=f"{self!r} never had {count} pool processes",
        )

    def group(self) -> list[int]:
        """Live pids of the whole process group (the main process may be gone)."""
        return [] if self.proc is None else group_pids(self.proc.pid)

    def wait_group_gone(self, timeout: float = 15.0) -> None:
        """Wait until the main process is reaped and no process of its group is left."""
        if self.proc is None:
            return
        proc = self.proc
        wait_until(
            lambda: proc.poll() is not None and not self.group(),
            timeout=timeout,
            message=f"{self!r} process group still alive",
        )

    def stop(self, timeout: float = 20.0) -> int | None:
        """Warm shutdown (SIGTERM), wait up to ``timeout``, then SIGKILL the group.

        Returns the main process's exit code (negative: killed by that signal).
        """
        if self.proc is None:
            return None
        self.signal_group(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        self.signal_main(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        self.signal_group(signal.SIGKILL)
        self.proc.wait(10)
        return self.proc.returncode

    def terminate_now(self) -> None:
        """Teardown: SIGKILL the group at once and reap the main process."""
        if self.proc is None:
            return
        self.signal_group(signal.SIGCONT)
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        with contextlib.suppress(AssertionError):
            self.wait_group_gone(timeout=5)

    # -- logs -------------------------------------------------------------------------

    def log_text(self, since_start: bool = False) -> str:
        """The whole log, or only what the current start wrote."""
        try:
            with self.log_path.open("rb") as fh:
                if since_start:
                    fh.seek(self._log_offset)
                return fh.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


class BeatProcess(WorkerProcess):
    """One real ``celery -A <app> beat`` subprocess: a :class:`WorkerProcess` (its own
    process group, log, environment and ``conf``) whose command is beat's.

    Beat keeps its schedule state in ``<log_path>.schedule`` (a file of the test's, not
    ``celerybeat-schedule`` in the working directory). ``pool``, ``concurrency`` and
    ``queues`` do not apply; ``nodename`` only names it in reports.
    """

    READY = re.compile(r"beat: Starting\.\.\.\s*$", re.MULTILINE)

    @property
    def schedule_path(self) -> Path:
        return self.log_path.with_suffix(".schedule")

    def command(self) -> list[str]:
        return [
            "beat",
            f"--loglevel={self.loglevel}",
            f"--schedule={self.schedule_path}",
            *self.extra_args,
        ]
