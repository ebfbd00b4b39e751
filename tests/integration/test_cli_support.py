"""Fixtures and helpers shared by the operator-surface tests (CLI, admin API, result
backend and events, metrics, Flower). No tests here.

``ops`` is a generated Celery project on this test's lease database (SQLite file or a
PostgreSQL schema of its own) with the Redis result backend; tasks are put in a given
state through the store's own operations (submit, claim, steps, expire, finish), the
same calls a producer, worker and reaper make, so no worker is needed for most tests.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kombu.exceptions import OperationalError

from celery_lease import State, admin, notify
from celery_lease._runtime import runtime
from celery_lease.store import Lease, NewTask, Store

from ..helpers import WorkerProject, wait_until

OPS_SOURCE = """
import os
import signal
import time

from celery_lease import LeasedTask
from tests.helpers import ExternalSystem

app.conf.task_track_started = True


@app.task(base=LeasedTask, name="ops.add")
def add(x, y):
    return x + y


@app.task(base=LeasedTask, bind=True, name="ops.charge")
def charge(self, order, die=False, sleep=0):
    external = ExternalSystem.from_env()

    def call():
        external.call("charge", payload=order)
        if die:  # the pool child dies after the effect, before the step is recorded
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(float(sleep))
        return order

    self.step("charge", call)
    return "charged"


@app.task(base=LeasedTask, bind=True, name="ops.slow", on_timeout="manual")
def slow(self, seconds):
    external = ExternalSystem.from_env()
    external.call("slow-started")
    time.sleep(float(seconds))
    return "slept"


@app.task(base=LeasedTask, bind=True, name="ops.loop")
def loop(self, steps, pause):
    external = ExternalSystem.from_env()
    for i in range(int(steps)):
        self.step(f"s{i}", time.sleep, float(pause), idempotent=True)
        if i == 0:
            external.call("loop-running")
    return "looped"
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class Ops:
    """A project on this test's lease database, its app, and a store to set up rows."""

    project: WorkerProject
    app: Any
    store: Store

    @property
    def admin(self) -> Any:
        return admin(self.app)

    @property
    def runtime_store(self) -> Store:
        return runtime(self.app).store

    # -- putting tasks into a state -----------------------------------------------------

    def submit(
        self,
        name: str = "ops.add",
        args: Any = (1, 2),
        *,
        on_timeout: str = "retry",
        dedup_key: str | None = None,
        lease_ttl: float | None = None,
    ) -> str:
        task_id = str(uuid.uuid4())
        self.store.submit(
            NewTask(
                id=task_id,
                name=name,
                args=json.dumps(list(args)),
                kwargs="{}",
                options=json.dumps({"queue": self.project.queue}),
                lease_ttl=lease_ttl or self.store.config.ttl,
                max_recoveries=self.store.config.max_recoveries,
                on_timeout=on_timeout,
                dedup_key=dedup_key,
            )
        )
        self.store.mark_published([task_id])
        return task_id

    def register_worker(self, nodename: str | None = None) -> tuple[str, str]:
        """A live worker incarnation (a node name of its own unless given): (id, node)."""
        nodename = nodename or f"w-{uuid.uuid4().hex[:6]}@ops-test"
        worker_id = uuid.uuid4().hex
        self.store.register_worker(worker_id, nodename, "ops-host", os.getpid())
        return worker_id, nodename

    def claim(self, task_id: str, worker: tuple[str, str]) -> Lease:
        worker_id, nodename = worker
        claim = self.store.claim(task_id, worker_id, f"worker:{nodename}")
        assert not hasattr(claim, "why"), claim
        return claim.lease  # type: ignore[union-attr]

    def running(self, name: str = "ops.add", nodename: str | None = None, **kw: Any) -> str:
        task_id = self.submit(name, **kw)
        self.claim(task_id, self.register_worker(nodename))
        return task_id

    def wait_manual(self, *, step: str | None = "charge", nodename: str | None = None) -> str:
        """A task handed to a person: its worker died with a non-idempotent step in
        flight (or, with ``step=None``, its on_timeout is 'manual')."""
        task_id = self.submit("ops.charge", ["order-1"], on_timeout="retry" if step else "manual")
        lease = self.claim(task_id, self.register_worker(nodename))
        self.store.step_done(lease, "reserve", json.dumps("r-1"), idempotent=True)
        if step is not None:
            self.store.step_started(lease, step, checkable=False)
        expired = self.store.expire(
            actor="reaper:ops-test",
            reason="lease expired: owner's heartbeat older than the TTL",
            task_ids=[task_id],
            only_expired=False,
        )
        assert [e.to_state for e in expired] == [State.WAIT_MANUAL]
        return task_id

    def finished(self, to: State, name: str = "ops.add") -> str:
        task_id = self.submit(name)
        worker = self.register_worker()
        lease = self.claim(task_id, worker)
        ok = self.store.finish(
            lease,
            to,
            actor=f"worker:{worker[1]}",
            reason="succeeded" if to is State.SUCCEEDED else "task raised",
            result=json.dumps(3) if to is State.SUCCEEDED else None,
            error=None if to is State.SUCCEEDED else "ValueError: boom",
        )
        assert ok
        return task_id

    def state(self, task_id: str) -> State:
        record = self.store.get(task_id)
        assert record is not None
        return record.state


