"""Heartbeat cost: statements per second and renewal latency with 1, 100, 10,000 leases.

Store level: one incarnation owns N RUNNING rows (inserted set-based); the real
``celery_lease.worker.main.heartbeat.Heartbeat`` thread renews it at a short interval while a
SQLAlchemy counter records every statement it sends. Then one renewal is timed many
times. The design promise: one statement per worker per interval, whatever N.

Worker level: a real ``celery worker`` (threads pool) runs 100 leased tasks at once
(each sleeps) while its heartbeat and embedded reaper threads are counted.
"""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    BENCH_DIR,
    BROKERS,
    PG_URL,
    REDIS_URL,
    Context,
    Project,
    Section,
    delete_queue,
    lease_config,
    loadavg,
    median,
    new_queue,
    percentile,
    pg_schema,
    pyplot,
    redis_client,
    save_plot,
    standalone,
    store_url,
    table,
    truncate_store,
    wait_for,
)
from _sqlcount import SqlCounter, summarize


def insert_running(store: Any, owner: str, n: int) -> None:
    """``n`` RUNNING rows owned by ``owner``, in one set-based statement."""
    from sqlalchemy import text

    t = store.t.tasks
    name = f'"{t.schema}"."{t.name}"' if t.schema else f'"{t.name}"'
    now = "statement_timestamp()" if store.is_pg else "((julianday('now') - 2440587.5) * 86400.0)"
    if store.is_pg:
        source = "generate_series(1, :n) AS g(i)"
    else:
        source = (
            "(WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < :n) "
            "SELECT i FROM s) AS g"
        )
    sql = (
        f"INSERT INTO {name} (id, name, state, attempt, token, owner, lease_ttl, "
        "max_recoveries, created_at, updated_at, started_at, progress_at, args, kwargs) "
        f"SELECT :owner || '-' || g.i, 'bench.hb', 'RUNNING', 1, 'tok', :owner, 30, 5, "
        f"{now}, {now}, {now}, {now}, '[]', '{{}}' FROM {source}"
    )
    with store.engine.begin() as conn:
        conn.execute(text(sql), {"n": n, "owner": owner})


def measure_store(ctx: Context, kind: str, schema: str | None, leases: int) -> dict[str, float]:
    from celery_lease._runtime import Incarnation
    from celery_lease.store import Store
    from celery_lease.worker.main.heartbeat import Heartbeat

    store = Store(lease_config(store_url(kind, ctx, "heartbeat"), schema))
    store.migrate()
    truncate_store(store)
    inc = Incarnation(uuid.uuid4().hex, "hb@bench", "bench", 1)
    store.register_worker(inc.id, inc.nodename, inc.hostname, inc.pid)
    insert_running(store, inc.id, leases)
    interval = 0.1
    duration = ctx.scale(3.0, 0.6)
    hb = Heartbeat(store, inc, interval=interval, ttl=30.0, on_recovered=lambda reason: None)
    counter = SqlCounter(role=lambda: "hb").attach(store.engine, store.engine.pool)
    try:
        t0 = time.perf_counter()
        hb.start()
        time.sleep(duration)
        hb.stop()
        hb.join(5)
        elapsed = time.perf_counter() - t0
        counts, _ = counter.take()
        s = summarize(counts, "hb", max(hb.renewals, 1))
        lat = []
        for _ in range(ctx.scale(300, 20)):
            a = time.perf_counter()
            store.renew(inc.id)
            lat.append(time.perf_counter() - a)
    finally:
        counter.detach(store.engine, store.engine.pool)
        store.dispose()
    return {
        "leases": leases,
        "renewals": hb.renewals,
        "renewals_per_s": hb.renewals / elapsed,
        "statements_per_renewal": s["statements"],
        "round_trips_per_renewal": s["round_trips"],
        "latency_ms_p50": 1000 * median(lat),
        "latency_ms_p99": 1000 * percentile(lat, 99),
    }


