"""The worker's reconciliation rules, against a real store (SQLite file, PostgreSQL).

``tests/crash/test_lost_outcome.py`` shows the whole path with real workers; here the
rules of one round are driven one by one: the statement's grace (a row younger than
its TTL is not read), two rounds before a lease is given back, the attempt seen in
both, what is in hand (Celery's own request state of this process), a fenced worker.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from celery.worker import state as worker_state

from celery_lease import State
from celery_lease._incarnation import Incarnation
from celery_lease.store import Claim, NewTask, Store
from celery_lease.worker.main.reconcile import Reconciler

from ..helpers import wait_until


def incarnation(store: Store) -> Incarnation:
    inc = Incarnation(uuid.uuid4().hex, f"n-{uuid.uuid4().hex[:6]}@host", "host", os.getpid())
    store.register_worker(inc.id, inc.nodename, inc.hostname, inc.pid)
    return inc


def running(store: Store, inc: Incarnation, *, lease_ttl: float = 0.1) -> str:
    task_id, created = store.submit(
        NewTask(
            id=uuid.uuid4().hex,
            name="tests.job",
            args="[]",
            kwargs="{}",
            options="{}",
            lease_ttl=lease_ttl,
            max_recoveries=5,
        )
    )
    assert created
    assert isinstance(store.claim(task_id, inc.id, inc.actor), Claim)
    return task_id


def past_ttl(store: Store, inc: Incarnation, *task_ids: str) -> None:
    """Wait until the database's clock has taken ``task_ids`` past their TTL."""
    wait_until(
        lambda: {t for t, _ in store.owned_past_ttl(inc.id)} >= set(task_ids),
        timeout=10,
        message="the rows claimed longer ago than their TTL",
    )


@pytest.fixture
def hand() -> Iterator[set[str]]:
    """Task ids put in Celery's request state of this process (as a worker's main
    process holds them), taken out at the end."""
    held: set[str] = set()
    yield held
    for task_id in held:
        worker_state.requests.pop(task_id, None)


def take(hand: set[str], task_id: str) -> None:
    worker_state.requests[task_id] = object()
    hand.add(task_id)


def test_a_row_owned_and_not_in_hand_is_given_back_at_the_second_round(
    store: Store, hand: set[str]
) -> None:
    inc = incarnation(store)
    lost = running(store, inc)
    held = running(store, inc)
    take(hand, held)
    past_ttl(store, inc, lost, held)
    reconciler = Reconciler(store, inc)

    assert reconciler.round(None, None) == []  # once: a suspect only
    assert store.get(lost).state is State.RUNNING  # type: ignore[union-attr]
    (expiry,) = reconciler.round(None, None)
    assert (expiry.task_id, expiry.to_state) == (lost, State.RETRY_WAIT)
    timeout = next(r for r in store.history(lost) if r.to_state is State.TIMEOUT)
    assert timeout.actor == inc.actor and timeout.attempt == 1
    assert f"owned by worker {inc.nodename} but not running there" in timeout.reason
    assert reconciler.given_back == 1
    # the task in hand is never given back, however many rounds
    for _ in range(3):
        assert reconciler.round(None, None) == []
    rec = store.get(held)
    assert rec is not None and (rec.state, rec.attempt) == (State.RUNNING, 1)


def test_a_row_younger_than_its_ttl_is_not_read(store: Store) -> None:
    inc = incarnation(store)
    young = running(store, inc, lease_ttl=600.0)
    old = running(store, inc)
    past_ttl(store, inc, old)
    assert [t for t, _ in store.owned_past_ttl(inc.id)] == [old]
    reconciler = Reconciler(store, inc)
    reconciler.round(None, None)
    reconciler.round(None, None)
    rec = store.get(young)
    assert rec is not None and rec.state is State.RUNNING


def test_a_row_claimed_again_between_rounds_needs_two_rounds_of_its_new_attempt(
    store: Store,
) -> None:
    inc = incarnation(store)
    task_id = running(store, inc)
    past_ttl(store, inc, task_id)
    reconciler = Reconciler(store, inc)
    assert reconciler.round(None, None) == []  # attempt 1 is a suspect
    # meanwhile its lease was expired by another path, and the task claimed again here
    store.expire(actor="test", reason="lost child", task_ids=[task_id], only_expired=False)
    store.take_due_retries(actor="test")
    assert isinstance(store.claim(task_id, inc.id, inc.actor), Claim)
    wait_until(
        lambda: (task_id, 2) in store.owned_past_ttl(inc.id),
        timeout=10,
        message="attempt 2 past its TTL",
    )
    assert reconciler.round(None, None) == []  # attempt 2 seen once: not attempt 1's
    rec = store.get(task_id)
    assert rec is not None and (rec.state, rec.attempt) == (State.RUNNING, 2)
    (expiry,) = reconciler.round(None, None)
    assert expiry.task_id == task_id


def test_a_fenced_worker_does_not_reconcile(store: Store) -> None:
    inc = incarnation(store)
    task_id = running(store, inc)
    past_ttl(store, inc, task_id)
    reconciler = Reconciler(store, inc)
    assert reconciler.round(None, None) == []
    inc.flags.fenced = True  # its heartbeat's recovery expires what it holds
    assert reconciler.round(None, None) == []
    inc.flags.fenced = False
    assert reconciler.round(None, None) == []  # the fence forgot the suspects: once again
    (expiry,) = reconciler.round(None, None)
    assert expiry.task_id == task_id