def make_ops(
    celery_project: Callable[..., WorkerProject],
    store: Store,
    *,
    broker_url: str | None = None,
    settings: dict[str, Any] | None = None,
) -> Ops:
    """A project of ``OPS_SOURCE`` on ``store``'s tables, loaded in the test process;
    call :func:`close_ops` at teardown."""
    project = celery_project(
        OPS_SOURCE, broker_url=broker_url, config=store.config, settings=settings or {}
    )
    return Ops(project, project.load().app, store)


def close_ops(ops: Ops) -> None:
    rt = runtime(ops.app)
    if rt._store is not None:  # let the notifier finish before the app and tables go
        notifier = notify.find_notifier(rt._store)
        if notifier is not None:
            notifier.close(30)
    rt.reset()


@pytest.fixture(name="ops")
def ops_fixture(
    celery_project: Callable[..., WorkerProject],
    make_store: Callable[..., Store],
    redis_url: str,
) -> Iterator[Ops]:
    """A project (tasks of ``OPS_SOURCE``) on this test's lease tables, Redis broker and
    Redis result backend, loaded in the test process."""
    ops = make_ops(celery_project, make_store(), settings={"result_backend": redis_url})
    yield ops
    close_ops(ops)


class EventLog:
    """A real event consumer, as Flower runs one: ``app.events.Receiver`` on the broker
    feeding ``celery.events.state.State``, in a thread; ``types`` lists what arrived."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.state = app.events.State()
        self.types: list[tuple[str, str | None]] = []
        self.raw: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._receiver: Any = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._error: BaseException | None = None

    def _on_event(self, event: dict[str, Any]) -> None:
        with self._lock:
            self.state.event(dict(event))
            self.types.append((event["type"], event.get("uuid")))
            self.raw.append(dict(event))

    def _run(self) -> None:
        try:
            with self.app.connection_for_read() as conn:
                self._receiver = self.app.events.Receiver(conn, handlers={"*": self._on_event})
                self._receiver.capture(limit=None, timeout=None, wakeup=False)
        except BaseException as exc:  # surfaced by the test through wait_ready/stop
            self._error = exc

    def start(self) -> EventLog:
        self._thread.start()
        probe = f"probe-{uuid.uuid4().hex}"

        def arrived() -> bool:
            if self._error is not None:
                raise self._error
            try:
                with self.app.events.default_dispatcher(hostname="probe@test") as d:
                    d.send("task-probe", uuid=probe)
            except (OSError, OperationalError):
                # the broker reset the probe's connection: the next probe takes a new
                # one; a broker that stays away ends the wait with its timeout
                return False
            return any(u == probe for _, u in self.snapshot())

        wait_until(arrived, timeout=20, interval=0.2, message="event receiver never ready")
        return self

    def snapshot(self) -> list[tuple[str, str | None]]:
        with self._lock:
            return list(self.types)

    def of(self, task_id: str) -> list[str]:
        return [t for t, u in self.snapshot() if u == task_id]

    def task(self, task_id: str) -> Any:
        with self._lock:
            return self.state.tasks.get(task_id)

    def stop(self) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(10)


@pytest.fixture(name="event_log")
def event_log_fixture(ops: Ops) -> Iterator[EventLog]:
    log = EventLog(ops.app).start()
    yield log
    log.stop()
