"""Flower: ``format_task`` on tasks built by Celery's own ``State`` from lease events,
and a real Flower process rendering a WAIT_MANUAL task page with the lease fields."""

from __future__ import annotations

import copy
import html
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.events import Event
from celery.events.state import State as EventState

from celery_lease import State, notify
from celery_lease.contrib.flower import LEASE_FIELDS, format_task
from celery_lease.store import TransitionEvent

from ..helpers import wait_until
from .test_cli_support import (
    EventLog,
    Ops,
    event_log_fixture,  # noqa: F401  (the event_log fixture)
    free_port,
    ops_fixture,  # noqa: F401  (the ops fixture)
)


def zombie_with_step(ops: Ops) -> tuple[str, str]:
    """A RUNNING task, its non-idempotent step in flight, whose worker is gone."""
    task_id = ops.submit("ops.charge", ["order-1"])
    worker = ops.register_worker()
    lease = ops.claim(task_id, worker)
    ops.store.step_started(lease, "charge", checkable=False)
    ops.store.stop_worker(worker[0], "SIGKILL")
    return task_id, worker[1]


def test_format_task_surfaces_the_lease_fields(ops: Ops, event_log: EventLog) -> None:
    task_id, node = zombie_with_step(ops)
    ops.admin.reap()
    wait_until(lambda: event_log.of(task_id) == ["task-timeout", "task-wait-manual"], timeout=20)
    original = event_log.task(task_id)
    assert original.state == "WAIT-MANUAL"  # what Flower shows without the helper

    shown = format_task(copy.copy(original))  # Flower hands the hook a copy

    assert shown.state == "WAIT_MANUAL"
    assert set(LEASE_FIELDS) <= set(shown._fields)
    assert shown.lease_reason.startswith("outcome of step 'charge' unknown")
    assert (shown.lease_attempt, shown.lease_from) == (1, "TIMEOUT")
    assert shown.lease_hint == f"celery -A proj lease show {task_id}"
    assert shown.as_dict()["lease_actor"].startswith("admin:")
    assert shown.result.startswith("WAIT_MANUAL: outcome of step 'charge' unknown")
    assert shown.result.endswith(f"(attempt 1) -- celery -A proj lease show {task_id}")
    assert shown.worker.hostname == node
    # the task Flower keeps is untouched
    assert original.state == "WAIT-MANUAL" and "lease_reason" not in original._fields


def lease_event(kind: str, task_id: str, frm: State, to: State, at: float) -> dict[str, Any]:
    """An event exactly as celery-lease sends it (fields from notify.event_fields)."""
    app = Celery("proj", set_as_current=False)
    change = TransitionEvent(
        task_id, "ops.charge", frm, to, "outcome of step 'x' unknown", "reaper:h", 1
    )
    fields = notify.event_fields(app, change, None, "celery-lease@h")
    fields["lease_at"] = at
    return dict(Event(kind, hostname="w1@h", timestamp=at, **fields))


def replay(*events: dict[str, Any]) -> EventState:
    state = EventState()
    for event in events:
        add(state, event)
    return state


def add(state: EventState, event: dict[str, Any]) -> None:
    """Feed one event as ``app.events.Receiver`` delivers it (with the local fields)."""
    state.event({"local_received": time.time(), "clock": 0, **event})


def test_format_task_leaves_tasks_without_lease_events_alone() -> None:
    tid = str(uuid.uuid4())
    state = replay(
        Event("task-started", uuid=tid, hostname="w1@h", timestamp=time.time()),
        Event("task-succeeded", uuid=tid, hostname="w1@h", result="3", runtime=0.1),
    )
    task = copy.copy(state.tasks[tid])
    assert format_task(task) is task
    assert (task.state, task.result) == ("SUCCESS", "3")
    assert "lease_state" not in task._fields


def test_a_lease_decision_after_a_worker_reported_failure_is_shown() -> None:
    # a task-failed from the worker itself (a leased worker never sends one for a lost
    # pool child, but a worker without the lease's service does); Celery's precedence
    # keeps FAILURE when the lease's later decision arrives
    tid, now = str(uuid.uuid4()), time.time()
    state = replay(
        Event("task-started", uuid=tid, hostname="w1@h", timestamp=now - 2),
        Event(
            "task-failed",
            uuid=tid,
            hostname="w1@h",
            exception="WorkerLostError()",
            timestamp=now - 1,
        ),
        lease_event("task-timeout", tid, State.RUNNING, State.TIMEOUT, now),
        lease_event("task-wait-manual", tid, State.TIMEOUT, State.WAIT_MANUAL, now),
    )
    assert state.tasks[tid].state == "FAILURE"
    shown = format_task(copy.copy(state.tasks[tid]))
    assert shown.state == "WAIT_MANUAL" and shown.lease_reason == "outcome of step 'x' unknown"

    # a later success (an operator retry that ran) is not hidden by the old decision
    add(state, Event("task-succeeded", uuid=tid, hostname="w2@h", result="'ok'", timestamp=now + 5))
    shown = format_task(copy.copy(state.tasks[tid]))
    assert (shown.state, shown.result) == ("SUCCESS", "'ok'")


@pytest.fixture
def flower(ops: Ops) -> Iterator[str]:
    """A real Flower on a loopback port with ``format_task`` in its flowerconfig.py."""
    (ops.project.directory / "flowerconfig.py").write_text(
        "from celery_lease.contrib.flower import format_task  # noqa: F401\n"
    )
    port = free_port()
    log = (ops.project.directory / "flower.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            ops.project.module,
            "flower",
            f"--port={port}",
            "--address=127.0.0.1",
            "--conf=flowerconfig.py",
        ],
        cwd=ops.project.directory,
        env=ops.project.process_env(),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        probe = str(uuid.uuid4())

        def listening() -> bool:
            assert proc.poll() is None, (ops.project.directory / "flower.log").read_text()
            with ops.app.events.default_dispatcher(hostname="probe@test") as d:
                d.send("task-probe", uuid=probe)
            return get(f"{base}/task/{probe}") is not None

        wait_until(listening, timeout=60, interval=0.5, message="Flower never saw an event")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return str(response.read().decode())
    except (urllib.error.HTTPError, urllib.error.URLError, ConnectionError):
        return None


def test_flower_renders_a_wait_manual_task_page(ops: Ops, flower: str) -> None:
    task_id, node = zombie_with_step(ops)

    ops.admin.reap()

    def page() -> str | None:
        text = get(f"{flower}/task/{task_id}")
        return text if text is not None and "WAIT_MANUAL" in text else None

    text = html.unescape(wait_until(page, timeout=30, message="task page without WAIT_MANUAL"))
    assert "ops.charge" in text
    assert "Lease reason" in text and "outcome of step 'charge' unknown" in text
    assert f"celery -A proj lease show {task_id}" in text
    assert node in text  # filed under the worker that ran it
