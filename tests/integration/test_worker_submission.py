"""Issue 2, submission side, against real brokers, stores and workers: the row is written
before the message, arguments that cannot be stored publish nothing, ``dedup_key``
returns the first task (also under a race of many processes), and a message sent by
name without a row is adopted at claim.
"""

from __future__ import annotations

import multiprocessing
from collections import Counter
from typing import Any

import pytest

from celery_lease import NotSerializable, State

from ..crash.support import CLEAN_RUN, LeaseEnv, queue_depth, submit_in_process
from ..helpers import wait_until


def combo(broker: str, backend: str) -> Any:  # a pytest ParameterSet
    marks = [pytest.mark.postgres] if backend == "postgresql" else []
    return pytest.param(broker, backend, id=f"{broker}-{backend}", marks=marks)


def on(*combos: Any) -> pytest.MarkDecorator:
    return pytest.mark.parametrize(("broker_url", "backend"), list(combos), indirect=True)


@on(combo("redis", "sqlite"), combo("amqp", "postgresql"))
def test_unstorable_arguments_raise_and_publish_nothing(
    lease_env: LeaseEnv, broker_url: str, queue_name: str
) -> None:
    p = lease_env.project(broker_url=broker_url)
    add = p.module.app.tasks["t.add"]
    # what the task's serializer (JSON) refuses, as plain Celery's publish would
    with pytest.raises(NotSerializable, match=r"argument 0 of t\.add .*'json'"):
        add.apply_async((object(), 1), task_id="unstorable-args")
    with pytest.raises(NotSerializable, match=r"keyword argument 'b' of t\.add"):
        add.apply_async((1,), {"b": object()}, task_id="unstorable-kwargs")

    assert p.store.get("unstorable-args") is None
    assert p.store.get("unstorable-kwargs") is None
    assert p.store.list_tasks() == []
    assert queue_depth(broker_url, queue_name) == 0

    # the same path with storable arguments does publish (the check above can fail)
    good = p.submit("t.add", 1, 2)
    assert p.get(good).state is State.PENDING
    wait_until(lambda: queue_depth(broker_url, queue_name) == 1, message="one message queued")


@on(combo("amqp", "postgresql"))
def test_dedup_key_returns_the_first_task_and_publishes_nothing(
    lease_env: LeaseEnv, broker_url: str, queue_name: str
) -> None:
    p = lease_env.project(broker_url=broker_url)
    add = p.module.app.tasks["t.add"]
    first = add.apply_async((1, 2), dedup_key="report:1001")
    second = add.apply_async((5, 6), dedup_key="report:1001")
    third = add.delay(7, 8)  # no key: a task of its own

    assert second.id == first.id and third.id != first.id
    rows = p.store.list_tasks(name="t.add")
    assert sorted(r.id for r in rows) == sorted([first.id, third.id])
    rec = p.get(first.id)
    assert rec.dedup_key == "report:1001" and rec.args == [1, 2]
    wait_until(lambda: queue_depth(broker_url, queue_name) == 2, message="two messages queued")

    p.worker()
    assert p.wait_state(first.id, State.SUCCEEDED).result == 3
    assert p.wait_state(third.id, State.SUCCEEDED).result == 15
    p.drain()
    assert sorted(e.payload or "" for e in lease_env.external.effects("add")) == [
        "0+0",
        "1+2",
        "7+8",
    ]
    assert p.trail(first.id) == CLEAN_RUN


@on(combo("redis", "postgresql"), combo("amqp", "sqlite"))
def test_concurrent_dedup_submissions_from_many_processes(
    lease_env: LeaseEnv, broker_url: str, queue_name: str
) -> None:
    processes, per_process = 8, 20
    keys = [f"key-{i}" for i in range(5)]
    p = lease_env.project(broker_url=broker_url)

    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    project = p.project
    children = [
        ctx.Process(
            target=submit_in_process,
            args=(
                str(project.path),
                project.module,
                project.env,
                "t.work",
                [keys[(n + i) % len(keys)] for i in range(per_process)],
                barrier,
                results,
            ),
        )
        for n in range(processes)
    ]
    for child in children:
        child.start()
    reports = [results.get(timeout=120) for _ in children]
    for child in children:
        child.join(30)
        assert child.exitcode == 0
    results.close()
    results.join_thread()

    submitted = [pair for report in reports for pair in report]
    assert len(submitted) == processes * per_process, reports
    ids_by_key: dict[str, set[str]] = {}
    for key, task_id in submitted:
        ids_by_key.setdefault(key, set()).add(task_id)
    assert {k: len(v) for k, v in ids_by_key.items()} == {k: 1 for k in keys}
    rows = p.store.list_tasks(name="t.work")
    assert sorted(r.dedup_key or "" for r in rows) == keys
    assert {r.id for r in rows} == {next(iter(v)) for v in ids_by_key.values()}
    # one message per key: every other submission published nothing
    wait_until(lambda: queue_depth(broker_url, queue_name) == len(keys), message="5 messages")

    p.worker(concurrency=2)
    for r in rows:
        p.wait_state(r.id, State.SUCCEEDED)
    p.drain(2)
    ext = lease_env.external
    assert Counter(e.name for e in ext.effects() if e.name != "add") == Counter(
        {f"{prefix}:{k}": 1 for k in keys for prefix in ("start", "done")}
    )
    for r in rows:
        assert p.get(r.id).attempt == 1 and p.trail(r.id) == CLEAN_RUN


@on(combo("redis", "sqlite"))
def test_message_sent_by_name_is_adopted_at_claim_and_runs_once(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = lease_env.project(broker_url=broker_url)
    worker = p.worker()
    producer = p.project.producer()  # a bare Celery app: knows nothing of celery-lease
    producer.send_task("t.add", args=[20, 22], task_id="sent-by-name")

    rec = p.wait_state("sent-by-name", State.SUCCEEDED)
    assert rec.result == 42 and rec.attempt == 1 and rec.args == [20, 22]
    assert rec.owner == p.incarnation(worker)
    trail = p.store.history("sent-by-name")
    assert p.trail("sent-by-name") == CLEAN_RUN
    assert trail[0].reason is not None and trail[0].reason.startswith("adopted")

    # the same message again (a duplicate from the other service): dropped, not re-run
    producer.send_task("t.add", args=[20, 22], task_id="sent-by-name")
    p.drain()
    worker.wait_log(r"sent-by-name\]: delivery dropped without running \(task is SUCCEEDED\)")
    assert [e.payload for e in lease_env.external.effects("add")] == ["20+22", "0+0"]
    assert p.trail("sent-by-name") == CLEAN_RUN
