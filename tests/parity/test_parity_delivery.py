"""Parity without a crash: each Celery feature on its first run, through ``self.retry()``
and ``autoretry_for``, with its message lost in the broker, and submitted while the
broker is down; plain Celery tasks and leased tasks side by side in one worker.

Paths, in the order the test drives them:

* **message lost**: submitted while no worker runs, then the broker queue is purged.
  Plain Celery never runs these; a leased task's row is re-published by the reaper
  (``lease_republish_after``) and must run as if nothing happened: chain follow-ups,
  ``link`` callbacks and the chord callback once, the header and time limits it was
  sent with, an ``expires`` that passed meanwhile honoured (not run), a countdown kept.
* **broker down at submit**: a producer whose broker connection is refused (a TCP
  proxy in front of the real broker, cut). Plain Celery's ``apply_async`` raises; a
  leased task's row is written and published by the reaper once a worker's broker
  answers, with the whole message.
* **first run** of every feature, and **retries** (``self.retry`` with a countdown, a
  naive and an aware ETA; ``autoretry_for``) inside a chain, with ``link``, in a chord
  header and with a custom header: plain Celery succeeds, so the leased outcome must
  equal plain's (results, states seen by the result backend and Flower, follow-ups
  run once, in order, ``parent_id``/``root_id``).

One worker per broker runs every scenario at once; each is checked on its own (see
:func:`tests.parity.support.check_all`).
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from celery import chain, chord, group

from celery_lease.config import broker_origin

from ..crash.faults import TcpProxy
from ..crash.support import LeaseEnv
from .support import (
    HEADER,
    Scenario,
    Side,
    assert_parity,
    check_all,
    parity_env,
    project,
    purge,
)

CONCURRENCY = 4
#: The lease TTL of these projects (no process is killed here).
LONG_TTL = 10.0

MATRIX = pytest.mark.parametrize(
    ("broker_url", "backend"),
    [
        pytest.param("redis", "sqlite", id="redis-sqlite"),
        pytest.param("amqp", "sqlite", id="amqp-sqlite"),
        pytest.param("redis", "postgresql", id="redis-postgresql", marks=pytest.mark.postgres),
    ],
    indirect=True,
)


def ok(tasks: dict[str, int], result: Any, **more: Any) -> dict[str, Any]:
    """The outcome of a run in which each task in ``tasks`` ran (and finished) that often."""
    return {"result": result, "starts": tasks, "done": tasks, **more}


def lost(**more: Any) -> dict[str, Any]:
    """What plain Celery shows for a task whose message was lost: nothing ran."""
    return {"result": "<PENDING>", "starts": {}, "done": {}, **more}


# -- first run ------------------------------------------------------------------------------


def first_run(now: float) -> list[Scenario]:
    later = now + 1.5
    aware = datetime.fromtimestamp(later, timezone.utc)
    past = datetime.fromtimestamp(now - 5, timezone.utc)
    return [
        Scenario(
            "chain",
            lambda s, t: chain(s.add.s(1, 2, tag=t), s.add.s(10, tag=t), s.add.s(100, tag=t))(),
            ok({"add": 3}, 113, state="SUCCESS", order=["add"] * 3, lineage=True),
        ),
        Scenario(
            "group",
            lambda s, t: group(s.add.s(i, i, tag=t) for i in range(3))(),
            ok({"add": 3}, [0, 2, 4]),
        ),
        Scenario(
            "chord",
            lambda s, t: chord([s.add.s(i, i, tag=t) for i in range(3)], s.tsum.s(tag=t))(),
            ok({"add": 3, "tsum": 1}, 6, state="SUCCESS"),
        ),
        Scenario(
            "link",
            lambda s, t: s.add.apply_async((1, 2), {"tag": t}, link=s.collect.s(tag=t)),
            ok({"add": 1, "collect": 1}, 3, values=["3"]),
        ),
        Scenario(
            "link_error",
            lambda s, t: s.boom.apply_async(kwargs={"tag": t}, link_error=s.on_error.s(tag=t)),
            {
                "result": "ValueError",
                "state": "FAILURE",
                "starts": {"boom": 1, "on_error": 1},
                "done": {"on_error": 1},
            },
        ),
        Scenario(
            "starmap",
            lambda s, t: s.add.starmap([(1, 1, t), (2, 2, t)]).apply_async(),
            ok({"add": 2}, [2, 4]),
        ),
        Scenario(
            "chunks",
            lambda s, t: s.add.chunks([(i, i, t) for i in range(4)], 2).apply_async(),
            ok({"add": 4}, [[0, 2], [4, 6]]),
        ),
        Scenario(
            "expires",
            lambda s, t: s.add.apply_async((1, 1), {"tag": t}, expires=past),
            # never run. Plain Celery: REVOKED on Redis (the worker drops it); on
            # RabbitMQ the broker drops it (AMQP expiration) and the state stays PENDING.
            # Leased: the row says CANCELLED, and a message the broker dropped is not
            # a lost one to publish again
            {"starts": {}, "done": {}, "row": "CANCELLED"},
            plain={"starts": {}, "done": {}},
        ),
        Scenario(
            "countdown",
            lambda s, t: s.add.apply_async((2, 2), {"tag": t}, countdown=later - time.time()),
            ok({"add": 1}, 4, not_before=True),
            not_before=later,
        ),
        Scenario(
            "eta_aware",
            lambda s, t: s.add.apply_async((2, 3), {"tag": t}, eta=aware),
            ok({"add": 1}, 5, not_before=True),
            not_before=later,
        ),
        Scenario(
            "eta_naive",
            lambda s, t: s.add.apply_async((2, 4), {"tag": t}, eta=aware.replace(tzinfo=None)),
            ok({"add": 1}, 6, not_before=True),
            not_before=later,
        ),
        Scenario(
            "soft_time_limit",
            lambda s, t: s.soft.apply_async(kwargs={"tag": t}, soft_time_limit=1, time_limit=30),
            ok({"soft": 1}, "soft", limits=["[30, 1]"]),
        ),
        Scenario(
            "headers",
            lambda s, t: s.add.apply_async((1, 1), {"tag": t}, headers={HEADER: t}),
            ok({"add": 1}, 2, trace=["headers"]),
            traced="add",
        ),
        Scenario(
            "ignore_result",
            lambda s, t: s.noresult.apply_async(kwargs={"tag": t}),
            ok({"noresult": 1}, "<PENDING>", state="PENDING", backend={"noresult": [[]]}),
        ),
        Scenario(
            "non_json_result",
            # the JSON result serializer cannot encode a set: Celery stores FAILURE
            # (EncodeError); the leased side must tell callers what its row says
            lambda s, t: s.odd.apply_async(kwargs={"tag": t}),
            {"starts": {"odd": 1}, "done": {"odd": 1}},
            plain={"state": "FAILURE", "starts": {"odd": 1}, "done": {"odd": 1}},
        ),
        Scenario(
            "parent_root_ids",
            lambda s, t: (s.add.s(1, 1, tag=t) | s.collect.s(tag=t))(),
            ok({"add": 1, "collect": 1}, 2, lineage=True),
        ),
    ]


def retries() -> list[Scenario]:
    return [
        Scenario(
            "retry_in_chain",
            lambda s, t: (s.retry_once.s(1, tag=t) | s.add.s(10, tag=t))(),
            {
                "result": 11,
                "starts": {"retry_once": 2, "add": 1},
                "done": {"retry_once": 1, "add": 1},
                "order": ["retry_once", "add"],
                "lineage": True,
            },
            all_states=True,
        ),
        Scenario(
            "retry_with_link",
            lambda s, t: s.retry_once.apply_async((2,), {"tag": t}, link=s.collect.s(tag=t)),
            {
                "result": 2,
                "starts": {"retry_once": 2, "collect": 1},
                "done": {"retry_once": 1, "collect": 1},
                "values": ["2"],
            },
            all_states=True,
        ),
        Scenario(
            "retry_eta_naive",
            lambda s, t: s.retry_once.apply_async((3,), {"tag": t, "eta": "naive"}),
            {"result": 3, "starts": {"retry_once": 2}, "done": {"retry_once": 1}},
            all_states=True,
        ),
        Scenario(
            "retry_eta_aware",
            lambda s, t: s.retry_once.apply_async((4,), {"tag": t, "eta": "aware"}),
            {"result": 4, "starts": {"retry_once": 2}, "done": {"retry_once": 1}},
            all_states=True,
        ),
        Scenario(
            "autoretry_in_chain",
            lambda s, t: (s.auto_once.s(4, tag=t) | s.add.s(1, tag=t))(),
            {
                "result": 5,
                "starts": {"auto_once": 2, "add": 1},
                "done": {"auto_once": 1, "add": 1},
                "order": ["auto_once", "add"],
            },
            all_states=True,
        ),
        Scenario(
            "retry_in_chord_header",
            lambda s, t: chord([s.retry_once.s(1, tag=t), s.add.s(1, 1, tag=t)], s.tsum.s(tag=t))(),
            {
                "result": 3,
                "starts": {"retry_once": 2, "add": 1, "tsum": 1},
                "done": {"retry_once": 1, "add": 1, "tsum": 1},
            },
            all_states=True,
        ),
        Scenario(
            "retry_keeps_headers_and_limits",
            lambda s, t: s.retry_once.apply_async(
                (6,), {"tag": t}, headers={HEADER: t}, soft_time_limit=30, time_limit=60
            ),
            {
                "result": 6,
                "starts": {"retry_once": 2},
                "trace": ["retry_keeps_headers_and_limits"],
                "limits": ["[60, 30]"],
            },
            all_states=True,
            traced="retry_once",
        ),
    ]


def tagged(scenarios: list[Scenario]) -> list[Scenario]:
    """Tags are the scenario names here (the expected ``trace`` values use them)."""
    for s in scenarios:
        s.tag = s.name
    return scenarios


# -- message lost, broker down ----------------------------------------------------------------


def lost_messages(now: float) -> list[Scenario]:
    later = now + 4.0
    soon = datetime.fromtimestamp(now + 1.0, timezone.utc)
    return [
        Scenario(
            "lost_chain",
            lambda s, t: chain(s.add.s(1, 2, tag=t), s.add.s(10, tag=t))(),
            ok({"add": 2}, 13, order=["add", "add"], lineage=True),
            plain=lost(),
        ),
        Scenario(
            "lost_link",
            lambda s, t: s.add.apply_async(
                (1, 2), {"tag": t}, link=s.collect.s(tag=t), link_error=s.on_error.s(tag=t)
            ),
            ok({"add": 1, "collect": 1}, 3, values=["3"]),
            plain=lost(),
        ),
        Scenario(
            "lost_chord",
            lambda s, t: chord([s.add.s(1, 1, tag=t), s.add.s(2, 2, tag=t)], s.tsum.s(tag=t))(),
            ok({"add": 2, "tsum": 1}, 6),
            plain=lost(),
        ),
        Scenario(
            "lost_expires",
            # expired before the reaper may re-publish it (republish_after 2 s): a
            # re-published message that kept ``expires`` is revoked, not run
            lambda s, t: s.add.apply_async((1, 1), {"tag": t}, expires=soon),
            {"starts": {}, "done": {}, "row": "CANCELLED"},
            plain=lost(),
        ),
        Scenario(
            "lost_headers_and_limits",
            lambda s, t: s.add.apply_async(
                (1, 1), {"tag": t}, headers={HEADER: t}, soft_time_limit=30, time_limit=60
            ),
            ok({"add": 1}, 2, trace=["lost_headers_and_limits"], limits=["[60, 30]"]),
            traced="add",
            plain=lost(),
        ),
        Scenario(
            "lost_countdown",
            lambda s, t: s.add.apply_async((2, 2), {"tag": t}, countdown=later - time.time()),
            ok({"add": 1}, 4, not_before=True),
            plain=lost(),
            not_before=later,
        ),
    ]


def broker_down() -> list[Scenario]:
    refused = {"raised": "OperationalError", "starts": {}, "done": {}}
    return [
        Scenario(
            "down_chain",
            lambda s, t: chain(s.add.s(1, 2, tag=t), s.add.s(10, tag=t))(),
            ok({"add": 2}, 13, order=["add", "add"], lineage=True),
            plain=refused,
        ),
        Scenario(
            "down_link",
            lambda s, t: s.add.apply_async((1, 2), {"tag": t}, link=s.collect.s(tag=t)),
            ok({"add": 1, "collect": 1}, 3, values=["3"]),
            plain=refused,
        ),
        Scenario(
            "down_headers_and_limits",
            lambda s, t: s.add.apply_async(
                (1, 1), {"tag": t}, headers={HEADER: t}, soft_time_limit=30, time_limit=60
            ),
            ok({"add": 1}, 2, trace=["down_headers_and_limits"], limits=["[60, 30]"]),
            traced="add",
            plain=refused,
        ),
    ]


def broker_address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    default = 6379 if parts.scheme.startswith("redis") else 5672
    return parts.hostname or "127.0.0.1", parts.port or default


def via(url: str, port: int) -> str:
    """``url`` with its host and port replaced by the loopback proxy's."""
    parts = urlsplit(url)
    auth = parts.netloc.rpartition("@")[0]
    return urlunsplit(
        parts._replace(netloc=f"{auth}@127.0.0.1:{port}" if auth else f"127.0.0.1:{port}")
    )


