"""Follow-ups a worker publishes (a chain's next task, a ``link`` callback, a chord's
body) are leased tasks too: Celery publishes them through its callback-retry path,
and their messages must be built and stored like any other."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from celery import chain, chord

from celery_lease import State, admin
from celery_lease.producer import follow_ups as _follow_ups
from celery_lease.producer.follow_ups import callback_id
from celery_lease.store import FollowUps

from ..crash.support import LeaseEnv
from ..helpers import wait_until

PROJECT = """
from celery_lease import LeasedTask

@app.task(base=LeasedTask, shared=False, name="f.double")
def double(x):
    return 2 * x

@app.task(base=LeasedTask, bind=True, shared=False, name="f.retry_once", max_retries=2)
def retry_once(self, x):
    if self.request.retries == 0:
        raise self.retry(countdown=0.1)
    return x + 1

@app.task(base=LeasedTask, shared=False, name="f.total")
def total(values):
    return sum(values)

@app.task(
    base=LeasedTask, bind=True, shared=False, name="f.manual", max_retries=0,
    on_exhausted="manual",
)
def manual(self, x):
    raise self.retry(countdown=0)
"""


@pytest.mark.parametrize("broker_url", ["redis", "amqp"], indirect=True)
def test_chain_link_and_chord_follow_ups_run_once_as_leased_tasks(
    lease_env: LeaseEnv, broker_url: str, tmp_path: Path
) -> None:
    p = lease_env.project(
        broker_url=broker_url,
        source=PROJECT,
        settings={"result_backend": f"db+sqlite:///{tmp_path / 'results.sqlite3'}"},
    )
    app = p.module.app
    double, total = app.tasks["f.double"], app.tasks["f.total"]
    p.worker(concurrency=2)

    chained = chain(double.s(1), double.s(), double.s()).apply_async()
    linked = double.apply_async((5,), link=double.s())
    # a retry keeps the callbacks of its delivery (Celery passes them to its retry)
    retried = app.tasks["f.retry_once"].apply_async((40,), link=double.s())
    chorded = chord(double.s(i) for i in range(4))(total.s())

    assert chained.get(timeout=60) == 8
    assert chorded.get(timeout=60) == 12
    assert linked.get(timeout=60) == 10
    assert retried.get(timeout=60) == 41
    # the callback is published by the worker after the result is stored: wait for it
    callback = wait_until(
        lambda: next((r for r in p.store.list_tasks(limit=100) if r.args == [41]), None),
        timeout=30,
        message="the retried task's link= callback was submitted",
    )
    assert p.wait_state(callback.id, State.SUCCEEDED, timeout=30).result == 82
    # each follow-up has its own row, SUCCEEDED on its first attempt, with its message
    followers = [chained.id, chained.parent.id, chorded.id]
    for task_id in followers:
        record = p.wait_state(task_id, State.SUCCEEDED, timeout=30)
        assert record.attempt == 1 and record.message is not None
    linked_rows = [r for r in p.store.list_tasks(limit=100) if r.args == [10]]
    assert len(linked_rows) == 1 and linked_rows[0].state is State.SUCCEEDED
    assert linked_rows[0].result == 20
    # every head's follow-ups were recorded with its outcome and marked published
    heads = [chained.parent.parent.id, chained.parent.id, linked.id, retried.id]
    heads += [r.id for r in chorded.parent.results]
    for task_id in heads:
        wait_until(
            lambda task_id=task_id: p.store.get(task_id).follow_ups_at is None,
            timeout=30,
            message=f"the follow-ups of {task_id} were marked published",
        )


@pytest.mark.parametrize("synced", [True, False], ids=["resolver", "reaper"])
def test_a_resolved_task_sends_its_follow_ups_once(
    lease_env: LeaseEnv, redis_url: str, synced: bool
) -> None:
    # resolve records the follow-ups with the row's SUCCEEDED; the process that resolved
    # publishes them (its notifier), or, when it has none, the worker's reaper does
    p = lease_env.project(
        broker_url=redis_url,
        source=PROJECT,
        settings={
            "result_backend": redis_url,
            "lease_result_backend_sync": synced,
            "lease_send_events": synced,
        },
    )
    app = p.module.app
    p.worker()
    head = app.tasks["f.manual"].apply_async((1,), link=app.tasks["f.double"].s())
    p.wait_state(head.id, State.WAIT_MANUAL, timeout=60)

    admin(app).resolve(head.id, reason="done by hand", result=7)
    resolved = p.get(head.id)
    assert resolved.state is State.SUCCEEDED
    follow_up = p.wait_state(callback_id(head.id, 0), State.SUCCEEDED, timeout=60)
    assert follow_up.result == 14 and follow_up.attempt == 1
    wait_until(
        lambda: p.store.get(head.id).follow_ups_at is None,
        timeout=30,
        message="the resolved task's follow-ups were marked published",
    )
    assert head.get(timeout=30) == 7  # the result a caller waits for was stored
    assert [r.args for r in p.store.list_tasks(limit=100) if r.name == "f.double"] == [[7]]


def _chord_members_succeeded(p: Any, n: int) -> tuple[Any, list[str]]:
    """A chord of ``n`` doubles whose members are recorded SUCCEEDED with follow-ups
    (as their workers would write them), none published yet: (the chord, member ids)."""
    app = p.module.app
    double, total = app.tasks["f.double"], app.tasks["f.total"]
    chorded = chord(double.s(i) for i in range(n))(total.s())
    members = [r.id for r in chorded.parent.results]
    for i, task_id in enumerate(members):
        claim = p.store.claim(task_id, "w", "worker:w")
        assert p.store.finish(
            claim.lease,
            State.SUCCEEDED,
            actor="worker:w",
            reason="ok",
            result=str(2 * i),
            follow_ups=True,
        )
    return chorded, members


def test_a_chord_member_replayed_while_its_callback_is_claimed_waits_for_the_claim(
    lease_env: LeaseEnv, redis_url: str
) -> None:
    # the reaper's replay of a chord member whose worker died inside the Redis
    # backend's part-return, holding the claim to publish the chord's callback: the
    # follow-ups stay recorded until the claim expires and a repeated part-return
    # publishes the callback; each member is counted once
    p = lease_env.project(
        broker_url=redis_url, source=PROJECT, settings={"result_backend": redis_url}
    )
    app = p.module.app
    chorded, members = _chord_members_succeeded(p, 2)

    def replay(task_id: str) -> tuple[int, int]:
        r = p.get(task_id)
        row = FollowUps(r.id, r.name, r.message, json.dumps(r.result), r.retries)
        return _follow_ups.replay(app, p.store, [row])

    claim_key = app.backend.get_key_for_group(chorded.parent.id, ".c")
    assert replay(members[0]) == (1, 0)  # counted: one of two, nothing to publish
    assert p.get(members[0]).follow_ups_at is None
    redis = app.backend.client
    redis.set(claim_key, "a-dead-workers-claim")
    assert replay(members[1]) == (0, 1)  # counted, but the callback's claim is taken
    assert p.get(members[1]).follow_ups_at is not None
    assert p.store.get(chorded.id) is None
    redis.delete(claim_key)  # the claim expired
    assert replay(members[1]) == (1, 0)
    body = p.get(chorded.id)  # the callback, published once with both results
    assert body.state is State.PENDING and body.args == [[0, 2]]
    assert p.get(members[1]).follow_ups_at is None
    assert redis.get(claim_key) == b"done"


def test_a_replay_over_its_time_budget_leaves_the_rest_for_the_next_sweep(
    lease_env: LeaseEnv, redis_url: str
) -> None:
    # the reaper's replay of a batch is bounded like one publish: past its budget (here
    # 0 s, so only the first row is replayed), the rows left keep their marks and are
    # counted as failed, and a later replay publishes them
    p = lease_env.project(
        broker_url=redis_url, source=PROJECT, settings={"result_backend": redis_url}
    )
    app = p.module.app
    chorded, members = _chord_members_succeeded(p, 3)

    def rows(ids: list[str]) -> list[FollowUps]:
        got = [p.get(task_id) for task_id in ids]
        return [FollowUps(r.id, r.name, r.message, json.dumps(r.result), r.retries) for r in got]

    assert _follow_ups.replay(app, p.store, rows(members), budget=0.0) == (1, 2)
    assert p.get(members[0]).follow_ups_at is None
    assert all(p.get(task_id).follow_ups_at is not None for task_id in members[1:])
    assert p.store.get(chorded.id) is None  # one of three members counted: no callback yet
    assert _follow_ups.replay(app, p.store, rows(members[1:]), budget=0.0) == (1, 1)
    assert _follow_ups.replay(app, p.store, rows(members[2:])) == (1, 0)
    body = p.get(chorded.id)  # the callback, published once with every result
    assert body.state is State.PENDING and body.args == [[0, 2, 4]]
    assert all(p.get(task_id).follow_ups_at is None for task_id in members)
