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
import threading
import time
from typing import Any

import psycopg
import pytest

from celery_lease._runtime import Incarnation
from celery_lease.heartbeat import Heartbeat

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
    # (on_recovered; again at the next beat if that renewal, sent more than a TTL ago,
    # gave no deadline in the future) and lifts the fence once a renewal does
    wait_until(lambda: beat.beat() and not inc.flags.fenced, message="fence lifted")
    assert recovered and all("self-fenced" in r for r in recovered), recovered
    assert inc.flags.deadline > time.monotonic()
