"""Test harness shared by every suite (importable from generated worker modules too).

The polling, process and counting parts are celery-lease's testing kit
(:mod:`celery_lease.testing`), the same one users test their tasks with; this module
adds what only this project's suites need:

- :func:`wait_until`: poll a predicate against a deadline (the kit's).
- :class:`ExternalSystem`: the kit's counting stub of an external API, found by
  generated worker modules through ``CELERY_LEASE_TEST_EXTERNAL``.
- :class:`WorkerProject` / :class:`WorkerProcess` / :class:`BeatProcess`: a generated
  Celery project module and real ``celery worker`` and ``celery beat`` subprocesses (the
  kit's) started from it.
- :func:`lease_settings`, :func:`check_audit`: lease-specific conveniences.
- ``pid_alive``, ``pid_state``, ``child_pids``, ``group_pids``: the kit's /proc helpers.

Worker subprocesses get the repository root on ``PYTHONPATH``, so a generated module
can ``from tests.helpers import ExternalSystem``.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib.util
import os
import signal
import sys
import textwrap
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from celery import _state

from celery_lease.testing import (
    Effect,
    SideEffects,
    assert_audit_trail,
    child_pids,
    group_pids,
    pid_alive,
    pid_state,
    wait_until,
)
from celery_lease.testing import WorkerProcess as KitWorkerProcess
from celery_lease.testing._procs import BeatProcess as KitBeatProcess
from celery_lease.testing._worker import log_report

# the kit's names, for the suites that import them from here
__all__ = [
    "CONF_ENV_PREFIX",
    "EXTERNAL_ENV",
    "REPO_ROOT",
    "BeatProcess",
    "Effect",
    "ExternalSystem",
    "ProcessRegistry",
    "WorkerProcess",
    "WorkerProject",
    "call_external_in_process",
    "check_audit",
    "child_pids",
    "group_pids",
    "lease_settings",
    "migrate_in_process",
    "pid_alive",
    "pid_state",
    "submit_in_process",
    "wait_step",
    "wait_until",
]

if TYPE_CHECKING:
    from celery import Celery

    from celery_lease.config import LeaseConfig
    from celery_lease.store import Store


REPO_ROOT = Path(__file__).resolve().parent.parent

#: Environment variable a generated worker module reads to find the external stub.
EXTERNAL_ENV = "CELERY_LEASE_TEST_EXTERNAL"
#: Environment variables ``TEST_CONF_<KEY>=value`` set ``app.conf.<key> = "value"`` in a
#: generated module (strings: ``lease_*`` settings are coerced by celery_lease.config).
CONF_ENV_PREFIX = "TEST_CONF_"


# -- polling ------------------------------------------------------------------------------


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


class ExternalSystem(SideEffects):
    """The kit's side-effect counter (:class:`celery_lease.testing.SideEffects`), found
    by generated worker modules through ``CELERY_LEASE_TEST_EXTERNAL``.

    ``call(name, key)`` performs one effect and returns its id; a call repeating an
    idempotency ``key`` already used for ``name`` performs nothing new. ``count(name)``
    is the number of real effects; ``calls(name)`` counts every call.
    """

    @classmethod
    def from_env(cls, variable: str = EXTERNAL_ENV) -> ExternalSystem:
        """The stub a test handed to this worker process (via ``CELERY_LEASE_TEST_EXTERNAL``)."""
        try:
            return cls(os.environ[variable])
        except KeyError:
            raise RuntimeError(
                f"{variable} is not set: start the worker via WorkerProject"
            ) from None


# -- lease conveniences -------------------------------------------------------------------


def lease_settings(config: LeaseConfig) -> dict[str, Any]:
    """The ``app.conf`` settings (``lease_*`` keys) that reproduce ``config`` in a worker."""
    from celery_lease.config import SETTINGS

    out: dict[str, Any] = {}
    for key in SETTINGS:
        out[key] = getattr(config, key.removeprefix("lease_"))
    return out


def check_audit(store: Store, task_ids: Iterable[str] | None = None) -> int:
    """Assert the audit trail of every task (or of ``task_ids``) is consistent (see
    :func:`celery_lease.testing.assert_audit_trail`); returns how many were checked."""
    return assert_audit_trail(store, task_ids)


def flush_published(store: Store) -> None:
    """Record now every "published" mark the store's producer side holds back for a
    batch (:meth:`~celery_lease.store.Store.mark_published_soon`): what a test asserts
    next then sees it (production leaves them to the background recorder)."""
    store._marks.flush()


def discard_unpublished(store: Store, task_id: str) -> None:
    """Delete a PENDING row never claimed nor published, with its audit rows (counted in
    the transition totals first, as every deletion of audit rows is)."""
    from sqlalchemy import delete

    from celery_lease.states import State

    t, tr = store.t.tasks, store.t.transitions

    def op(conn: Any, _: bool) -> None:
        gone = conn.execute(
            delete(t).where(
                t.c.id == task_id,
                t.c.state == State.PENDING.value,
                t.c.attempt == 0,
                t.c.published_at.is_(None),
            )
        ).rowcount
        if gone:
            store._delete_audit(conn, tr.c.task_id == task_id)

    store._tx(op)


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

    def beat(
        self, name: str = "beat", *, env: Mapping[str, str] | None = None, start: bool = True
    ) -> BeatProcess:
        """A ``celery beat`` process of this project (started unless ``start=False``):
        it sends the project's periodic tasks, ``celery_lease.reap`` among them."""
        proc = BeatProcess(
            self,
            name=name,
            pool="solo",
            concurrency=1,
            nodename=f"{name}@lease-test",
            extra_args=(),
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


class WorkerProcess(KitWorkerProcess):
    """One real ``celery -A <module> worker`` subprocess of a :class:`WorkerProject` (the
    kit's :class:`celery_lease.testing.WorkerProcess`, its own process group).

    Output goes to ``<project dir>/<name>.log``; when a test fails, the harness appends
    the tail of every worker's log to the failure report.
    """

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
        super().__init__(
            project.module,
            cwd=project.directory,
            log_path=project.directory / f"{name}.log",
            env=env,
            pool=pool,
            concurrency=concurrency,
            nodename=nodename or f"{name}@lease-test",
            queues=[project.queue],
            extra_args=extra_args,
            python=project.python,
        )

    def process_env(self) -> dict[str, str]:
        return self.project.process_env(self.env)

    def restart(self, *, timeout: float = 30.0) -> WorkerProcess:
        """Start again with the same options and node name (after a stop or kill)."""
        if self.is_alive():
            self.stop()
        self.kill_group(signal.SIGKILL)
        self.wait_group_gone(timeout=timeout)
        self.start()
        return self

    def _require_pid(self) -> int:
        return self.require_pid()

    def wait_ready(self, timeout: float = 30.0, store: Store | None = None) -> WorkerProcess:
        """Wait for the ``<nodename> ready.`` log line of the current start; with ``store``,
        also for a live incarnation row of this node name and main pid in its workers
        table. Raises AssertionError (with the log tail) if the process exits first."""
        self.wait_ready_line(timeout)
        if store is not None:
            pid = self.require_pid()

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

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the main process only."""
        self.signal_main(sig)

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the whole process group (main process and pool children)."""
        self.signal_group(sig)


class BeatProcess(WorkerProcess, KitBeatProcess):
    """One real ``celery -A <module> beat`` subprocess of a :class:`WorkerProject` (the
    kit's :class:`~celery_lease.testing._procs.BeatProcess`): started, signalled, torn
    down and reported like the project's workers; :meth:`wait_ready` waits for beat's
    ``beat: Starting...`` line."""


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
        return log_report(self.workers, lines)


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
