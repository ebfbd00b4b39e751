"""Transition listeners: one log line per transition; the states Celery cannot see
written to the real Redis result backend; task events received by a real consumer
(``app.events.Receiver`` feeding ``celery.events.state.State``, as Flower does) on
Redis and RabbitMQ; and none of it ever blocks or breaks a transition."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery.exceptions import TaskRevokedError
from celery.result import AsyncResult

from celery_lease import State, TaskFailed, notify
from celery_lease.store import Store, TransitionEvent

from ..helpers import ExternalSystem, WorkerProject, wait_until
from .test_cli_support import (
    EventLog,
    Ops,
    close_ops,
    event_log_fixture,  # noqa: F401  (the event_log fixture)
    make_ops,
    ops_fixture,  # noqa: F401  (the ops fixture)
)


def zombie(ops: Ops, name: str = "ops.add", step: str | None = None, **kw: Any) -> str:
    """A RUNNING task whose worker is gone (marked stopped): the next sweep expires it."""
    task_id = ops.submit(name, **kw)
    worker = ops.register_worker()
    lease = ops.claim(task_id, worker)
    if step is not None:
        ops.store.step_started(lease, step, checkable=False)
    ops.store.stop_worker(worker[0], "SIGKILL")
    return task_id


def backend_state(ops: Ops, task_id: str) -> tuple[str, Any]:
    result = AsyncResult(task_id, app=ops.app)
    return result.state, result.info


def flush(ops: Ops) -> None:
    assert notify.flush(ops.runtime_store, 30), "notifications not delivered"


# -- logs ---------------------------------------------------------------------------------


def test_one_structured_log_line_per_transition(ops: Ops, caplog: Any) -> None:
    caplog.set_level(logging.INFO, logger="celery_lease.transitions")
    task_id = zombie(ops, "ops.charge", step="charge")

    ops.admin.reap()
    ops.admin.retry(task_id, actor="alice", reason='checked "PSP": no charge')

    lines = [r for r in caplog.records if r.name == "celery_lease.transitions"]
    mine = [r for r in lines if r.lease_task_id == task_id]
    assert [(r.lease_from, r.lease_to) for r in mine] == [
        ("RUNNING", "TIMEOUT"),
        ("TIMEOUT", "WAIT_MANUAL"),
        ("WAIT_MANUAL", "PENDING"),
    ]
    manual, retried = mine[1], mine[2]
    assert manual.levelno == logging.WARNING  # a person must act
    assert manual.getMessage() == (
        f"transition task_id={task_id} name=ops.charge from=TIMEOUT to=WAIT_MANUAL attempt=1 "
        f"actor=admin:{manual.lease_actor.split(':', 1)[1]} "
        f"reason={json.dumps(manual.lease_reason)}"
    )
    assert "outcome of step 'charge' unknown" in manual.lease_reason
    assert retried.levelno == logging.INFO
    assert retried.getMessage().endswith('actor=alice reason="checked \\"PSP\\": no charge"')
    assert (retried.lease_task_name, retried.lease_attempt) == ("ops.charge", 1)


# -- result backend -----------------------------------------------------------------------


def test_result_backend_gets_what_celery_cannot_see(ops: Ops) -> None:
    manual = zombie(ops, "ops.charge", step="charge")
    retried = zombie(ops, "ops.add")
    pending = ops.submit()
    for task_id in (manual, retried, pending):
        assert backend_state(ops, task_id)[0] == "PENDING"  # nothing there yet

    ops.admin.reap()
    ops.admin.cancel(pending, actor="dan", reason="duplicate")
    flush(ops)

    state, meta = backend_state(ops, manual)
    assert state == "WAIT_MANUAL"
    assert "outcome of step 'charge' unknown" in meta["reason"]
    assert meta["attempt"] == 1 and meta["lease_state"] == "WAIT_MANUAL"
    assert meta["hint"] == f"celery -A proj lease show {manual}"
    assert meta["worker"].endswith("@ops-test")
    state, meta = backend_state(ops, retried)  # expired, safe: waits for its retry
    assert state == "TIMEOUT" and meta["lease_state"] == "RETRY_WAIT"
    state, info = backend_state(ops, pending)  # final: Celery's REVOKED, as a revoked task
    assert state == "REVOKED" and "duplicate" in str(info)
    with pytest.raises(TaskRevokedError):
        AsyncResult(pending, app=ops.app).get(timeout=10)


def test_operator_decisions_reach_the_result_backend(ops: Ops) -> None:
    failed, resolved, retried = (zombie(ops, "ops.charge", step="charge") for _ in range(3))
    ops.admin.reap()

    ops.admin.fail(failed, actor="bob", reason="customer gave up")
    ops.admin.resolve(resolved, actor="carol", reason="done by hand", result={"ref": 7})
    ops.admin.retry(retried, actor="alice", reason="not charged")
    flush(ops)

    state, info = backend_state(ops, failed)  # final: Celery's FAILURE, get() raises
    assert state == "FAILURE" and isinstance(info, TaskFailed)
    assert (info.task_id, info.actor, info.reason) == (failed, "bob", "customer gave up")
    with pytest.raises(TaskFailed, match="failed by bob: customer gave up"):
        AsyncResult(failed, app=ops.app).get(timeout=10)
    assert AsyncResult(resolved, app=ops.app).get(timeout=10) == {"ref": 7}
    assert backend_state(ops, resolved)[0] == "SUCCESS"
    state, meta = backend_state(ops, retried)
    assert state == "PENDING" and meta["from_state"] == "WAIT_MANUAL"


def test_result_backend_sync_and_events_can_be_turned_off(
    celery_project: Callable[..., WorkerProject], make_store: Callable[..., Store], redis_url: str
) -> None:
    ops = make_ops(
        celery_project,
        make_store(),
        settings={
            "result_backend": redis_url,
            "lease_result_backend_sync": False,
            "lease_send_events": "off",
        },
    )
    try:
        task_id = ops.submit()
        ops.admin.cancel(task_id, reason="r")
        assert notify.find_notifier(ops.runtime_store) is None
        assert notify.log_transitions in ops.runtime_store.listeners
        backend = ops.app.backend
        assert backend.get(backend.get_key_for_task(task_id)) is None
    finally:
        close_ops(ops)


# -- task events --------------------------------------------------------------------------


@pytest.fixture
def broker_ops(
    broker_url: str, celery_project: Callable[..., WorkerProject], make_store: Callable[..., Store]
) -> Iterator[Ops]:
    ops = make_ops(celery_project, make_store(), broker_url=broker_url)
    yield ops
    close_ops(ops)


def test_events_are_received_as_flower_receives_them(broker_ops: Ops) -> None:
    ops = broker_ops
    log = EventLog(ops.app).start()
    try:
        nodes = {}
        tasks = {}
        for kind in ("safe", "manual", "failed", "resolved", "retried"):
            step = None if kind == "safe" else "charge"
            tasks[kind] = zombie(ops, "ops.charge" if step else "ops.add", step=step)
            record = ops.store.get(tasks[kind])
            assert record is not None
            nodes[kind] = record.owner_node
        tasks["cancelled"] = ops.submit()

        ops.admin.reap()
        ops.admin.cancel(tasks["cancelled"], actor="dan", reason="duplicate")
        ops.admin.fail(tasks["failed"], actor="bob", reason="customer gave up")
        ops.admin.resolve(tasks["resolved"], actor="carol", reason="by hand", result=5)
        ops.admin.retry(tasks["retried"], actor="alice", reason="not charged")
        flush(ops)

        expected = {
            "safe": ["task-timeout", "task-retried"],
            "manual": ["task-timeout", "task-wait-manual"],
            "failed": ["task-timeout", "task-wait-manual", "task-failed"],
            "resolved": ["task-timeout", "task-wait-manual", "task-succeeded"],
            "retried": ["task-timeout", "task-wait-manual", "task-retried"],
            "cancelled": ["task-cancelled"],
        }

        def arrived() -> bool:
            return all(log.of(tasks[k]) == v for k, v in expected.items())

        wait_until(arrived, timeout=20, message=f"events: {log.snapshot()}")

        states = {k: log.task(t) for k, t in tasks.items()}
        assert {k: t.state for k, t in states.items()} == {
            "safe": "RETRY",
            "manual": "WAIT-MANUAL",
            "failed": "FAILURE",
            "resolved": "SUCCESS",
            "retried": "RETRY",
            "cancelled": "CANCELLED",
        }
        # filed under the worker that ran the task, whoever made the transition
        for kind in ("safe", "manual", "failed"):
            assert states[kind].worker.hostname == nodes[kind]
        assert states["cancelled"].worker.hostname.startswith("celery-lease@")
        manual = states["manual"]
        assert manual.name == "ops.charge"
        assert "outcome of step 'charge' unknown" in manual.lease_reason
        assert (manual.lease_state, manual.lease_from, manual.lease_attempt) == (
            "WAIT_MANUAL",
            "TIMEOUT",
            1,
        )
        assert manual.lease_hint == f"celery -A proj lease show {tasks['manual']}"
        assert states["failed"].exception == "customer gave up"
        assert states["cancelled"].lease_actor == "dan"
    finally:
        log.stop()


def test_only_transitions_celery_cannot_see_are_told() -> None:
    def event(frm: State | None, to: State, actor: str = "worker:w1@h") -> TransitionEvent:
        return TransitionEvent("t", "n", frm, to, "r", actor, 1)

    told = [
        event(State.RUNNING, State.TIMEOUT),  # worker fast path or reaper
        event(State.TIMEOUT, State.WAIT_MANUAL),
        event(State.TIMEOUT, State.RETRY_WAIT),
        event(State.RUNNING, State.WAIT_MANUAL),  # over max_runtime, or retries exhausted
        event(State.RUNNING, State.CANCELLED),  # the task raises Ignore: Celery stores nothing
        event(State.PENDING, State.CANCELLED, "alice"),
        event(State.WAIT_MANUAL, State.FAILED, "alice"),
        event(State.WAIT_MANUAL, State.SUCCEEDED, "alice"),
        event(State.WAIT_MANUAL, State.PENDING, "alice"),
    ]
    untold = [
        event(None, State.PENDING, "producer"),
        event(State.PENDING, State.RUNNING),
        event(State.RUNNING, State.SUCCEEDED),
        event(State.RUNNING, State.FAILED),
        event(State.RUNNING, State.RETRY_WAIT),
        event(State.RETRY_WAIT, State.PENDING, "reaper:h"),
        event(State.WAIT_MANUAL, State.SUCCEEDED),  # the still-running owner finished
    ]
    assert all(notify.needs_telling(e) for e in told)
    assert not any(notify.needs_telling(e) for e in untold)


# -- never in the way -------------------------------------------------------------------


class BlackHole:
    """A TCP port that accepts connections and never answers: a hung Redis."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        """From now on: connection refused."""
        with contextlib.suppress(OSError):  # wakes the accept() below; close() alone does not
            self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()
        # the accepting thread first: a connection it accepted as the server shut down is
        # in ``conns`` only once it has returned, and left open it would hang its client
        self._thread.join(10)
        assert not self._thread.is_alive(), "the accepting thread did not stop"
        for conn in self.conns:
            conn.close()


def test_a_hung_broker_and_backend_never_block_or_break_a_transition(
    celery_project: Callable[..., WorkerProject], make_store: Callable[..., Store], caplog: Any
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_lease.notify")
    hole = BlackHole()
    url = f"redis://127.0.0.1:{hole.port}/0"
    ops = make_ops(
        celery_project,
        make_store(),
        broker_url=url,
        settings={
            "result_backend": url,
            # bound the backend's own retries (the default is 20 over about 20 s)
            "result_backend_transport_options": {
                "retry_policy": {"max_retries": 2, "interval_start": 0, "interval_step": 0.2}
            },
        },
    )
    try:
        task_id = ops.submit()
        assert ops.admin.cancel(task_id, reason="r") is State.PENDING
        notifier = notify.find_notifier(ops.runtime_store)
        assert notifier is not None
        # the transition committed and returned while its notification hangs
        assert ops.state(task_id) is State.CANCELLED
        assert notifier.flush(0) is False
        another = ops.submit()
        assert ops.admin.cancel(another, reason="r") is State.PENDING  # still not blocked
        hole.close()  # the services die: the notifier gives up, logs, and carries on
        assert notifier.flush(60), "the notifier never gave up on the dead services"
        text = caplog.text
        assert "result backend not updated" in text and "task events not sent" in text
        assert ops.state(another) is State.CANCELLED
    finally:
        hole.close()
        close_ops(ops)


def test_a_full_queue_drops_rather_than_waits(ops: Ops, caplog: Any) -> None:
    caplog.set_level(logging.WARNING, logger="celery_lease.notify")
    gate = threading.Event()

    class Stuck(notify.Notifier):
        """Delivery hangs (a backend that never answers) until the gate opens."""

        def deliver(self, events: Any) -> None:
            gate.wait(30)
            super().deliver(events)

    notifier = Stuck(ops.app, ops.runtime_store, max_queue=1)
    task_ids = [ops.submit() for _ in range(5)]
    events = [
        TransitionEvent(t, "ops.add", State.PENDING, State.CANCELLED, "r", "a", 0) for t in task_ids
    ]
    notifier([events[0]])  # taken by the thread, which then hangs
    wait_until(notifier._queue.empty, message="first batch taken")
    notifier([events[1]])  # fills the queue
    for e in events[2:]:
        notifier([e])  # returns at once: dropped, not waiting

    assert notifier.dropped == 3
    assert "notification queue full" in caplog.text
    gate.set()
    assert notifier.flush(30)
    assert notifier.delivered == 2
    notifier.close()
    assert notifier._thread is None


# -- in real workers ------------------------------------------------------------------------


def test_the_store_of_every_process_reports_its_transitions(ops: Ops) -> None:
    # a worker's main process, its pool children and beat never go through admin():
    # the listeners must be installed where the per-process store is created
    store = ops.runtime_store  # runtime(app).store, as a worker gets it
    assert notify.log_transitions in store.listeners, "celery_lease/_runtime.py hook missing"
    assert notify.find_notifier(store) is not None


def test_a_child_killed_mid_step_shows_wait_manual_not_started(
    ops: Ops, external: ExternalSystem, event_log: EventLog
) -> None:
    worker = ops.project.worker(pool="prefork", concurrency=1).wait_ready(store=ops.store)
    charge = ops.app.tasks["ops.charge"]

    result = charge.delay("order-9", die=True)

    wait_until(
        lambda: ops.state(result.id) is State.WAIT_MANUAL,
        timeout=60,
        message="task never handed to a person",
    )
    wait_until(
        lambda: backend_state(ops, result.id)[0] == "WAIT_MANUAL",
        timeout=20,
        message="result backend still not WAIT_MANUAL",
    )
    meta = backend_state(ops, result.id)[1]
    assert "outcome of step 'charge' unknown" in meta["reason"]
    assert meta["worker"] == worker.nodename
    assert external.count("charge") == 1  # the effect happened once, never re-run
    wait_until(
        lambda: event_log.of(result.id) == ["task-timeout", "task-wait-manual"],
        timeout=20,
        message="events from the worker's main process",
    )
    assert event_log.task(result.id).worker.hostname == worker.nodename


def test_a_cooperative_cancel_in_a_pool_child_reaches_the_backend(
    ops: Ops, external: ExternalSystem, event_log: EventLog
) -> None:
    ops.project.worker(pool="prefork", concurrency=1).wait_ready(store=ops.store)
    result = ops.app.tasks["ops.loop"].delay(200, 0.1)
    wait_until(lambda: external.count("loop-running") == 1, timeout=60, message="loop running")
    wait_until(
        lambda: backend_state(ops, result.id)[0] == "STARTED",
        timeout=10,
        message="Celery's own STARTED",
    )

    assert ops.admin.cancel(result.id, actor="dan", reason="stop it") is State.RUNNING

    wait_until(
        lambda: ops.state(result.id) is State.CANCELLED, timeout=30, message="task never stopped"
    )
    wait_until(
        lambda: backend_state(ops, result.id)[0] == "REVOKED",
        timeout=20,
        message="result backend still not REVOKED",
    )
    assert "cancelled: stop it" in str(backend_state(ops, result.id)[1])
    wait_until(
        lambda: event_log.of(result.id) == ["task-cancelled"],
        timeout=20,
        message="task-cancelled from the pool child",
    )