@MATRIX
def test_features_first_run_retry_lost_and_broker_down(
    lease_env: LeaseEnv, broker_url: str, redis_url: str
) -> None:
    # no lease may expire here (nothing in this test kills a process): a TTL far
    # longer than a heartbeat delayed by a loaded machine
    p = project(lease_env, broker_url, redis_url, ttl=LONG_TTL)
    with parity_env(p, redis_url) as parity:
        sides = list(parity.sides.values())

        # message lost: no worker yet; every message is deleted from the queue
        gone = tagged(lost_messages(time.time()))
        for s in gone:
            s.run(sides)
        assert purge(p) >= len(gone) * 2, "the lost scenarios' messages were queued"

        # broker down: a producer of the same project whose broker refuses connections
        proxy = TcpProxy(broker_address(broker_url)).start()
        proxy.cut()
        # the same broker by another address: lease_origin says so (without it the
        # workers' reaper would leave its rows to a broker no worker uses)
        down = project(
            lease_env,
            via(broker_url, proxy.port),
            redis_url,
            ttl=LONG_TTL,
            origin=broker_origin(broker_url),
        )
        down_sides = [Side(prefix, down.module) for prefix in ("p", "l")]
        refused = tagged(broker_down())
        for s in refused:
            s.run(down_sides)

        parity.start_worker(CONCURRENCY)
        fine = tagged([*first_run(time.time()), *retries()])
        for s in fine:
            s.run(sides)

        assert_parity(
            check_all(parity, [*fine, *gone, *refused], timeout=90, concurrency=CONCURRENCY)
        )
