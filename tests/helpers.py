"""Test harness shared by every suite (importable from generated worker modules too).

- :func:`wait_until`: poll a predicate against a deadline (never a bare ``sleep``).
- :class:`ExternalSystem`: a counting stub of an external API, shared across processes.
- :class:`WorkerProject` / :class:`WorkerProcess`: a generated Celery project module and
  real ``celery worker`` subprocesses started from it.
- :func:`lease_settings`, :func:`check_audit`: lease-specific conveniences.

Worker subprocesses get the repository root on ``PYTHONPATH``, so a generated module
can ``from tests.helpers import ExternalSystem``.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib.util
import itertools
import os
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from celery import _state

if TYPE_CHECKING:
    from celery import Celery

    from celery_lease.config import LeaseConfig
    from celery_lease.store import Store

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parent.parent

#: Environment variable a generated worker module reads to find the external stub.
EXTERNAL_ENV = "CELERY_LEASE_TEST_EXTERNAL"
#: Environment variables ``TEST_CONF_<KEY>=value`` set ``app.conf.<key> = "value"`` in a
#: generated module (strings: ``lease_*`` settings are coerced by celery_lease.config).
CONF_ENV_PREFIX = "TEST_CONF_"


# -- polling ------------------------------------------------------------------------------


def wait_until(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    interval: float = 0.05,
    message: str = "condition not met",
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Call ``predicate`` until it returns a truthy value, and return that value.

    Raises :class:`AssertionError` naming ``message``, the timeout and the last value
    (or the last ignored exception) when ``timeout`` seconds pass first. Exceptions
    listed in ``ignore`` count as "not yet"; any other exception propagates at once.
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = predicate()
        except ignore as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"{message} (waited {timeout:g} s; last value: {last!r})")
        time.sleep(interval)


def wait_step(
    store: Store, task_id: str, name: str, state: str = "DONE", timeout: float = 30.0
) -> None:
    """Wait until the store records step ``name`` of ``task_id`` in ``state``.

    A test that kills, freezes or expires a task "after step X" waits for this, never
    for the step's side effect (a counter, a log line, a file): the effect happens
    before the step is recorded, and a kill in between is a different crash point
    (outcome unknown) with a different, correct, outcome.
    """
    wait_until(
        lambda: any(s.name == name and s.state == state for s in store.steps(task_id)),
        timeout=timeout,
        message=f"step {name!r} of task {task_id} recorded {state}",
    )


# -- the counting stub of an external system ----------------------------------------------


@dataclasses.dataclass(frozen=True)
class Effect:
    """One real effect the external system performed."""

    id: int
    name: str
    key: str | None
    payload: str | None
    pid: int


class ExternalSystem:
    """A stand-in for a payment API, mailer or upload target, outside every worker.

    State lives in a SQLite file, so calls from any process (pool children, other
    workers, the test) are counted together, and an effect committed before a SIGKILL
    stays counted, as it would in a real remote system.

    ``call(name, key)`` performs one effect and returns its id. A call repeating an
    idempotency ``key`` already used for ``name`` performs nothing new and returns the
    first effect's id (what an API that deduplicates on a key does). ``count(name)``
    is the number of real effects; ``calls(name)`` counts every call, deduplicated or not.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        with self._connect() as conn:
            conn.executescript(
                """
                CREATE TABLE IF NOT EXISTS effects (
                    id INTEGER PRIMARY KEY AUTOINCREMENT,
                    name TEXT NOT NULL,
                    key TEXT,
                    payload TEXT,
                    pid INTEGER NOT NULL,
                    UNIQUE (name, key)
                );
                CREATE TABLE IF NOT EXISTS calls (
                    id INTEGER PRIMARY KEY AUTOINCREMENT,
                    name TEXT NOT NULL,
                    key TEXT,
                    effect_id INTEGER NOT NULL,
                    deduplicated INTEGER NOT NULL,
                    pid INTEGER NOT NULL
                );
                """
            )

    @classmethod
    def from_env(cls) -> ExternalSystem:
        """The stub a test handed to this worker process (via ``CELERY_LEASE_TEST_EXTERNAL``)."""
        try:
            return cls(os.environ[EXTERNAL_ENV])
        except KeyError:
            raise RuntimeError(
                f"{EXTERNAL_ENV} is not set: start the worker via WorkerProject"
            ) from None

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        # a connection per call: safe across fork, and nothing stays open in a killed child
        conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            yield conn
        finally:
            conn.close()

    def call(self, name: str, key: str | None = None, payload: Any = None) -> int:
        """Perform one effect (or replay the one recorded under ``key``); return its id."""
        text = None if payload is None else str(payload)
        pid = os.getpid()
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                existing = None
                if key is not None:
                    existing = conn.execute(
                        "SELECT id FROM effects WHERE name = ? AND key = ?", (name, key)
                    ).fetchone()
                if existing is not None:
                    effect_id, deduplicated = int(existing[0]), 1
                else:
                    cur = conn.execute(
                        "INSERT INTO effects (name, key, payload, pid) VALUES (?, ?, ?, ?)",
                        (name, key, text, pid),
                    )
                    effect_id, deduplicated = int(cur.lastrowid or 0), 0
                conn.execute(
                    "INSERT INTO calls (name, key, effect_id, deduplicated, pid)"
                    " VALUES (?, ?, ?, ?, ?)",
                    (name, key, effect_id, deduplicated, pid),
                )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return effect_id

    def count(self, name: str | None = None) -> int:
        """Real effects performed (for ``name``, or in all)."""
        return self._scalar("effects", name)

    def calls(self, name: str | None = None) -> int:
        """Calls received, including those answered from an idempotency key."""
        return self._scalar("calls", name)

    def effects(self, name: str | None = None) -> list[Effect]:
        """The real effects, oldest first."""
        query = "SELECT id, name, key, payload, pid FROM effects"
        params: tuple[Any, ...] = ()
        if name is not None:
            query += " WHERE name = ?"
            params = (name,)
        with self._connect() as conn:
            rows = conn.execute(query + " ORDER BY id", params).fetchall()
        return [Effect(int(r[0]), r[1], r[2], r[3], int(r[4])) for r in rows]

    def _scalar(self, table: str, name: str | None) -> int:
        query = f"SELECT count(*) FROM {table}"
        params: tuple[Any, ...] = ()
        if name is not None:
            query += " WHERE name = ?"
            params = (name,)
        with self._connect() as conn:
            return int(conn.execute(query, params).fetchone()[0])


