"""A worker whose incarnation row is gone registers again with its next heartbeat.

After a failover to a replica that asynchronous replication had not brought up to
date, a worker that registered during the lost window has no row: its leases and
claims name an unknown owner (the reaper expires them), and a heartbeat that only
updates its row renews nothing, ever. The heartbeat inserts the row again, as it was
registered, and fences what ran meanwhile; unless a later incarnation under the same
node name superseded it (a worker started since, which never saw its row), which it
must not bring back to life. Here the row is deleted to stand for the lost window; the
real heartbeat runs in the test process on a real store (SQLite and PostgreSQL).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from sqlalchemy import delete

from celery_lease._runtime import Incarnation
from celery_lease.store import Store
from celery_lease.worker.main.heartbeat import Heartbeat

from ..helpers import wait_until


def _register(store: Store, nodename: str) -> Incarnation:
    """Register an incarnation as the worker's service does (its start time kept)."""
    inc = Incarnation(uuid.uuid4().hex, nodename, "failover-host", os.getpid())
    store.register_worker(inc.id, inc.nodename, inc.hostname, inc.pid, supersede=False)
    inc.registered_at = store.worker_started_at(inc.id)
    assert inc.registered_at is not None
    return inc


def _lose_row(store: Store, worker_id: str) -> None:
    """The failover's lost window: the row never reached the new primary."""
    w = store.t.workers
    with store.engine.begin() as conn:
        conn.execute(delete(w).where(w.c.id == worker_id))
    assert store.worker_started_at(worker_id) is None


def _later(store: Store) -> None:
    """Wait until the database's clock is past every start registered so far."""
    start = store.now()
    wait_until(lambda: (store.now() - start).total_seconds() >= 0.05, message="clock moves")


def _row(store: Store, worker_id: str) -> Any:
    return next((w for w in store.workers() if w.id == worker_id), None)


def test_a_heartbeat_registers_again_an_incarnation_whose_row_is_missing(store: Store) -> None:
    # an earlier incarnation under the name, whose supersede the failover lost too: it
    # looks alive, but started earlier, so it does not fence the one registered after
    predecessor = _register(store, "lost@failover")
    _later(store)
    inc = _register(store, "lost@failover")
    recovered: list[str] = []
    beat = Heartbeat(store, inc, interval=0.1, ttl=30.0, on_recovered=recovered.append)
    assert beat.beat() and recovered == []

    _lose_row(store, inc.id)
    assert beat.beat()
    row = _row(store, inc.id)
    assert row is not None and row.stopped_at is None and row.alive
    assert (row.nodename, row.hostname, row.pid) == (inc.nodename, inc.hostname, inc.pid)
    assert row.started_at == inc.registered_at  # registered again as it was
    # its leases may have been expired meanwhile (an unknown owner's are): fenced once,
    # and the worker carries on
    assert len(recovered) == 1 and not inc.flags.fenced and not beat.superseded
    assert beat.beat() and len(recovered) == 1
    assert _row(store, predecessor.id).stopped_at is None  # left as it was


def test_a_superseded_incarnation_is_not_registered_again(store: Store) -> None:
    inc = _register(store, "gone@failover")
    recovered: list[str] = []
    beat = Heartbeat(store, inc, interval=0.1, ttl=30.0, on_recovered=recovered.append)
    assert beat.beat()
    _lose_row(store, inc.id)
    # a worker started under the same name on the new primary, which never saw this row
    _later(store)
    successor = _register(store, "gone@failover")

    assert not beat.beat()
    assert _row(store, inc.id) is None  # not brought back to life
    assert beat.superseded and inc.flags.fenced and recovered == []
    assert not beat.beat() and _row(store, inc.id) is None
    successor_row = _row(store, successor.id)
    assert successor_row is not None and successor_row.stopped_at is None

    # the same fence when its row is there, marked stopped by the successor's start
    store.register_worker(inc.id, inc.nodename, inc.hostname, inc.pid, supersede=False)
    store.supersede([inc.id], successor.id)
    assert not beat.beat()
    assert _row(store, inc.id).stopped_at is not None

    # once the later incarnation has stopped, nothing supersedes this one any more
    store.stop_worker(successor.id, "shut down")
    assert beat.beat() and not beat.superseded
    assert _row(store, inc.id).stopped_at is None
    assert len(recovered) == 1 and not inc.flags.fenced
