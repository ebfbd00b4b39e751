"""Parity through crashes: a pool child SIGKILLed, a hard time limit, the whole worker
SIGKILLed and restarted, and an operator's retry from WAIT_MANUAL; plain Celery tasks
and leased tasks side by side in one worker.

Plain Celery (early acks, its default) loses the task on each of these paths: the
result backend says FAILURE (``WorkerLostError``, ``TimeLimitExceeded``) or nothing
ever, a chain's follow-ups and ``link`` callbacks never run, ``link_error`` fires, a
chord fails or never completes. Those outcomes are checked too (they are what the docs
say plain Celery does). The leased task must end as a run without the crash would:
the body completes once, each follow-up runs once and in order, the chord callback
once, the header it was sent with is there on the re-run, and nothing a caller sees
(the result backend's writes, task events, Flower's task list and state filter) ever
says FAILURE for a task whose row is not FAILED.

A pool child is killed only once its task waits at its gate and, on the leased side,
the store shows the row RUNNING (see :meth:`tests.parity.support.Parity.wait_started`).
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
from celery import chain, chord

from celery_lease import State, admin

from ..crash.support import LeaseEnv
from .support import HEADER, Parity, Scenario, assert_parity, check_all, parity_env, project

pytestmark = [pytest.mark.crash, pytest.mark.timeout(400)]

CONCURRENCY = 6

BROKERS = pytest.mark.parametrize(
    ("broker_url", "backend"),
    [
        pytest.param("redis", "sqlite", id="redis-sqlite"),
        pytest.param("amqp", "sqlite", id="amqp-sqlite"),
    ],
    indirect=True,
)


def recovered(
    tasks: dict[str, int], done: dict[str, int], result: Any, **more: Any
) -> dict[str, Any]:
    """A leased outcome after one recovery: ``tasks`` started that often, ``done``
    finished that often, and the result backend was never given anything but
    SUCCESS."""
    return {"result": result, "starts": tasks, "done": done, **more}


def pool_kill() -> list[Scenario]:
    worker_lost = {"result": "WorkerLostError", "state": "FAILURE"}
    return [
        Scenario(
            "kill_chain",
            lambda s, t: chain(s.gate.s(1, tag=t), s.add.s(10, tag=t), s.add.s(100, tag=t))(),
            recovered(
                {"gate": 2, "add": 2},
                {"gate": 1, "add": 2},
                111,
                state="SUCCESS",
                order=["gate", "add", "add"],
                lineage=True,
                backend={"add": [["SUCCESS"], ["SUCCESS"]], "gate": [["SUCCESS"]]},
            ),
            plain={**worker_lost, "starts": {"gate": 1}, "done": {}},
        ),
        Scenario(
            "kill_link",
            lambda s, t: s.gate.apply_async(
                (5,),
                {"tag": t},
                link=s.collect.s(tag=t),
                link_error=s.on_error.s(tag=t),
                headers={HEADER: t},
            ),
            recovered(
                {"gate": 2, "collect": 1},
                {"gate": 1, "collect": 1},
                5,
                values=["5"],
                trace=["kill_link"],
                backend={"collect": [["SUCCESS"]], "gate": [["SUCCESS"]]},
            ),
            traced="gate",
            plain={
                **worker_lost,
                "starts": {"gate": 1, "on_error": 1},
                "done": {"on_error": 1},
                "backend": {"gate": [["FAILURE"]], "on_error": [["SUCCESS"]]},
            },
        ),
        Scenario(
            "kill_chord_member",
            lambda s, t: chord([s.gate.s(1, tag=t), s.add.s(2, 2, tag=t)], s.tsum.s(tag=t))(),
            recovered(
                {"gate": 2, "add": 1, "tsum": 1},
                {"gate": 1, "add": 1, "tsum": 1},
                5,
                state="SUCCESS",
                backend={"add": [["SUCCESS"]], "gate": [["SUCCESS"]], "tsum": [["SUCCESS"]]},
            ),
            plain={
                "result": "ChordError",
                "state": "FAILURE",
                "starts": {"gate": 1, "add": 1},
                "done": {"add": 1},
            },
        ),
    ]


def hard_time_limit() -> list[Scenario]:
    return [
        Scenario(
            "hard_time_limit",
            # overruns its 2 s hard limit on the first run only: the pool child is killed
            lambda s, t: s.slow_first.apply_async(
                (7,),
                {"tag": t},
                time_limit=2,
                link=s.collect.s(tag=t),
                link_error=s.on_error.s(tag=t),
            ),
            recovered(
                {"slow_first": 2, "collect": 1},
                {"slow_first": 1, "collect": 1},
                7,
                state="SUCCESS",
                values=["7"],
                backend={"collect": [["SUCCESS"]], "slow_first": [["SUCCESS"]]},
            ),
            # plain Celery: FAILURE, the callback never runs; its errback fires (once for
            # the time limit, and again when the pool reports the killed child: how
            # often depends on which of the two the pool notices first)
            plain={"result": "TimeLimitExceeded", "state": "FAILURE", "values": []},
        ),
    ]


def worker_kill() -> list[Scenario]:
    gone = {"result": "<PENDING>", "starts": {"gate": 1}, "done": {}}
    return [
        Scenario(
            "worker_kill_chain",
            lambda s, t: chain(s.gate.s(1, tag=t), s.add.s(10, tag=t))(),
            recovered(
                {"gate": 2, "add": 1},
                {"gate": 1, "add": 1},
                11,
                order=["gate", "add"],
                lineage=True,
                backend={"add": [["SUCCESS"]], "gate": [["SUCCESS"]]},
            ),
            plain=gone,
        ),
        Scenario(
            "worker_kill_link",
            lambda s, t: s.gate.apply_async(
                (5,), {"tag": t}, link=s.collect.s(tag=t), headers={HEADER: t}
            ),
            recovered(
                {"gate": 2, "collect": 1},
                {"gate": 1, "collect": 1},
                5,
                values=["5"],
                trace=["worker_kill_link"],
            ),
            traced="gate",
            plain=gone,
        ),
    ]


def tagged(scenarios: list[Scenario]) -> list[Scenario]:
    for s in scenarios:
        s.tag = s.name
    return scenarios


def kill_children(
    parity: Parity, scenarios: list[Scenario], task: str = "gate", step: str | None = None
) -> None:
    """SIGKILL the pool child running each scenario's gated task, on each side (once
    the leased row is RUNNING, and ``step`` recorded as started)."""
    assert parity.worker is not None
    for s in scenarios:
        for prefix in s.handles:
            effect = parity.wait_started(parity.sides[prefix], s.tag, task, step=step)
            assert effect.pid in parity.worker.children(), (s.name, prefix, effect)
            os.kill(effect.pid, signal.SIGKILL)


@BROKERS
def test_pool_kill_time_limit_worker_kill_and_operator_retry(
    lease_env: LeaseEnv, broker_url: str, redis_url: str
) -> None:
    # a TTL far longer than the test: only the fast paths (the worker sees its child
    # die, a restarted worker expires its predecessor's leases) may recover a task
    p = project(lease_env, broker_url, redis_url, ttl=60.0)
    with parity_env(p, redis_url) as parity:
        worker = parity.start_worker(CONCURRENCY)
        sides = list(parity.sides.values())
        leased = [parity.sides["l"]]

        # pool child SIGKILLed while its task runs; then a hard time limit
        killed = tagged(pool_kill())
        for s in killed:
            for side in sides:
                parity.gate(side, s.tag)
            s.run(sides)
        kill_children(parity, killed)
        for s in killed:
            for side in sides:
                p.gates.release(f"{side.prefix}.gate:{s.tag}")
        limited = tagged(hard_time_limit())
        for s in limited:
            s.run(sides)
        failures = check_all(parity, [*killed, *limited], timeout=30, concurrency=CONCURRENCY)

        # the whole worker SIGKILLed while the tasks run, restarted under its node name
        lost = tagged(worker_kill())
        for s in lost:
            for side in sides:
                parity.gate(side, s.tag)
            s.run(sides)
        for s in lost:
            for side in sides:
                parity.wait_started(side, s.tag)
        worker.kill_group(signal.SIGKILL)
        worker.wait_group_gone()
        for s in lost:
            for side in sides:
                p.gates.release(f"{side.prefix}.gate:{s.tag}")
        worker.restart()
        worker.wait_ready(timeout=60, store=p.store)
        failures += check_all(parity, lost, timeout=30, concurrency=CONCURRENCY)

        # a pool child killed inside a non-idempotent step: WAIT_MANUAL, shown as such
        # (never FAILURE); an operator's retry then runs the chain on, once
        manual = Scenario(
            "operator_retry",
            lambda s, t: chain(s.charge.s(1, tag=t), s.add.s(10, tag=t))(),
            {"starts": {"charge": 1}, "done": {}, "rows": {"charge": ["WAIT_MANUAL"]}},
            tag="operator_retry",
        )
        parity.gate(leased[0], manual.tag, "charge")
        manual.run(leased)
        kill_children(parity, [manual], task="charge", step="charge")
        failures += check_all(parity, [manual], timeout=30, concurrency=CONCURRENCY)
        head = next(info["id"] for short, info in parity.starts("l", manual.tag))
        state = p.get(head).state
        p.gates.release(f"l.charge:{manual.tag}")
        if state is State.WAIT_MANUAL:
            admin(p.module.app).retry(head, actor="parity-test", reason="checked: not charged")
            manual.expected = recovered(
                {"charge": 2, "add": 1},
                {"charge": 1, "add": 1},
                11,
                state="SUCCESS",
                order=["charge", "add"],
                lineage=True,
                rows={"add": ["SUCCEEDED"], "charge": ["SUCCEEDED"]},
                backend={"add": [["SUCCESS"]], "charge": [["SUCCESS"]]},
            )
            manual.fields = tuple(dict.fromkeys((*manual.fields, *manual.expected)))
            failures += check_all(parity, [manual], timeout=30, concurrency=CONCURRENCY)
        else:
            failures.append(f"[operator_retry] the head is {state.value}, not WAIT_MANUAL")
        assert_parity(failures)
