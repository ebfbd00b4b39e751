"""Crash-point matrix row 32: the whole worker dies after a task's SUCCEEDED outcome and
before its follow-ups are published (the chain's next task, a ``link`` callback, a
chord member's part-return and so the chord's callback).

The ``before_follow_ups`` crash point fires in the pool process right after the
outcome's commit and SIGKILLs the worker's main process first, as a node lost at that
line. The outcome recorded the follow-ups (``follow_ups_at``); the redelivered head is
dropped at claim (its row is final: matrix row 8), so only the record can bring them
back: the restarted worker's embedded reaper publishes them after
``lease_publish_grace``. Each follow-up runs once (counting stub), the head is not run
again, and the chord's callback runs once with every member's result.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
from celery import chain, chord

from celery_lease import State
from celery_lease.producer.follow_ups import callback_id
from celery_lease.testing import wait_until

from .support import TASKS, LeasedProject, LeaseEnv

PROJECT = (
    TASKS
    + """

@app.task(base=LeasedTask, bind=True, shared=False, name="f.head")
def head(self, key):
    external.call(f"head:{key}")
    return key


@app.task(base=LeasedTask, bind=True, shared=False, name="f.follow")
def follow(self, value, tag):
    external.call(f"follow:{tag}", payload=value)
    return value


@app.task(base=LeasedTask, bind=True, shared=False, name="f.gather")
def gather(self, values, tag):
    external.call(f"gather:{tag}", payload=values)
    return sorted(values)
"""
)

CRASH = {"CELERY_LEASE_CRASH_AT": "before_follow_ups"}


def chain_case(p: LeasedProject, key: str) -> tuple[list[str], str, str]:
    """A two-step chain; (heads, follow-up id, the follow-up's effect)."""
    tasks = p.module.app.tasks
    result = chain(tasks["f.head"].s(key), tasks["f.follow"].s(tag=key)).apply_async()
    return [str(result.parent.id)], str(result.id), f"follow:{key}"


def link_case(p: LeasedProject, key: str) -> tuple[list[str], str, str]:
    """A ``link=`` callback (no id of its own: it gets a fixed one)."""
    tasks = p.module.app.tasks
    result = tasks["f.head"].apply_async((key,), link=tasks["f.follow"].s(tag=key))
    return [str(result.id)], callback_id(str(result.id), 0), f"follow:{key}"


def chord_case(p: LeasedProject, key: str) -> tuple[list[str], str, str]:
    """A chord of three members (the first to succeed takes the worker down)."""
    tasks = p.module.app.tasks
    header = [tasks["f.head"].s(f"{key}-{i}") for i in range(3)]
    result = chord(header)(tasks["f.gather"].s(tag=key))
    heads = [str(r.id) for r in result.parent.results]
    return heads, str(result.id), f"gather:{key}"


CASES: dict[str, Callable[[LeasedProject, str], tuple[list[str], str, str]]] = {
    "chain": chain_case,
    "link": link_case,
    "chord": chord_case,
}


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("broker", ["redis", "amqp"])
def test_row32_worker_killed_after_the_outcome_before_its_follow_ups(
    lease_env: LeaseEnv, request: pytest.FixtureRequest, broker: str, kind: str, redis_url: str
) -> None:
    p = lease_env.project(
        broker_url=request.getfixturevalue(f"{broker}_url"),
        source=PROJECT,
        settings={"result_backend": redis_url},
    )
    crashing = p.worker("w1", env=CRASH)
    key = uuid.uuid4().hex[:8]
    heads, follow_up, effect = CASES[kind](p, key)

    wait_until(lambda: not crashing.is_alive(), timeout=60, message="the worker never died")
    # a head succeeded and recorded its follow-ups, and none of them was published
    done = [r for r in map(p.store.get, heads) if r is not None and r.state is State.SUCCEEDED]
    assert len(done) == 1 and done[0].follow_ups_at is not None
    assert p.store.get(follow_up) is None
    assert p.external.count(effect) == 0

    p.worker("w1")  # restarted: the redelivered head is dropped, the reaper sends them
    final = p.wait_state(follow_up, State.SUCCEEDED, timeout=60)
    # the head that died after its outcome was not run again (a chord's other members
    # may have been claimed ahead by the dying worker: their leases expired, and they
    # ran once, on their second attempt)
    assert p.get(done[0].id).attempt == 1
    for head_id in heads:
        p.wait_state(head_id, State.SUCCEEDED, timeout=60)
        wait_until(
            lambda head_id=head_id: p.get(head_id).follow_ups_at is None,
            timeout=30,
            message=f"the follow-ups of {head_id} were marked published",
        )
    p.drain()  # whatever was published twice has been delivered by now
    assert final.attempt == 1
    assert p.external.count(effect) == 1  # the follow-up ran once
    if kind == "chord":
        assert final.result == sorted(f"{key}-{i}" for i in range(3))
        assert [p.external.count(f"head:{key}-{i}") for i in range(3)] == [1, 1, 1]
    else:
        assert final.result == key
        assert p.external.count(f"head:{key}") == 1
    assert ("SUCCEEDED", "SUCCEEDED") not in p.trail(heads[0])
