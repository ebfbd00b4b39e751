"""Leased projects in real ``celery worker`` subprocesses, for the worker and crash suites.

:class:`LeaseEnv` (the ``lease_env`` fixture of ``tests/crash/conftest.py``; the
``tests/integration/test_worker_*.py`` modules define the same three-line fixture)
writes a generated project whose tasks (:data:`TASKS`) use ``LeasedTask``, with the
test's store and short timings, and gives the test what it needs to drive it:

- gates: a task given ``gate="name"`` blocks while the test holds that gate (a file),
  so a test can kill, freeze or stop a worker at a known point of a task's body;
- the counting stub (``tests.helpers.ExternalSystem``): ``start:<key>`` counts the
  attempts that reached the body, ``done:<key>`` the runs that completed it;
- the store, read as an operator would (record, audit trail, incarnations).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from celery_lease import State, TaskRecord, TransitionRecord
from celery_lease.store import Store

from ..helpers import ExternalSystem, WorkerProcess, WorkerProject, wait_until

#: Environment variable naming the directory of gate files.
GATES_ENV = "LEASE_TEST_GATES"

#: The generated project's tasks (after the harness's ``app = Celery(...)`` preamble).
TASKS = '''
import os
import time

from celery_lease import LeasedTask
from tests.helpers import ExternalSystem

external = ExternalSystem.from_env()
GATES = os.environ["LEASE_TEST_GATES"]


def hold(gate):
    """Block while the test holds ``gate``."""
    if gate:
        path = os.path.join(GATES, gate)
        while os.path.exists(path):
            time.sleep(0.02)


class Flaky(Exception):
    pass


def body(task, key, gate):
    """Count the attempt, wait at the gate, count the completed run."""
    node = task.request.hostname
    external.call(f"start:{key}", payload=node)
    hold(gate)
    external.call(f"done:{key}", payload=node)
    return {"key": key, "node": node}


@app.task(base=LeasedTask, bind=True, shared=False, name="t.work")
def work(self, key, gate=None):
    return body(self, key, gate)


@app.task(base=LeasedTask, bind=True, shared=False, name="t.long_lease", lease_ttl=60)
def long_lease(self, key, gate=None):
    """``work`` with a TTL far longer than any test: only a fast path can recover it."""
    return body(self, key, gate)


@app.task(base=LeasedTask, bind=True, shared=False, name="t.stepped")
def stepped(self, key, gate=None):
    """``work`` whose effect after the gate is a recorded step."""
    node = self.request.hostname
    external.call(f"start:{key}", payload=node)
    hold(gate)
    self.step("effect", external.call, f"done:{key}", payload=node, idempotent=True)
    return {"key": key, "node": node}


@app.task(base=LeasedTask, bind=True, shared=False, name="t.add")
def add(self, a, b):
    external.call("add", payload=f"{a}+{b}")
    return a + b


@app.task(base=LeasedTask, bind=True, shared=False, name="t.boom")
def boom(self, message):
    external.call("boom")
    raise ValueError(message)


@app.task(base=LeasedTask, bind=True, shared=False, name="t.retry_then_ok", max_retries=3)
def retry_then_ok(self, fails):
    external.call("retry_then_ok", payload=self.request.retries)
    if self.request.retries < fails:
        raise self.retry(countdown=0.3, exc=Flaky(f"try {self.request.retries}"))
    return self.request.retries


@app.task(
    base=LeasedTask,
    bind=True,
    shared=False,
    name="t.autoretry",
    autoretry_for=(Flaky,),
    retry_backoff=True,
    retry_backoff_max=2,
    retry_jitter=False,
    max_retries=3,
)
def autoretry(self, fails):
    external.call("autoretry", payload=self.request.retries)
    if self.request.retries < fails:
        raise Flaky(f"try {self.request.retries}")
    return "ok"


@app.task(base=LeasedTask, bind=True, shared=False, name="t.exhaust_fail", max_retries=1)
def exhaust_fail(self):
    external.call("exhaust_fail")
    raise self.retry(countdown=0.1, exc=Flaky("always"))


@app.task(
    base=LeasedTask,
    bind=True,
    shared=False,
    name="t.exhaust_manual",
    max_retries=1,
    on_exhausted="manual",
)
def exhaust_manual(self):
    external.call("exhaust_manual")
    raise self.retry(countdown=0.1, exc=Flaky("always"))


@app.task(base=LeasedTask, bind=True, shared=False, name="t.odd_result")
def odd_result(self):
    external.call("odd_result")
    return {1, 2, 3}


@app.task(base=LeasedTask, bind=True, shared=False, name="t.big_result")
def big_result(self):
    external.call("big_result")
    return "x" * 70_000


@app.task(base=LeasedTask, bind=True, shared=False, name="t.poison", max_recoveries=2)
def poison(self, key):
    external.call(f"start:{key}")
    os._exit(1)


@app.task(base=LeasedTask, bind=True, shared=False, name="t.overrun", max_runtime=1.0)
def overrun(self, key, gate):
    return body(self, key, gate)
'''


class Gates:
    """Gate files a task waits at (see :data:`TASKS`)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)

    def hold(self, name: str) -> str:
        (self.dir / name).touch()
        return name

    def release(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.dir / name).unlink()


