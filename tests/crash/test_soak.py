"""The short seeded chaos soak (see :mod:`tests.crash.chaos`; the long one is
``scripts/soak.py``).

About 20 s of faults (pool children and whole workers SIGKILLed and restarted, workers
frozen and resumed, the broker losing its queued messages, the store's connections
killed) over a mixed workload on three workers (prefork and threads), PostgreSQL store,
Redis broker; then the system is left alone and every invariant is checked. The seed
is ``CELERY_LEASE_SOAK_SEED`` (default :data:`~tests.crash.chaos.DEFAULT_SEED`); a
failure message names it. Redis is really restarted only when this session may restart
shared services (``CELERY_LEASE_TEST_EXCLUSIVE=1``, or no other test session running)
and its Redis is the shared one (127.0.0.1:6379). The SQLite store's soak is
``scripts/soak.py --store sqlite``.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import chord

from ..helpers import wait_until
from .chaos import SOURCE, TIMINGS, Options, Soak, make_plan, seed_from_env
from .chaos_checks import FollowUp, Report, fault_kinds, keep_evidence
from .faults import (
    EXCLUSIVE_ENV,
    foreign_sessions,
    rabbitmq_add_vhost,
    rabbitmq_close_connections,
    rabbitmq_delete_vhost,
    rabbitmq_purge_queues,
    restarts_redis_of,
    with_vhost,
)
from .support import LeaseEnv, pg_only


@pg_only()
@pytest.mark.slow
@pytest.mark.exclusive  # may restart Redis: no other xdist worker's test runs meanwhile
@pytest.mark.timeout(420)
def test_chaos_soak_loses_nothing_and_runs_nothing_twice(
    lease_env: LeaseEnv, redis_url: str, tmp_path: Path
) -> None:
    p = lease_env.project(broker_url=redis_url, source=SOURCE, **TIMINGS)
    exclusive = restarts_redis_of(redis_url) and (
        os.environ.get(EXCLUSIVE_ENV) == "1" or not foreign_sessions()
    )
    opts = Options(
        seed=seed_from_env(),
        chaos_seconds=20.0,
        tasks=40,
        workers=3,
        producers=3,
        settle_timeout=120.0,
        restart_redis=exclusive,
        database_url=p.store.config.database_url,
        # on a violation: the rows, audit trails, messages and chord keys involved,
        # written before the fixtures drop the database and flush Redis
        evidence_dir=str(tmp_path / "evidence"),
    )
    report = Soak(p, opts, redis_url, echo=print).run()
    print(report.table())
    assert report.ok, report.failure_message()


def test_the_faults_drawn_depend_on_the_broker_and_the_store() -> None:
    # a SQLite store has no connections to kill: no pg_terminate; a Redis and PostgreSQL
    # run draws the five kinds its published seeds were drawn with, in their order
    published = ("kill_child", "kill_worker", "freeze", "redis", "pg_terminate")
    assert fault_kinds("redis") == fault_kinds("redis", "postgresql") == published
    assert fault_kinds("redis", "sqlite") == ("kill_child", "kill_worker", "freeze", "redis")
    assert fault_kinds("amqp", "sqlite") == (
        "kill_child",
        "kill_worker",
        "freeze",
        "rabbitmq_purge",
        "rabbitmq_disconnect",
    )
    for broker in ("redis", "amqp"):
        on_sqlite = make_plan(Options(seed=7, broker=broker, store="sqlite", chaos_seconds=300))
        on_pg = make_plan(Options(seed=7, broker=broker, chaos_seconds=300))
        assert on_sqlite.workload == on_pg.workload
        kinds = {event.kind for event in on_sqlite.faults}
        assert kinds == set(fault_kinds(broker, "sqlite"))
        assert {event.kind for event in on_pg.faults} == set(fault_kinds(broker))


def test_a_violation_keeps_its_evidence(
    lease_env: LeaseEnv, redis_url: str, tmp_path: Path
) -> None:
    # what the soak writes before anything is dropped: the rows (with their stored
    # messages), audit trails and steps of the tasks a violation names, and the result
    # backend's keys of them and of their chords
    p = lease_env.project(broker_url=redis_url, source=SOURCE, **TIMINGS)
    app = p.module.app
    idem, follow = app.tasks["soak.idem"], app.tasks["soak.follow"]
    chorded = chord(idem.s(f"k{i}", 0, 0) for i in range(2))(follow.s("kc", "chord"))
    members = [r.id for r in chorded.parent.results]
    report = Report(Options(seed=1))
    report.kinds = dict.fromkeys(members, "chord")
    report.followups = [FollowUp("chord", "kc", "chord", chorded.id, tuple(members))]
    report.violations = [f"chord follow-up chord of kc ({chorded.id}) never ran"]

    path = keep_evidence(p, report, redis_url, tmp_path)
    evidence = json.loads(path.read_text())
    assert report.evidence == str(path) and evidence["violations"] == report.violations
    assert set(evidence["tasks"]) == {chorded.id, *members}
    member = evidence["tasks"][members[0]]
    assert member["row"]["message"] and member["row"]["state"] == "PENDING"
    assert [a["to_state"] for a in member["audit"]] == ["PENDING"]
    group = chorded.parent.id
    assert any(group in key for key in evidence["redis_keys"])  # the chord's counter keys


@pytest.fixture
def soak_vhost(amqp_url: str) -> Iterator[str]:
    """A RabbitMQ virtual host of the test's own (as ``scripts/soak.py --broker amqp``
    makes one), deleted after it."""
    url = with_vhost(amqp_url, f"lease-soak-{uuid.uuid4().hex[:8]}")
    rabbitmq_add_vhost(url)
    try:
        yield url
    finally:
        rabbitmq_delete_vhost(url)


def test_the_rabbitmq_faults_lose_the_queued_messages_and_drop_the_clients(
    soak_vhost: str, amqp_url: str
) -> None:
    # the soak's RabbitMQ faults (--broker amqp): the ready messages of every queue of
    # its vhost are purged (a delivered, unacknowledged one is not queued: kept), then
    # every connection of that vhost is closed by the broker, and none of another vhost
    from kombu import Connection

    with (
        Connection(soak_vhost, connect_timeout=5) as client,
        Connection(amqp_url, connect_timeout=5) as elsewhere,
    ):
        channel = client.channel()
        for queue, count in (("soak-a", 3), ("soak-b", 2), ("soak-empty", 0)):
            channel.queue_declare(queue, durable=True, auto_delete=False)
            for i in range(count):
                channel.basic_publish(channel.prepare_message(f"m{i}".encode()), "", queue)
        held = channel.basic_get("soak-b", no_ack=False)  # delivered, not acknowledged
        assert held is not None
        wait_until(lambda: channel.queue_declare("soak-a", passive=True).message_count == 3)
        elsewhere.default_channel.queue_declare(
            f"soak-other-{uuid.uuid4().hex[:8]}", exclusive=True
        )

        assert rabbitmq_purge_queues(soak_vhost) == (4, 2)
        for queue in ("soak-a", "soak-b", "soak-empty"):
            assert channel.queue_declare(queue, passive=True).message_count == 0

        assert rabbitmq_close_connections(soak_vhost, "soak test") == 1
        with pytest.raises(client.connection_errors):
            client.drain_events(timeout=10)
        # the other vhost's connection still works
        assert (
            elsewhere.default_channel.queue_declare(
                f"soak-other-{uuid.uuid4().hex[:8]}", exclusive=True
            ).message_count
            == 0
        )

    with Connection(soak_vhost, connect_timeout=5) as again:
        # the delivered message went back to its queue with its connection
        wait_until(
            lambda: again.default_channel.queue_declare("soak-b", passive=True).message_count == 1
        )
