"""A backlog is not multiplied by re-publishing (Redis and RabbitMQ, PostgreSQL store).

The issue's scenario: 3,000 tasks queued with no free consumer, the reaper sweeping
every second with ``lease_republish_after`` 2 s, for 65 s; then two workers drain the
queue. The messages in the broker are counted every second (a passive
``queue_declare``). Side by side, in the same run: the reaper asking the broker (what
ships), and the reaper deciding by age alone (the broker inspection switched off in
the benchmark's own reaper process, as before this change). While draining, the
workers' embedded reapers run the shipped code in both variants.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    BROKERS,
    PG_URL,
    Context,
    Project,
    Section,
    delete_queue,
    flush_published,
    lease_config,
    loadavg,
    new_queue,
    pg_schema,
    standalone,
    table,
)

SOURCE = """
from celery_lease import LeasedTask


@app.task(base=LeasedTask, name="bench.noop")
def noop(i):
    return i
"""


def depth(broker_url: str, queue: str) -> int:
    from kombu import Connection
    from kombu.exceptions import ChannelError

    with Connection(broker_url, connect_timeout=5) as conn:
        channel: Any = conn.channel()
        try:
            return int(channel.queue_declare(queue, passive=True).message_count)
        except ChannelError:
            return 0
        finally:
            channel.close()


class _AgeOnly:
    """The broker inspection switched off: every row goes by age (as before)."""

    def filter(self, store: Any, rows: Any) -> tuple[list[Any], int]:
        return list(rows), 0


def scenario(ctx: Context, broker: str, age_only: bool) -> dict[str, Any]:
    from celery_lease import State
    from celery_lease import reaper as reaper_module
    from celery_lease._runtime import runtime
    from celery_lease.reaper import Reaper

    n = ctx.scale(3000, 100)
    hold_for = ctx.scale(65.0, 4.0)  # quick: still two sweeps past lease_republish_after
    broker_url = BROKERS[broker]
    queue = new_queue("backlog")
    with pg_schema("backlog") as schema:
        cfg = lease_config(PG_URL, schema)
        settings = {
            "task_default_queue": queue,
            "broker_connection_retry_on_startup": True,
            "lease_database_url": cfg.database_url,
            "lease_schema": schema,
            "lease_auto_migrate": True,
            "lease_republish_after": 2.0,
            "lease_reaper_interval": 1.0,
        }
        project = Project.write(ctx, broker_url=broker_url, settings=settings, source=SOURCE)
        module = project.load()
        app = module.app
        store = runtime(app).store
        original = reaper_module.backlog_guard
        workers = []
        try:
            for i in range(n):
                app.tasks["bench.noop"].apply_async((i,))
            flush_published(store)
            if age_only:
                reaper_module.backlog_guard = lambda app, after: _AgeOnly()  # type: ignore[assignment,return-value]
            reaper = Reaper(app, actor="reaper:bench", store=store)
            samples = []
            started = time.monotonic()
            while time.monotonic() - started < hold_for:
                reaper.sweep()
                samples.append(depth(broker_url, queue))
                time.sleep(1.0)
            reaper_module.backlog_guard = original
            held_depth = depth(broker_url, queue)
            republished_holding = store.counters()["republished"]
            t0 = time.monotonic()
            for k in range(2):
                workers.append(
                    project.worker(
                        queue, pool="prefork", concurrency=2, nodename=f"backlog{k}@bench"
                    ).start()
                )
            deadline = time.monotonic() + ctx.scale(600.0, 120.0)
            while store.live_counts()[State.PENDING] > 0:
                if time.monotonic() > deadline:
                    raise RuntimeError("the backlog did not drain")
                time.sleep(0.5)
            drain_s = time.monotonic() - t0
            # the last duplicates are dropped after the last task ran
            time.sleep(ctx.scale(3.0, 1.0))
            left = depth(broker_url, queue)
            counters = store.counters()
        finally:
            reaper_module.backlog_guard = original
            for w in workers:
                w.stop()
            runtime(app).reset()
            delete_queue(broker_url, queue)
    return {
        "broker": broker,
        "variant": "age only (before)" if age_only else "asks the broker",
        "tasks": n,
        "seconds": hold_for,
        "max_depth": max(samples),
        "depth_after": held_depth,
        "republished_holding": republished_holding,
        "republished_total": counters["republished"],
        "duplicates_dropped": counters["duplicates_dropped"],
        "drain_s": drain_s,
        "left_in_queue": left,
        "messages_per_task": (n + counters["republished"]) / n,
    }


def run(ctx: Context) -> Section:
    """Backlog multiplication."""
    section = Section("backlog", "10. A backlog stays a backlog (Redis and RabbitMQ)")
    rows = []
    for broker in ("redis", "rabbitmq"):
        for age_only in (True, False):
            if ctx.quick and age_only:
                continue  # the smoke run covers the shipped reaper on each broker
            ctx.log(f"backlog: {broker}, {'age only' if age_only else 'asks the broker'}")
            rows.append(scenario(ctx, broker, age_only))
    section.data = {"rounds": rows}
    n, secs = rows[0]["tasks"], rows[0]["seconds"]
    section.add(
        f"{n:,} tasks queued with no consumer while the reaper sweeps every second for "
        f"{secs:.0f} s with `lease_republish_after` 2 s; then two workers (prefork, 2 "
        "processes each) drain the queue. Messages counted in the broker every second. "
        '"age only" is the reaper of before this change, run side by side (the broker '
        "inspection switched off in the benchmark's reaper; the workers' embedded "
        "reapers run the shipped code in both variants).",
        "",
        *table(
            [
                "broker",
                "reaper",
                f"most messages queued in {secs:.0f} s",
                "re-published while queued",
                "re-published in all",
                "duplicates dropped",
                "messages per task",
                "drain (s)",
            ],
            [
                (
                    r["broker"],
                    r["variant"],
                    f"{r['max_depth']:,}",
                    f"{r['republished_holding']:,}",
                    f"{r['republished_total']:,}",
                    f"{r['duplicates_dropped']:,}",
                    f"{r['messages_per_task']:.3f}",
                    r["drain_s"],
                )
                for r in rows
            ],
        ),
        "",
        f"Load average at the end: {loadavg()}.",
    )
    return section


if __name__ == "__main__":
    raise SystemExit(standalone(run))