def transitions(trail: list[TransitionRecord]) -> list[tuple[str | None, str]]:
    """An audit trail as ``(from, to)`` state names."""
    return [(None if r.from_state is None else r.from_state.value, r.to_state.value) for r in trail]


#: The audit trail of a task that ran once and succeeded.
CLEAN_RUN = [(None, "PENDING"), ("PENDING", "RUNNING"), ("RUNNING", "SUCCEEDED")]
#: A run whose first claim, made ahead by the lease agent, was given back before any of
#: its code ran (its delivery dropped by the worker: a lost broker connection, a stop),
#: retried at once with no recovery counted, then claimed and run.
GIVEN_BACK = [
    (None, "PENDING"),
    ("PENDING", "RUNNING"),
    ("RUNNING", "TIMEOUT"),
    ("TIMEOUT", "RETRY_WAIT"),
    ("RETRY_WAIT", "PENDING"),
    ("PENDING", "RUNNING"),
    ("RUNNING", "SUCCEEDED"),
]


class LeasedProject:
    """A generated leased project, its store and (lazily) its module in the test process."""

    def __init__(
        self,
        project: WorkerProject,
        store: Store,
        external: ExternalSystem,
        gates: Gates,
        finalizers: list[Callable[[], None]],
    ) -> None:
        self.project = project
        self.store = store
        self.external = external
        self.gates = gates
        self._finalizers = finalizers
        self._module: ModuleType | None = None
        self.workers: list[WorkerProcess] = []

    @property
    def module(self) -> ModuleType:
        """The project module imported in the test process (its store is closed at teardown)."""
        if self._module is None:
            from celery_lease._runtime import runtime

            module = self.project.load()
            self._finalizers.append(lambda: runtime(module.app).reset())
            self._module = module
        return self._module

    # -- workers ----------------------------------------------------------------------

    def worker(
        self,
        name: str = "w1",
        *,
        pool: str = "prefork",
        concurrency: int = 1,
        env: dict[str, str] | None = None,
        ready: bool = True,
    ) -> WorkerProcess:
        """Start a worker; with ``ready``, wait for its log line and incarnation row."""
        proc = self.project.worker(name, pool=pool, concurrency=concurrency, env=env)
        self.workers.append(proc)
        if ready:
            proc.wait_ready(timeout=60, store=self.store)
        return proc

    @property
    def reaper_lock(self) -> str:
        """The name of the lock this project's embedded reapers take (one per broker)."""
        from celery_lease.config import broker_origin
        from celery_lease.store._sweeps import reaper_lock_name

        return reaper_lock_name(broker_origin(self.project.broker_url))

    def incarnation(self, worker: WorkerProcess) -> str:
        """The id of ``worker``'s live incarnation row (its current start)."""
        for w in self.store.workers():
            if w.nodename == worker.nodename and w.pid == worker.pid and w.stopped_at is None:
                return w.id
        raise AssertionError(f"{worker!r} has no live incarnation row")

    # -- tasks ------------------------------------------------------------------------

    def submit(self, name: str, *args: Any, **options: Any) -> str:
        """``apply_async`` the project's task ``name`` from the test process; its id."""
        task = self.module.app.tasks[name]
        return str(task.apply_async(args, **options).id)

    def get(self, task_id: str) -> TaskRecord:
        record = self.store.get(task_id)
        assert record is not None, f"task {task_id} has no row"
        return record

    def trail(self, task_id: str) -> list[tuple[str | None, str]]:
        return transitions(self.store.history(task_id))

    def wait_state(
        self, task_id: str, *states: State, timeout: float = 30.0, message: str = ""
    ) -> TaskRecord:
        """Wait until the task's row is in one of ``states``; return the record."""

        def reached() -> TaskRecord | None:
            record = self.store.get(task_id)
            return record if record is not None and record.state in states else None

        wanted = "/".join(s.value for s in states)
        try:
            record = wait_until(reached, timeout=timeout, message=message or f"{task_id} {wanted}")
        except AssertionError as error:
            now = self.store.get(task_id)
            raise AssertionError(
                f"{error}: task {task_id} is {now.state if now else 'missing'}, not {wanted}"
                + self.diagnosis(task_id)
                + self.stacks()
            ) from None
        assert record is not None
        return record

    def wait_log(self, worker: WorkerProcess, pattern: str, timeout: float = 10.0) -> str:
        """``worker.wait_log`` whose failure report carries every worker's stacks."""
        try:
            return worker.wait_log(pattern, timeout=timeout).group(0)
        except AssertionError as error:
            raise AssertionError(f"{error}{self.stacks()}") from None

    def diagnosis(self, task_id: str) -> str:
        """What a task that never reached its state went through, for the failure
        report: its row's publishing and waiting marks, its audit trail, and every
        worker's log lines that name it (with each log's last lines)."""
        out = []
        record = self.store.get(task_id)
        if record is not None:
            out.append(
                f"row: attempt={record.attempt} published_at={record.published_at} "
                f"eta={record.eta} owner_node={record.owner_node} reason={record.reason!r}"
            )
        for r in self.store.history(task_id):
            state = r.from_state.value if r.from_state else None
            out.append(f"  {r.at} {state} -> {r.to_state.value}: {r.reason} ({r.actor})")
        for proc in self.workers:
            lines = (proc.log_text() or "").splitlines()
            named = [line for line in lines if task_id in line][-40:]
            out.append(f"--- {proc.nodename} log: lines naming the task ---")
            out += named
            out.append(f"--- {proc.nodename} log: last lines ---")
            out += lines[-15:]
        return "\n\ndiagnosis:\n" + "\n".join(out)

    def stacks(self) -> str:
        """Python stacks of every live worker process (with py-spy, when installed): what
        a stuck worker was doing, for the failure report."""
        spy = shutil.which("py-spy")
        if spy is None:
            return ""
        out = []
        for proc in self.workers:
            if not proc.is_alive():
                continue
            agent = proc.lease_agent()  # the claims' process: dumped with the others
            for pid in [proc.pid, *proc.children(), *([agent] if agent else [])]:
                try:
                    dump = subprocess.run(
                        [spy, "dump", "--pid", str(pid)],
                        capture_output=True,
                        text=True,
                        timeout=20,
                    ).stdout
                except subprocess.TimeoutExpired:
                    dump = "(py-spy timed out)"
                out.append(f"--- {proc.nodename} pid {pid} ---\n{dump}")
        return "\n\nworker stacks:\n" + "\n".join(out) if out else ""

    def wait_count(self, name: str, count: int, timeout: float = 30.0) -> int:
        """Wait until the external stub performed ``count`` effects named ``name``."""
        try:
            return wait_until(
                lambda: self.external.count(name) >= count and self.external.count(name),
                timeout=timeout,
                message=f"{count} {name!r} effects",
            )
        except AssertionError as error:
            have = self.external.count(name)
            raise AssertionError(f"{error}: have {have}" + self.stacks()) from None

    def drain(self, worker_count: int = 1, timeout: float = 30.0) -> None:
        """Run one ``t.add`` per worker slot and wait for all of them: every message
        published before this call has been received by then (one queue, FIFO)."""
        before = self.external.count("add")
        for i in range(worker_count):
            self.submit("t.add", 0, i)
        self.wait_count("add", before + worker_count, timeout=timeout)