WORKER_SOURCE = """
import time
import sys
sys.path.insert(0, os.environ["BENCH_DIR"])
from _sqlcount import SqlCounter
from celery_lease import LeasedTask

_counter = SqlCounter(role=lambda: threading.current_thread().name).attach()


@signals.worker_shutdown.connect
def _flush(**kwargs):
    import redis

    _counter.flush_to_redis(os.environ["BENCH_REDIS_URL"], os.environ["BENCH_COUNT_SQL"])
    client = redis.Redis.from_url(os.environ["BENCH_REDIS_URL"])
    client.hset(os.environ["BENCH_COUNT_SQL"], "flushed_at", repr(time.time()))
    client.close()


@signals.worker_ready.connect
def _reset(**kwargs):
    import redis

    _counter.take()  # start-up statements (registration, schema check) are not counted
    client = redis.Redis.from_url(os.environ["BENCH_REDIS_URL"])
    client.hset(os.environ["BENCH_COUNT_SQL"], "reset_at", repr(time.time()))
    client.close()


@app.task(base=LeasedTask, name="bench.hold", shared=False)
def hold(seconds):
    time.sleep(seconds)
"""


def measure_worker_background(ctx: Context, schema: str, running: int) -> dict[str, float]:
    """Background statements per second of a real worker holding ``running`` leases.

    The worker is stopped warm after the window so that its counts are flushed; the
    window is measured from ``worker_ready`` (counters reset there) to the stop."""
    from celery_lease.store import Store

    interval = 0.5
    store = Store(lease_config(PG_URL, schema))
    store.migrate()
    truncate_store(store)
    settings = {
        "broker_connection_retry_on_startup": True,
        "task_ignore_result": True,
        "worker_prefetch_multiplier": 1,
        "lease_database_url": PG_URL,
        "lease_schema": schema,
        "lease_heartbeat_interval": interval,
        "lease_reaper_interval": interval,
        "lease_ttl": 10.0,
    }
    project = Project.write(
        ctx,
        broker_url=BROKERS["redis"],
        settings=settings,
        source=WORKER_SOURCE,
        env={"BENCH_DIR": str(BENCH_DIR), "BENCH_REDIS_URL": REDIS_URL},
    )
    module = project.load()
    queue = new_queue("heartbeat")
    key = f"bench:sql:{uuid.uuid4().hex[:8]}"
    window = ctx.scale(10.0, 2.0)
    hold = module.app.tasks["bench.hold"]
    worker = project.worker(
        queue,
        pool="threads",
        concurrency=max(running, 1),
        env={"BENCH_COUNT_SQL": key},
        loglevel="INFO",
    ).start()
    client = redis_client()
    try:
        ready = worker.wait_ready(90)
        # every task ends at about the end of the window: the warm stop waits for them
        hold_for = window
        for _ in range(running):
            hold.apply_async((hold_for,), queue=queue)
        if running:
            wait_for(
                lambda: store.counts()[_running()] >= running,
                60,
                f"{running} tasks running",
            )
        time.sleep(max(0.0, ready + window - time.time()))
        worker.stop(timeout=60)
        counts = {k.decode(): float(v) for k, v in client.hgetall(key).items()}
        # from the counters' reset (worker_ready) to their flush (worker_shutdown)
        measured = counts.pop("flushed_at") - counts.pop("reset_at")
    finally:
        worker.kill()
        from celery_lease._runtime import runtime

        runtime(module.app).reset()
        module.app.close()
        delete_queue(BROKERS["redis"], queue)
        client.delete(key)
        client.close()
        store.dispose()
    hb = summarize(counts, "celery-lease-heartbeat", measured)
    rp = summarize(counts, "celery-lease-reaper", measured)
    return {
        "running": running,
        "window_s": measured,
        "interval_s": interval,
        "heartbeat_statements_per_s": hb["statements"],
        "heartbeat_round_trips_per_s": hb["round_trips"],
        "reaper_statements_per_s": rp["statements"],
        "reaper_round_trips_per_s": rp["round_trips"],
    }