# -- lease conveniences -------------------------------------------------------------------


def lease_settings(config: LeaseConfig) -> dict[str, Any]:
    """The ``app.conf`` settings (``lease_*`` keys) that reproduce ``config`` in a worker."""
    from celery_lease.config import SETTINGS

    out: dict[str, Any] = {}
    for key in SETTINGS:
        out[key] = getattr(config, key.removeprefix("lease_"))
    return out


def check_audit(store: Store, task_ids: Iterable[str] | None = None) -> int:
    """Assert the audit trail of every task (or of ``task_ids``) is consistent.

    Every row is a legal transition, the first creates the row (``None -> PENDING``),
    each row starts where the previous one ended, attempts never decrease, and the
    task's current state is the last row's ``to_state``. Returns how many tasks were checked.
    """
    from celery_lease import states

    ids = (
        list(task_ids) if task_ids is not None else [r.id for r in store.list_tasks(limit=100_000)]
    )
    for task_id in ids:
        record = store.get(task_id)
        assert record is not None, f"task {task_id} has no row"
        trail = store.history(task_id)
        assert trail, f"task {task_id} has no audit rows"
        assert trail[0].from_state is None and trail[0].to_state is states.State.PENDING, trail[0]
        for prev, row in itertools.pairwise(trail):
            assert row.from_state is prev.to_state, f"{task_id}: audit gap {prev} -> {row}"
            assert row.attempt >= prev.attempt, f"{task_id}: attempt went back in {row}"
        for row in trail:
            assert states.is_legal(row.from_state, row.to_state), (
                f"{task_id}: illegal audit row {row}"
            )
            assert row.actor, f"{task_id}: audit row without actor {row}"
        assert record.state is trail[-1].to_state, (
            f"task {task_id} is {record.state} but its last audit row says {trail[-1].to_state}"
        )
    return len(ids)


# -- process helpers ----------------------------------------------------------------------


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


# -- generated Celery projects and real worker subprocesses -------------------------------