class LeaseEnv:
    """Factory of :class:`LeasedProject` for one test (wraps the harness fixtures)."""

    def __init__(
        self,
        celery_project: Callable[..., WorkerProject],
        lease_config: Callable[..., Any],
        make_store: Callable[..., Store],
        external: ExternalSystem,
        finalizers: list[Callable[[], None]],
        tmp_path: Path,
    ) -> None:
        self._celery_project = celery_project
        self._lease_config = lease_config
        self._make_store = make_store
        self.external = external
        self._finalizers = finalizers
        self.gates = Gates(tmp_path / "gates")

    def project(
        self,
        *,
        broker_url: str | None = None,
        source: str = TASKS,
        settings: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        **overrides: Any,
    ) -> LeasedProject:
        """A leased project on this test's store; ``overrides`` are LeaseConfig fields."""
        store = self._make_store(**overrides)
        project = self._celery_project(
            source,
            broker_url=broker_url,
            config=self._lease_config(**overrides),
            settings=settings,
            env={GATES_ENV: str(self.gates.dir), **(env or {})},
        )
        return LeasedProject(project, store, self.external, self.gates, self._finalizers)


class Stopwatch:
    """Elapsed wall time for the measured (printed, never asserted) figures."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def lap(self) -> float:
        return time.monotonic() - self.t0


def report(label: str, seconds: float) -> None:
    """Print one measured figure (``pytest -s`` or ``-rP`` shows it)."""
    print(f"MEASURED {label}: {seconds:.2f} s", flush=True)


@contextlib.contextmanager
def released(gates: Gates, *names: str) -> Iterator[None]:
    """Release ``names`` when the block ends, whatever happens (never leave a task stuck)."""
    try:
        yield
    finally:
        for name in names:
            gates.release(name)


def pg_only() -> Any:
    """Parametrize ``backend`` to PostgreSQL only (marked ``postgres``)."""
    import pytest

    return pytest.mark.parametrize(
        "backend", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True
    )


def queue_depth(broker_url: str, queue: str) -> int:
    """Messages waiting in ``queue`` (0 when the queue was never declared)."""
    from kombu import Connection
    from kombu.exceptions import ChannelError

    with Connection(broker_url, connect_timeout=5) as conn:
        channel: Any = conn.channel()
        try:
            return int(channel.queue_declare(queue, passive=True).message_count)
        except ChannelError:
            return 0
        finally:
            with contextlib.suppress(Exception):
                channel.close()


def submit_in_process(
    module_path: str,
    module_name: str,
    env: dict[str, str],
    task_name: str,
    keys: list[str],
    barrier: Any,
    results: Any,
) -> None:
    """Spawned child: import the project, wait for every sibling, then submit
    ``task_name(key)`` with ``dedup_key=key`` for each key; report ``[(key, id), ...]``."""
    import importlib.util
    import sys

    from celery_lease._runtime import runtime

    os.environ.update(env)
    spec = importlib.util.spec_from_file_location(module_name, module_path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
        task = module.app.tasks[task_name]
        runtime(module.app).store.ping()  # connect before the race, not during it
        barrier.wait(60)
        results.put([(key, str(task.apply_async((key,), dedup_key=key).id)) for key in keys])
    except BaseException as exc:
        results.put(("error", repr(exc)))
        raise
    finally:
        runtime(module.app).reset()
        module.app.close()


#: The audit trail of a task recovered once from a lost lease, then successful.
RECOVERED = [
    (None, "PENDING"),
    ("PENDING", "RUNNING"),
    ("RUNNING", "TIMEOUT"),
    ("TIMEOUT", "RETRY_WAIT"),
    ("RETRY_WAIT", "PENDING"),
    ("PENDING", "RUNNING"),
    ("RUNNING", "SUCCEEDED"),
]
