"""Two Celery apps on different brokers (Redis and RabbitMQ) sharing one store and table
prefix: each publishes only the rows of its own broker.

Before, app A's reaper re-published app B's rows to A's broker: B's lost message went
to Redis, where A's worker ran B's task (or, with B's task unknown to A, it was lost),
and ``lease check`` on either app said nothing. Now every row records its app's broker
(``origin``: the broker URL without password), the reapers take a lock per broker and
publish only their own broker's rows, and ``lease check`` reports a row to publish
whose broker no live worker uses.
"""

from __future__ import annotations

import pytest

from celery_lease import State
from celery_lease.check import check

from ..crash.support import LeaseEnv


def _purge(broker_url: str, queue: str) -> int:
    from kombu import Connection

    with Connection(broker_url, connect_timeout=5) as conn:
        return int(conn.default_channel.queue_purge(queue) or 0)


@pytest.mark.parametrize(
    "backend", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True
)
def test_apps_on_two_brokers_sharing_a_store_each_publish_only_their_own_rows(
    lease_env: LeaseEnv, redis_url: str, amqp_url: str, queue_name: str
) -> None:
    a = lease_env.project(broker_url=redis_url)  # same store, prefix and queue name
    b = lease_env.project(broker_url=amqp_url)
    worker_a = a.worker("a")  # takes the Redis apps' reaper lock and holds it
    task_id = b.submit("t.work", "b1")
    assert _purge(amqp_url, queue_name) == 1  # B's message lost, B has no worker yet
    row = b.get(task_id)
    assert row.state is State.PENDING

    # no live worker uses B's broker: lease check (on either app) says so
    found = [v for v in check(a.module.app) if v.kind == "no_publisher"]
    assert [v.task_id for v in found] == [task_id], found
    assert "amqp://" in found[0].detail

    worker_b = b.worker("b")  # its reaper publishes B's row again, to RabbitMQ
    b.wait_state(task_id, State.SUCCEEDED, timeout=60)
    claims = [h.actor for h in b.store.history(task_id) if h.to_state is State.RUNNING]
    assert claims == [f"worker:{worker_b.nodename}"], claims  # never A's worker
    # and A's own work still runs on A
    own = a.submit("t.work", "a1")
    a.wait_state(own, State.SUCCEEDED, timeout=60)
    claims = [h.actor for h in a.store.history(own) if h.to_state is State.RUNNING]
    assert claims == [f"worker:{worker_a.nodename}"], claims
    assert [v for v in check(a.module.app) if v.kind == "no_publisher"] == []