def _running() -> Any:
    from celery_lease.states import State

    return State.RUNNING


def run(ctx: Context) -> Section:
    """Heartbeat cost."""
    section = Section("heartbeat", "3. Heartbeat cost")
    started = time.time()
    results: list[dict[str, Any]] = []  # figures, and "store": the backend's name
    worker_results: list[dict[str, float]] = []
    with pg_schema("heartbeat") as schema:
        for kind in ("postgresql", "sqlite"):
            for leases in ctx.scale((1, 100, 10_000), (1, 100)):
                ctx.log(f"heartbeat: {kind}, {leases} leases")
                res = measure_store(ctx, kind, schema if kind == "postgresql" else None, leases)
                results.append({**res, "store": kind})
        for running in ctx.scale((0, 100), (0, 5)):
            ctx.log(f"heartbeat: real worker, {running} running leased tasks")
            worker_results.append(measure_worker_background(ctx, schema, running))
    section.data = {"store": results, "worker": worker_results}
    section.add(
        "The real `Heartbeat` thread renews one incarnation every 0.1 s for a few seconds "
        "while the incarnation owns N RUNNING rows; every statement it sends is counted "
        "(SQLAlchemy events). Then one renewal (`Store.renew`) is timed repeatedly.",
        "",
        *table(
            [
                "store",
                "running leases",
                "statements / renewal",
                "round trips / renewal",
                "renewal p50 (ms)",
                "renewal p99 (ms)",
            ],
            [
                (
                    r["store"],
                    int(r["leases"]),
                    r["statements_per_renewal"],
                    r["round_trips_per_renewal"],
                    r["latency_ms_p50"],
                    r["latency_ms_p99"],
                )
                for r in results
            ],
        ),
        "",
        "So per worker: one statement per `lease_heartbeat_interval` (0.2 statements/s at "
        "the default 5 s), the same with 1 or 10,000 leases. On PostgreSQL each renewal is "
        "one round trip: the pool pings a connection only after it sat idle for 10 s, and "
        "hands out the most recently used one first.",
        "",
        "A real worker (threads pool, PostgreSQL store, heartbeat and reaper interval "
        "0.5 s) holding N running leased tasks; background threads counted from "
        "`worker_ready` to a warm stop:",
        "",
        *table(
            [
                "running tasks",
                "window (s)",
                "heartbeat statements/s",
                "heartbeat round trips/s",
                "embedded reaper statements/s",
                "reaper round trips/s",
            ],
            [
                (
                    int(w["running"]),
                    w["window_s"],
                    w["heartbeat_statements_per_s"],
                    w["heartbeat_round_trips_per_s"],
                    w["reaper_statements_per_s"],
                    w["reaper_round_trips_per_s"],
                )
                for w in worker_results
            ],
        ),
        "",
        "The embedded reaper's cost is per worker too (per `lease_reaper_interval`: one lock "
        "renewal, four candidate queries, one check for audit rows to fold into the "
        "transition totals and one retention batch, each its own transaction); with "
        "several workers only the lock holder sweeps.",
        "",
        f"Load average at the end: {loadavg()}.",
    )
    plt = pyplot(ctx)
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for kind in ("postgresql", "sqlite"):
            rs = [r for r in results if r["store"] == kind]
            ax.plot(
                [r["leases"] for r in rs],
                [r["statements_per_renewal"] for r in rs],
                marker="o",
                label=f"{kind}: statements / renewal",
            )
        ax.set_xscale("log")
        ax.set_ylim(0, 3)
        ax.set_xlabel("running leases held by the worker")
        ax.set_ylabel("statements per renewal")
        ax.legend(fontsize=8)
        save_plot(ctx, section, fig, "heartbeat")
    section.seconds = time.time() - started
    return section


if __name__ == "__main__":
    raise SystemExit(standalone(run))
