"""The heartbeat's fence holds even when the heartbeat thread cannot say so.

A renewal can hang (a connect timeout, a lock, a frozen main process) for longer than
the TTL. The reaper elsewhere then expires the worker's leases on database time, so
the worker's own tasks must stop by then whether or not the heartbeat thread has run:
each renewal moves a deadline in memory shared with the pool children, and a task at
a step boundary is fenced once it has passed.

Here a second PostgreSQL connection holds the worker row's lock, so the real heartbeat
thread's ``UPDATE`` waits; a forked child (a prefork pool process) watches the shared
flags.
"""

from __future__ import annotations

import multiprocessing
import re
import threading
import time
from typing import Any

import psycopg
import pytest

from celery_lease._runtime import Incarnation
from celery_lease.worker.main.heartbeat import Heartbeat

from ..conftest import _libpq_url
from ..helpers import wait_until

pytestmark = pytest.mark.parametrize(
    "backend", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True
)


def _child_sees_fence(flags: Any, seconds: float, out: Any) -> None:
    """Forked child: report how long until the shared flags say 'fenced'."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if flags.fenced:
            out.put(time.monotonic() - t0)
            return
        time.sleep(0.01)
    out.put(None)


def test_tasks_are_fenced_on_time_while_a_renewal_hangs(store: Any) -> None:
    ttl = 1.0
    inc = Incarnation("w-hang", "hang@test", "host", 1)
    store.register_worker(inc.id, inc.nodename, inc.hostname, inc.pid)
    recovered: list[str] = []
    beat = Heartbeat(store, inc, interval=0.1, ttl=ttl, on_recovered=recovered.append)
    assert beat.beat() and not inc.flags.fenced

    # a connection of its own: the store's sessions time out when idle in a transaction
    workers = store.t.workers
    holder = psycopg.connect(_libpq_url(store.config.database_url), connect_timeout=5)
    holder.execute(f"SELECT id FROM {workers.fullname} WHERE id = %s FOR UPDATE", (inc.id,))
    try:
        hung = threading.Thread(target=beat.beat, daemon=True)
        hung.start()
        time.sleep(0.2)
        assert hung.is_alive(), "the renewal should be waiting for the row lock"

        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        child = ctx.Process(target=_child_sees_fence, args=(inc.flags, 10 * ttl, out))
        child.start()
        seen = out.get(timeout=30)
        child.join(10)
        assert child.exitcode == 0
        # the child saw the fence while the renewal still hung, so the thread never set it
        assert seen is not None, "a pool child never saw the fence while the renewal hung"
        assert hung.is_alive()
        print(f"MEASURED fence seen by a child {seen:.2f} s after it started watching")
    finally:
        holder.rollback()
        holder.close()

    hung.join(30)
    assert not hung.is_alive()
    # the hung renewal went through past its deadline: the worker expires what it held
    # (on_recovered, once) and lifts the fence on a renewal that gives a deadline ahead
    wait_until(lambda: beat.beat() and not inc.flags.fenced, message="fence lifted")
    assert len(recovered) == 1 and "self-fenced" in recovered[0], recovered
    assert inc.flags.deadline > time.monotonic()


def _lock_waiters(store: Any) -> int:
    """Sessions of the test database waiting for a row lock (the hung renewal)."""
    with psycopg.connect(_libpq_url(store.config.database_url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        ).fetchone()
    return int(row[0]) if row else 0


def test_a_renewal_that_hung_past_the_ttl_fences_once_and_states_the_real_lapse(
    store: Any,
) -> None:
    ttl = 1.0
    inc = Incarnation("w-once", "once@test", "host", 1)
    store.register_worker(inc.id, inc.nodename, inc.hostname, inc.pid)
    recovered: list[str] = []
    beat = Heartbeat(store, inc, interval=0.1, ttl=ttl, on_recovered=recovered.append)
    assert beat.beat() and not inc.flags.fenced

    workers = store.t.workers
    holder = psycopg.connect(_libpq_url(store.config.database_url), connect_timeout=5)
    holder.execute(f"SELECT id FROM {workers.fullname} WHERE id = %s FOR UPDATE", (inc.id,))
    try:
        hung = threading.Thread(target=beat.beat, daemon=True)
        hung.start()
        wait_until(lambda: _lock_waiters(store) >= 1, message="the renewal waits for the lock")
        sent_before = time.monotonic()  # the hung renewal was sent before this
        # hold it until the renewal has taken longer than a whole TTL
        wait_until(lambda: time.monotonic() > sent_before + 1.5 * ttl, timeout=30)
        assert hung.is_alive() and inc.flags.fenced
    finally:
        holder.rollback()
        holder.close()
    hung.join(30)
    assert not hung.is_alive()

    # the renewal answered, but more than a TTL after it was sent: it gives no deadline
    # in the future, so it does not lift the fence; the one after it does, once
    for _ in range(5):
        assert beat.beat()
        assert not inc.flags.fenced, "fenced again after the heartbeat was restored"
    assert len(recovered) == 1, recovered
    lapse = float(re.search(r"lapsed for ([0-9.]+) s", recovered[0]).group(1))  # type: ignore[union-attr]
    assert lapse >= 1.5 * ttl, recovered[0]  # the real lapse, not the gap before the call
    print(f"MEASURED lapse reported {lapse:.1f} s for a renewal held {1.5 * ttl:.1f} s")