_MODULE_TEMPLATE = '''\
"""Generated by tests.helpers.WorkerProject for one test: do not edit."""
import os

from celery import Celery

app = Celery("proj", broker={broker_url!r}, set_as_current=True)
app.conf.update(
    task_default_queue={queue!r},
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=True,
)
app.conf.update({settings!r})
_app_task = app.task


def _task(*args, **opts):
    # not shared: a shared task is added to every app created later in the same process,
    # so projects loaded one after another in the test process would collide by name
    opts.setdefault("shared", False)
    return _app_task(*args, **opts)


app.task = _task
for _key, _value in os.environ.items():
    if _key.startswith({prefix!r}):
        app.conf[_key[len({prefix!r}):].lower()] = _value

# ---- the test's source ----
{source}
'''


def _check_literal(name: str, value: Any) -> None:
    try:
        same = ast.literal_eval(repr(value)) == value
    except (ValueError, SyntaxError):
        same = False
    if not same:
        raise TypeError(f"setting {name}={value!r} is not a Python literal a module can hold")


class WorkerProject:
    """A Celery project module written into a test's ``tmp_path``.

    The module defines ``app = Celery("proj", broker=broker_url)`` with
    ``task_default_queue = queue``, applies ``settings`` (Python literals), then
    ``TEST_CONF_<KEY>`` environment variables, then runs ``source`` (the test's tasks).
    Use :meth:`worker` to start real ``celery worker`` processes from it, and
    :meth:`producer` / :meth:`load` to send tasks from the test process.
    """

    def __init__(
        self,
        directory: Path,
        *,
        broker_url: str,
        queue: str,
        source: str,
        settings: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        module: str | None = None,
        registry: ProcessRegistry | None = None,
        python: str | None = None,
    ) -> None:
        #: The interpreter of its workers. Another one (a virtualenv with celery-lease
        #: installed from its wheel) imports what it has installed: neither this checkout
        #: nor the test process's PYTHONPATH is on its path.
        self.python = python
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.broker_url = broker_url
        self.queue = queue
        self.settings = dict(settings or {})
        for key, value in self.settings.items():
            _check_literal(key, value)
        self.env = dict(env or {})
        self.module = module or f"proj_{uuid.uuid4().hex[:8]}"
        self.registry = registry if registry is not None else ProcessRegistry()
        self.path = self.directory / f"{self.module}.py"
        self.path.write_text(
            _MODULE_TEMPLATE.format(
                broker_url=broker_url,
                queue=queue,
                settings=self.settings,
                prefix=CONF_ENV_PREFIX,
                source=textwrap.dedent(source).strip() + "\n",
            )
        )
        self._loaded: ModuleType | None = None

    def process_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment a worker of this project runs with."""
        env = dict(os.environ)
        # the test process's pytest/coverage plumbing must not leak into workers
        for key in ("PYTEST_CURRENT_TEST", "PYTEST_ADDOPTS", "PYTHONWARNINGS"):
            env.pop(key, None)
        path = [str(self.directory)]
        if self.python is None:
            path.append(str(REPO_ROOT))
            if env.get("PYTHONPATH"):
                path.append(env["PYTHONPATH"])
        else:
            env.pop("VIRTUAL_ENV", None)
        env["PYTHONPATH"] = os.pathsep.join(path)
        env["PYTHONUNBUFFERED"] = "1"
        env["C_FORCE_ROOT"] = "1"
        env.update(self.env)
        env.update(extra or {})
        return env

    def worker(
        self,
        name: str = "w1",
        *,
        pool: str = "prefork",
        concurrency: int = 1,
        nodename: str | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        start: bool = True,
    ) -> WorkerProcess:
        """A worker process of this project (started unless ``start=False``)."""
        proc = WorkerProcess(
            self,
            name=name,
            pool=pool,
            concurrency=concurrency,
            nodename=nodename,
            extra_args=extra_args,
            env=env,
        )
        self.registry.workers.append(proc)
        if start:
            proc.start()
        return proc

    def producer(self) -> Celery:
        """A bare Celery app on the same broker and queue, to ``send_task`` by name."""
        from celery import Celery

        app = Celery("producer", broker=self.broker_url, set_as_current=False)
        app.conf.update(task_default_queue=self.queue, broker_connection_retry_on_startup=True)
        self.registry.apps.append(app)
        return app

    def load(self) -> ModuleType:
        """Import the generated module in the test process (same module name as in the
        workers, so task names agree), with the project's environment variables set
        while it runs; its app is closed at teardown."""
        if self._loaded is None:
            spec = importlib.util.spec_from_file_location(self.module, self.path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[self.module] = module
            # the module's app becomes the current app: give the old one back at teardown
            self.registry.current_apps.append(_state.get_current_app())
            saved = dict(os.environ)
            # module-level code sees the same environment as in a worker
            os.environ.update(self.env)
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(self.module, None)
                raise
            finally:
                os.environ.clear()
                os.environ.update(saved)
            self._loaded = module
            self.registry.apps.append(module.app)
            self.registry.modules.append(self.module)
        return self._loaded


class WorkerProcess:
    """One real ``celery -A <module> worker`` subprocess (its own process group).

    Output goes to ``<project dir>/<name>.log``; when a test fails, the harness appends
    the tail of every worker's log to the failure report.
    """

    READY = re.compile(r" ready\.\s*$", re.MULTILINE)

    def __init__(
        self,
        project: WorkerProject,
        *,
        name: str,
        pool: str,
        concurrency: int,
        nodename: str | None,
        extra_args: Sequence[str],
        env: Mapping[str, str] | None,
    ) -> None:
        self.project = project
        self.name = name
        self.pool = pool
        self.concurrency = concurrency
        self.nodename = nodename or f"{name}@lease-test"
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        self.log_path = project.directory / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0
        self.starts = 0

    def __repr__(self) -> str:
        return f"<WorkerProcess {self.nodename} pid={self.pid} pool={self.pool}>"

    # -- life cycle -------------------------------------------------------------------

    @property
    def argv(self) -> list[str]:
        return [
            self.project.python or sys.executable,
            "-m",
            "celery",
            "-A",
            self.project.module,
            "worker",
            "--loglevel=INFO",
            "-P",
            self.pool,
            "-c",
            str(self.concurrency),
            "-n",
            self.nodename,
            "-Q",
            self.project.queue,
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            *self.extra_args,
        ]

    def start(self) -> WorkerProcess:
        """Start the process (appending to its log); returns ``self``."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self!r} is already running")
        self.starts += 1
        with self.log_path.open("ab") as log:
            header = f"\n===== start #{self.starts}: {' '.join(self.argv[1:])}\n"
            log.write(header.encode())
            log.flush()
            self._log_offset = log.tell()
            self.proc = subprocess.Popen(
                self.argv,
                cwd=self.project.directory,
                env=self.project.process_env(self.env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def restart(self, *, timeout: float = 30.0) -> WorkerProcess:
        """Start again with the same options and node name (after a stop or kill)."""
        if self.proc is not None and self.proc.poll() is None:
            self.stop()
        self.kill_group(signal.SIGKILL)
        self.wait_group_gone(timeout=timeout)
        return self.start()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _require_pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self!r} was never started")
        return self.proc.pid

    def wait_ready(self, timeout: float = 30.0, store: Store | None = None) -> WorkerProcess:
        """Wait for the ``<nodename> ready.`` log line of the current start; with ``store``,
        also for a live incarnation row of this node name and main pid in its workers
        table. Raises AssertionError (with the log tail) if the process exits first."""

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(
                    f"{self!r} exited with {self.proc.returncode} before it was ready:\n"
                    + self.log_tail()
                )
            return bool(self.READY.search(self.log_text(since_start=True)))

        wait_until(ready, timeout=timeout, interval=0.05, message=f"{self!r} never logged 'ready'")
        if store is not None:
            pid = self._require_pid()

            def registered() -> bool:
                return any(
                    w.nodename == self.nodename and w.pid == pid and w.stopped_at is None
                    for w in store.workers()
                )

            wait_until(
                registered,
                timeout=timeout,
                message=f"{self!r} has no live row in the lease workers table",
            )
        return self

    def wait_log(self, pattern: str, timeout: float = 10.0) -> re.Match[str]:
        """Wait until the current start's log matches the regular expression ``pattern``."""
        regex = re.compile(pattern, re.MULTILINE)
        return wait_until(
            lambda: regex.search(self.log_text(since_start=True)),
            timeout=timeout,
            message=f"{self!r} log never matched {pattern!r}",
        )

    # -- signals ----------------------------------------------------------------------

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the main process only."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._require_pid(), sig)

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the whole process group (main process and pool children)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def children(self) -> list[int]:
        """Live pool child pids of the main process."""
        return child_pids(self._require_pid())

    def wait_children(self, count: int, timeout: float = 15.0) -> list[int]:
        """Wait until the main process has at least ``count`` live children; return them."""
        return wait_until(
            lambda: (kids := self.children()) and len(kids) >= count and kids,
            timeout=timeout,
            message=f"{self!r} never had {count} pool children",
        )

    def group(self) -> list[int]:
        """Live pids of the whole process group (the main process may be gone)."""
        return [] if self.proc is None else group_pids(self.proc.pid)

    def wait_group_gone(self, timeout: float = 15.0) -> None:
        if self.proc is None:
            return
        wait_until(
            lambda: self.proc is not None and self.proc.poll() is not None and not self.group(),
            timeout=timeout,
            message=f"{self!r} process group still alive",
        )

    def stop(self, timeout: float = 20.0) -> int | None:
        """Warm shutdown (SIGTERM), wait up to ``timeout``, then SIGKILL the group.

        Returns the main process's exit code (negative: killed by that signal).
        """
        if self.proc is None:
            return None
        self.kill_group(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        self.kill(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        self.kill_group(signal.SIGKILL)
        self.proc.wait(10)
        return self.proc.returncode

    def terminate_now(self) -> None:
        """Teardown: SIGKILL the group at once and reap the main process."""
        if self.proc is None:
            return
        self.kill_group(signal.SIGCONT)
        self.kill_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        with contextlib.suppress(AssertionError):
            self.wait_group_gone(timeout=5)

    # -- logs -------------------------------------------------------------------------

    def log_text(self, since_start: bool = False) -> str:
        try:
            with self.log_path.open("rb") as fh:
                if since_start:
                    fh.seek(self._log_offset)
                return fh.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


@dataclasses.dataclass
class ProcessRegistry:
    """What one test started, for teardown and failure reports."""

    workers: list[WorkerProcess] = dataclasses.field(default_factory=list)
    apps: list[Any] = dataclasses.field(default_factory=list)
    modules: list[str] = dataclasses.field(default_factory=list)
    #: the current Celery app before each load(), restored at close
    current_apps: list[Any] = dataclasses.field(default_factory=list)

    def close(self) -> None:
        for proc in self.workers:
            proc.terminate_now()
        for app in self.apps:
            with contextlib.suppress(Exception):
                app.close()
        for name in self.modules:
            sys.modules.pop(name, None)
        if self.current_apps:
            self.current_apps[0].set_current()
            self.current_apps.clear()

    def failure_report(self, lines: int = 60) -> str:
        parts = []
        for proc in self.workers:
            parts.append(
                f"--- {proc.nodename} (pid {proc.pid}, exit {proc.returncode}) "
                f"{proc.log_path} (last {lines} lines) ---\n{proc.log_tail(lines)}"
            )
        return "\n".join(parts)


# -- code run in spawned processes (must be importable: module level) ---------------------


def submit_in_process(config: Any, new: Any, barrier: Any, results: Any) -> None:
    """Child process: submit ``new`` once every child is ready; report (id, created)."""
    from celery_lease.store import Store

    store = Store(config)
    try:
        store.ping()
        barrier.wait(30)
        results.put(store.submit(new))
    except BaseException as exc:
        results.put(("error", repr(exc)))
        raise
    finally:
        store.dispose()


def migrate_in_process(config: Any, barrier: Any, results: Any) -> None:
    """Child process: migrate once every child is ready; report (before, after)."""
    from celery_lease.store import Store

    store = Store(config)
    try:
        barrier.wait(30)
        results.put(store.migrate())
    except BaseException as exc:
        results.put(("error", repr(exc)))
        raise
    finally:
        store.dispose()


def call_external_in_process(
    path: str, name: str, key: str | None, barrier: Any, results: Any
) -> None:
    """Child process: one ExternalSystem call once every child is ready."""
    ext = ExternalSystem(path)
    barrier.wait(30)
    results.put(ext.call(name, key))
