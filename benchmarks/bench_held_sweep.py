"""How fast one held sweep publishes, and what a busy thread in its process does to it.

The reaper's held sweep (``Reaper.publish_held``) publishes the rows due, one message
at a time, in batches of ``lease_reaper_batch_size``. Embedded in a worker it runs as a
thread of the worker's main process, beside Celery's event loop. This benchmark times
one sweep over N rows due at once (PostgreSQL store), side by side in one run, on each
broker: in a process otherwise idle, and in a process where one other Python thread
keeps the interpreter busy (pure-Python work, standing in for the event loop of a
worker that consumes and dispatches). Each publish waits for the broker's answer (Redis)
or writes to a socket (RabbitMQ); a thread that waits gives up the interpreter lock and
must get it back from the busy thread, which lets it go only every
``sys.getswitchinterval()`` (5 ms).
"""

from __future__ import annotations

import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    BROKERS,
    PG_URL,
    Context,
    Section,
    delete_queue,
    lease_config,
    loadavg,
    new_queue,
    pg_schema,
    standalone,
    table,
)


def _spin(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i


def _unpublished(store: Any) -> int:
    """Rows not published yet."""
    from sqlalchemy import func, select

    t = store.t.tasks
    with store.engine.connect() as conn:
        return int(
            conn.execute(select(func.count()).where(t.c.published_at.is_(None))).scalar_one()
        )


def sweep(ctx: Context, broker: str, busy: bool) -> dict[str, Any]:
    """One sweep over N held rows due now; returns rows/s and process CPU per row."""
    from celery import Celery

    from celery_lease import LeasedTask
    from celery_lease._runtime import runtime
    from celery_lease.reaper import Reaper

    n = ctx.scale(3000, 200)
    url = BROKERS[broker]
    queue = new_queue("held-sweep")
    with pg_schema("held_sweep") as schema:
        cfg = lease_config(PG_URL, schema)
        app = Celery(f"held_sweep_{broker}_{int(busy)}", broker=url)
        app.conf.update(
            task_default_queue=queue,
            lease_database_url=cfg.database_url,
            lease_schema=schema,
            lease_auto_migrate=True,
            lease_hold_eta_after=0.0,
            # a row the broker refuses (a timeout) is left to the outbox sweep: soon
            lease_publish_grace=0.2,
        )

        @app.task(base=LeasedTask, name="bench.noop", shared=False)
        def noop(i: int) -> int:
            return i

        store = runtime(app).store
        store.migrate()
        try:
            items = [{"args": (i,), "countdown": 1.0} for i in range(n)]
            for start in range(0, n, 1000):
                noop.submit_many(items[start : start + 1000])
            # every row due: the database's clock past the last ETA
            latest = max(h.eta for h in store.held(limit=n) if h.eta is not None)
            while store.database_time() < latest:
                time.sleep(0.1)
            stop = threading.Event()
            spinner = threading.Thread(target=_spin, args=(stop,), daemon=True)
            if busy:
                spinner.start()
            reaper = Reaper(app)
            t0, c0 = time.monotonic(), time.process_time()
            published = 0
            while published < n:  # a sweep publishes at most MAX_BATCHES batches
                done = reaper.publish_held()
                if not done:
                    break
                published += done
            wall, cpu = time.monotonic() - t0, time.process_time() - c0
            stop.set()
            if busy:
                spinner.join()
            # the rows the broker refused meanwhile were left to the outbox sweep, as in a
            # worker: counted, not timed, and published by it before the round ends
            refused = n - published
            deadline = time.monotonic() + 60
            while _unpublished(store) and time.monotonic() < deadline:
                time.sleep(0.3)
                reaper.sweep()
            left = _unpublished(store)
        finally:
            store.dispose()
            delete_queue(url, queue)
    if left:
        raise RuntimeError(f"{broker}: {left} of {n} held rows never published")
    if refused:
        ctx.log(
            f"held sweep: {broker}: the broker refused {refused} rows (the outbox sweep sent them)"
        )
    return {
        "broker": broker,
        "busy": busy,
        "n": n,
        "refused": refused,
        "rate": published / wall,
        # with a busy thread the process's CPU is mostly the spinner's: not comparable
        "cpu_ms": None if busy else cpu / n * 1000,
    }


def run(ctx: Context) -> Section:
    """Publishing rate of one held sweep, idle and beside a busy thread."""
    section = Section(
        "held_sweep", "14b. Held sweep: publishing rate, idle and beside a busy thread"
    )
    rounds = []
    for broker in BROKERS:
        for busy in (False, True):
            ctx.log(f"held sweep: {broker}, {'busy' if busy else 'idle'}")
            rounds.append(sweep(ctx, broker, busy))
    rows = []
    for broker in BROKERS:
        alone, beside = (r for r in rounds if r["broker"] == broker)
        rows.append(
            [
                broker,
                f"{alone['n']:,}",
                f"{alone['rate']:,.0f}",
                f"{alone['cpu_ms']:.3f}",
                f"{beside['rate']:,.0f}",
                f"{beside['rate'] / alone['rate']:.2f}x",
            ]
        )
    section.lines += textwrap.dedent(__doc__ or "").strip().splitlines()[2:]
    section.lines += [""]
    section.lines += table(
        [
            "broker",
            "held rows due",
            "published /s, idle process",
            "process CPU ms / row, idle",
            "published /s, beside a busy thread",
            "busy vs idle",
        ],
        rows,
    )
    section.lines += ["", f"Load average at the end: {loadavg()}."]
    section.data = {"rounds": rounds}
    return section


if __name__ == "__main__":
    raise SystemExit(standalone(run))
