"""Issue 14, durable pauses per queue and per task name, with real workers.

A paused task name: its deliveries are dropped before the claim, the rows stay PENDING
(unpublished, left alone by the reaper) and run once after the resume; other tasks
run meanwhile. A paused queue: the worker cancels its consumer (checked with
``inspect().active_queues()``), the message stays in the broker, and a worker started
during the pause does not consume it. Every pause and resume is in the pauses' log.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from celery_lease import State, admin
from celery_lease._runtime import runtime
from celery_lease.store._operator import HELD

from ..crash.support import LeasedProject, LeaseEnv, queue_depth
from ..helpers import flush_published, wait_until

FAST = {"heartbeat_interval": 0.2, "ttl": 2.0, "reaper_interval": 0.2, "publish_grace": 0.5}


def test_pause_and_resume_are_logged_with_who_and_why(lease_env: LeaseEnv) -> None:
    p = lease_env.project()
    api = admin(p.module.app)
    assert api.pause(task="t.add", reason="partner API down", actor="alice")
    assert not api.pause(task="t.add", reason="again", actor="bob")  # already paused
    assert api.pause(queue="exports", reason="maintenance", actor="alice")
    assert [(x.kind, x.target, x.actor, x.reason) for x in api.pauses()] == [
        ("task", "t.add", "alice", "partner API down"),
        ("queue", "exports", "alice", "maintenance"),
    ]
    assert api.resume(task="t.add", reason="partner API back", actor="carol")
    assert not api.resume(task="t.add", reason="twice", actor="carol")
    log = [(e.action, e.kind, e.target, e.actor, e.reason) for e in api.pause_history()]
    assert log == [
        ("resume", "task", "t.add", "carol", "partner API back"),
        ("pause", "queue", "exports", "alice", "maintenance"),
        ("pause", "task", "t.add", "alice", "partner API down"),
    ]
    for bad in (
        {"task": "t.add", "reason": ""},
        {"reason": "no target"},
        {"task": "t.add", "queue": "q", "reason": "both"},
        {"task": " ", "reason": "empty"},
    ):
        with pytest.raises(ValueError):
            api.pause(**bad)


def wait_held(p: LeasedProject, task_id: str) -> None:
    """Wait until a delivery of ``task_id`` was dropped by the pause (row held)."""

    def held() -> bool:
        record = p.get(task_id)
        assert record.state is State.PENDING, record.state
        return record.published_at == HELD and record.attempt == 0

    wait_until(held, timeout=30, message=f"{task_id} held by the pause")


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [
        pytest.param("redis", "sqlite", id="redis-sqlite"),
        pytest.param("redis", "postgresql", id="redis-postgresql", marks=pytest.mark.postgres),
        pytest.param("amqp", "sqlite", id="amqp-sqlite"),
    ],
    indirect=True,
)
def test_a_paused_task_name_is_held_not_lost_across_a_restart(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = lease_env.project(broker_url=broker_url, **FAST)
    api = admin(p.module.app)
    assert api.pause(task="t.add", reason="partner API down", actor="alice")
    # a node name of its own: on RabbitMQ the remote-control queue is per node name
    worker = p.worker(f"held-{uuid.uuid4().hex[:8]}", concurrency=2)
    first = p.submit("t.add", 1, 1)
    wait_held(p, first)
    p.wait_log(worker, r"delivery dropped without running: task t\.add is paused")
    # other task names run meanwhile
    other = p.submit("t.work", "other")
    p.wait_state(other, State.SUCCEEDED)
    # the reaper (every 0.2 s) leaves the held row alone well past the 0.5 s grace
    since = p.store.now()
    wait_until(lambda: (p.store.now() - since).total_seconds() > 2.0, message="2 s pass")
    assert p.get(first).published_at == HELD and p.external.count("add") == 0
    assert p.store.history(first)[-1].to_state is State.PENDING  # never claimed

    # the pause survives a restart: a new incarnation holds the next delivery too
    worker.restart()
    worker.wait_ready(timeout=60, store=p.store)
    second = p.submit("t.add", 2, 2)
    wait_held(p, second)
    assert p.external.count("add") == 0

    assert api.resume(task="t.add", reason="partner API back", actor="carol")
    for task_id in (first, second):
        p.wait_state(task_id, State.SUCCEEDED)
    assert p.external.count("add") == 2  # each ran once
    assert [e.action for e in api.pause_history()] == ["resume", "pause"]


def active_queues(p: LeasedProject, nodename: str) -> list[str] | None:
    replies = p.module.app.control.inspect([nodename], timeout=2.0).active_queues() or {}
    found = replies.get(nodename)
    return None if found is None else [q["name"] for q in found]


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [
        pytest.param("redis", "sqlite", id="redis-sqlite"),
        pytest.param("amqp", "postgresql", id="amqp-postgresql", marks=pytest.mark.postgres),
    ],
    indirect=True,
)
def test_a_paused_queue_is_not_consumed_even_by_a_restarted_worker(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    # a message waiting in a paused queue is not lost: it must not be re-published
    p = lease_env.project(broker_url=broker_url, **{**FAST, "republish_after": 600.0})
    queue = p.project.queue
    api = admin(p.module.app)
    # a node name of its own: remote control (inspect) shares the broker's vhost
    worker = p.worker(f"pause-{uuid.uuid4().hex[:8]}")
    wait_until(lambda: active_queues(p, worker.nodename) == [queue], timeout=30)

    assert api.pause(queue=queue, reason="exports partner down", actor="alice")
    p.wait_log(worker, rf"queue {queue} is paused: no longer consumed")
    wait_until(lambda: active_queues(p, worker.nodename) == [], timeout=30, message="cancelled")
    # stopped before the submission: on Redis a read the worker issued before the cancel
    # may still take a message sent right after it (held for the pause, then: not lost)
    worker.stop()
    task_id = p.submit("t.add", 1, 2)
    flush_published(runtime(p.module.app).store)  # recorded as published now
    assert queue_depth(broker_url, queue) == 1  # the message waits in the broker
    assert p.get(task_id).state is State.PENDING

    worker.restart()
    worker.wait_ready(timeout=60, store=p.store)
    p.wait_log(worker, rf"starts without the paused queues {queue}")
    assert active_queues(p, worker.nodename) == []
    assert queue_depth(broker_url, queue) == 1 and p.external.count("add") == 0

    assert api.resume(queue=queue, reason="partner back", actor="carol")
    p.wait_log(worker, rf"queue {queue} was resumed: consumed again")
    p.wait_state(task_id, State.SUCCEEDED)
    assert p.external.count("add") == 1
    wait_until(lambda: active_queues(p, worker.nodename) == [queue], timeout=30)


def test_the_pause_commands(lease_env: LeaseEnv) -> None:
    from celery.bin.base import CLIContext
    from click.testing import CliRunner

    from celery_lease.cli import lease

    p = lease_env.project()
    obj = CLIContext(app=p.module.app, no_color=True, workdir=None, quiet=True)

    def run(*args: str) -> Any:
        return CliRunner().invoke(lease, list(args), obj=obj)

    assert run("pause", "--task", "t.add").exit_code == 2  # --reason is required
    assert run("pause", "--reason", "why").exit_code == 2  # a target is required
    assert run("pause", "-q", "a", "-t", "b", "-r", "why").exit_code == 2  # only one
    done = run("pause", "--queue", "exports", "--reason", "partner down", "--actor", "alice")
    assert done.exit_code == 0 and "queue exports paused" in done.output
    again = run("pause", "--queue", "exports", "-r", "again", "--json")
    assert json.loads(again.output) == {
        "kind": "queue",
        "target": "exports",
        "paused": True,
        "changed": False,
    }
    listed = run("pauses")
    assert "exports" in listed.output and "alice" in listed.output
    assert "partner down" in listed.output
    assert json.loads(run("pauses", "--json").output)[0]["target"] == "exports"
    resumed = run("resume", "-q", "exports", "-r", "partner back", "--actor", "bob")
    assert resumed.exit_code == 0 and "queue exports resumed" in resumed.output
    assert "was not paused" in run("resume", "-q", "exports", "-r", "twice").output
    history = run("pauses", "--history").output.splitlines()
    assert "resume" in history[1] and "bob" in history[1] and "partner back" in history[1]
    assert "pause" in history[2] and "alice" in history[2]
    assert "Nothing is paused" in run("pauses").output
