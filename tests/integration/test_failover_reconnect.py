"""The store after a failover finds the host that accepts writes (crash matrix row 31).

On a primary/replica pair made for the test (:mod:`tests.crash.replicas`), with the
store's URL naming both hosts and ``target_session_attrs=read-write``: the replica is
promoted while the former primary lives on and is fenced read-only
(``default_transaction_read_only``, as a failover manager does to the old primary it
cannot stop), so a pooled connection still reaches a server that refuses writes and
passes the idle ping. The next write is refused there (SQLSTATE 25006); the store takes
that for a lost connection, opens a new one, which libpq opens on the promoted host,
and the write succeeds in the same call. Before, every write failed with a
``StoreError`` on that connection until the pool recycled it (30 minutes).
"""

from __future__ import annotations

import uuid

import pytest

from celery_lease.config import LeaseConfig
from celery_lease.store import Store
from celery_lease.store._types import NewTask

from ..crash.replicas import ReplicatedPostgres, missing
from ..helpers import wait_until

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(missing() is not None, reason=str(missing())),
]


def _new() -> NewTask:
    return NewTask(
        id=str(uuid.uuid4()),
        name="t.work",
        args="[]",
        kwargs="{}",
        options="{}",
        lease_ttl=5.0,
        max_recoveries=2,
    )


def test_a_write_refused_as_read_only_reconnects_to_the_host_that_accepts_writes() -> None:
    with ReplicatedPostgres(synchronous=False) as pair:
        store = Store(LeaseConfig(database_url=pair.url(), schema="s"))
        try:
            store.migrate()
            # shown with both hosts as written (the start-up line, every StoreError)
            assert store.url == pair.url()
            before = _new()
            assert store.submit(before) == (before.id, True)
            assert store.engine.pool.checkedin() == 1  # on the primary, kept for the next call

            pair.promote()
            pair.primary.sql(
                "ALTER SYSTEM SET default_transaction_read_only = on", database="postgres"
            )
            pair.primary.sql("SELECT pg_reload_conf()", database="postgres")
            # a session started now sees the setting: the postmaster has signalled every
            # backend (ours too), which applies it before it runs our next statement
            wait_until(
                lambda: pair.primary.sql("SHOW default_transaction_read_only") == [("on",)],
                timeout=30,
                interval=0.02,
                message="the former primary read-only",
            )

            after = _new()
            assert store.submit(after) == (after.id, True)
            record = store.get(after.id)
            assert record is not None
            # written on the promoted replica; the fenced former primary has not got it
            promoted = pair.replica.sql(
                f"SELECT count(*) FROM s.lease_tasks WHERE id = '{after.id}'"
            )
            assert promoted == [(1,)]
            old = pair.primary.sql(f"SELECT count(*) FROM s.lease_tasks WHERE id = '{after.id}'")
            assert old == [(0,)]
        finally:
            store.dispose()
