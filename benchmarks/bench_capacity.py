"""Capacity: what 4 workers x prefork 2 sustain on one PostgreSQL store here.

A backlog of no-op LeasedTasks is written in bulk (``submit_many``) and published to
Redis; then four workers (prefork, 2 processes each, on this same 2-core machine) drain
it. Measured over the drain, from the first completion to the last: tasks per second,
and at the database (``pg_stat_database`` of the store's database and
``pg_current_wal_lsn()``, from before the submission to after every connection closed)
transactions committed, rows written and WAL bytes, per second and per task. Plain
Celery drains the same backlog with the same workers beside it, for the ceiling the
machine itself sets.

What it is for: sizing a cluster. The database's cost per task (transactions, rows,
WAL) does not depend on how many workers share it; the machine's CPU here does bound
the task rate, since the workers, Redis and PostgreSQL share two cores.
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
    done_count,
    done_times,
    libpq_url,
    loadavg,
    median,
    new_queue,
    pg_schema,
    standalone,
    table,
    wait_for,
)

#: Task names carry the queue's name: every drain loads a project of its own into this
#: process, and Celery warns about one name registered to two callables.
SOURCE = """
from celery_lease import LeasedTask


@app.task(name="{queue}.plain_noop")
def plain_noop(i):
    return i


@app.task(base=LeasedTask, name="{queue}.leased_noop")
def leased_noop(i):
    return i
"""

WORKERS = 4
PROCESSES = 2


def db_counters() -> dict[str, int]:
    """The store database's commit and row counters, and the WAL position (bytes)."""
    import psycopg

    with psycopg.connect(libpq_url(PG_URL), autocommit=True, connect_timeout=5) as conn:
        # the statistics snapshot of this transaction would otherwise be reused
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT xact_commit, tup_inserted + tup_updated + tup_deleted, "
            "pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint "
            "FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    assert row is not None
    return {"commits": int(row[0]), "rows": int(row[1]), "wal": int(row[2])}


def drain(ctx: Context, leased: bool, n: int) -> dict[str, Any]:
    from celery_lease._runtime import runtime

    broker_url = BROKERS["redis"]
    queue = new_queue("capacity")
    done_dir = ctx.work_dir / f"capacity-done-{queue}"
    done_dir.mkdir(parents=True)
    with pg_schema("capacity") as schema:
        settings = {
            "task_default_queue": queue,
            "broker_connection_retry_on_startup": True,
            "lease_database_url": PG_URL,
            "lease_schema": schema,
            "lease_auto_migrate": True,
            "worker_prefetch_multiplier": 4,
        }
        project = Project.write(
            ctx,
            broker_url=broker_url,
            settings=settings,
            source=SOURCE.format(queue=queue),
            env={"BENCH_DONE_DIR": str(done_dir)},
        )
        module = project.load()
        app = module.app
        name = f"{queue}.leased_noop" if leased else f"{queue}.plain_noop"
        task = app.tasks[name]
        store = runtime(app).store  # migrated now, outside the measured window
        workers = []
        try:
            before = db_counters()
            if leased:
                for start in range(0, n, 1000):
                    task.submit_many([((i,), {}) for i in range(start, min(n, start + 1000))])
            else:
                for i in range(n):
                    task.apply_async((i,))
            for k in range(WORKERS):
                workers.append(
                    project.worker(
                        queue,
                        pool="prefork",
                        concurrency=PROCESSES,
                        nodename=f"capacity{k}@bench",
                    ).start()
                )
            wait_for(
                lambda: any(w.check_alive() for w in workers) or done_count(done_dir) >= n,
                ctx.scale(600.0, 120.0),
                f"{name}: backlog drained",
                interval=0.1,
            )
            if leased:
                # the outcomes are written in batches by each worker's main process
                wait_for(
                    lambda: sum(store.live_counts().values()) == 0,
                    60.0,
                    "every outcome written",
                    interval=0.1,
                )
            times = done_times(done_dir)
        finally:
            for w in workers:
                w.stop()
            runtime(app).reset()
            delete_queue(broker_url, queue)
        # every connection of the run is closed now: PostgreSQL has its statistics
        after = db_counters()
    seconds = max(times[-1] - times[0], 1e-9)
    return {
        "variant": "LeasedTask, PostgreSQL" if leased else "plain Celery",
        "tasks": n,
        "seconds": seconds,
        "rate": (n - 1) / seconds,
        **{f"{k}_per_task": (after[k] - before[k]) / n for k in before},
        **{f"{k}_per_s": (after[k] - before[k]) / n * ((n - 1) / seconds) for k in before},
    }


def run(ctx: Context) -> Section:
    """Capacity of one PostgreSQL store."""
    section = Section("capacity", "11. Capacity: 4 workers x prefork 2 on one PostgreSQL")
    started = time.time()
    n = ctx.scale(20_000, 200)
    rounds = ctx.scale(3, 1)
    rows = []
    for r in range(rounds):
        for leased in (True, False) if r % 2 == 0 else (False, True):
            ctx.log(f"capacity: {'leased' if leased else 'plain'} #{r}, {n} tasks")
            out = drain(ctx, leased, n)
            ctx.log(f"  {out['rate']:.0f} tasks/s")
            rows.append(out)
    section.data = {"rounds": rows}
    by_variant: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_variant.setdefault(row["variant"], []).append(row)

    def med(variant: str, key: str) -> float:
        return median([r[key] for r in by_variant[variant]])

    leased, plain = "LeasedTask, PostgreSQL", "plain Celery"
    section.add(
        f"A backlog of {n:,} no-op tasks, drained by {WORKERS} workers x prefork "
        f"{PROCESSES} (Redis broker, prefetch 4) on this 2-core machine, which also runs "
        "Redis and PostgreSQL. Rate from the first completion to the last; database "
        "figures are the store database's `pg_stat_database` counters (transactions "
        "committed; rows inserted, updated and deleted) and `pg_current_wal_lsn()`, "
        "read before the backlog is submitted and once every connection of the run has "
        "closed (so the submission, the workers' start, heartbeats and shutdown count "
        f"too). Median of {rounds} rounds, plain Celery and leased alternating.",
        "",
        *table(
            [
                "variant",
                "tasks/s",
                "vs plain",
                "transactions / task",
                "transactions/s",
                "rows written / task",
                "WAL bytes / task",
                "WAL MB/s",
            ],
            [
                (
                    v,
                    f"{med(v, 'rate'):.0f}",
                    f"{med(v, 'rate') / med(plain, 'rate'):.2f}x",
                    f"{med(v, 'commits_per_task'):.2f}",
                    f"{med(v, 'commits_per_s'):.0f}",
                    f"{med(v, 'rows_per_task'):.2f}",
                    f"{med(v, 'wal_per_task'):.0f}",
                    f"{med(v, 'wal_per_s') / 1e6:.2f}",
                )
                for v in (leased, plain)
            ],
        ),
        "",
        "Sizing a cluster from it: the store's cost per leased task is the row above "
        "(the plain row is the background of the same database: autovacuum, statistics), "
        "and it does not grow with the number of workers. For a target rate R, the "
        "database must commit about R x (transactions / task) transactions per second "
        "and write R x (WAL bytes / task) of WAL; compare that with what "
        "`pgbench -N` sustains on the production database server. The workers' own "
        "capacity scales with their CPUs, as plain Celery's does, at the ratio in "
        "section 1.",
        "",
        f"Load average at the end: {loadavg()}.",
    )
    section.seconds = time.time() - started
    return section


if __name__ == "__main__":
    raise SystemExit(standalone(run))
