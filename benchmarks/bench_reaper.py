"""Reaper at scale (PostgreSQL): a million rows, EXPLAIN of the candidate queries,
one full sweep, and claim latency while sweeps run.

The table is built set-based (``INSERT ... SELECT ... FROM generate_series``): mostly
terminal rows, 10,000 RUNNING (1,000 of them owned by a dead worker: expired), 10,000
RETRY_WAIT (1,000 due), 10,000 PENDING (published, waiting for claims), and one audit
row per task. The candidate queries are the exact statements the reaper sends: a
listener turns each ``SELECT ... FOR UPDATE`` of one sweep into
``EXPLAIN (ANALYZE, BUFFERS)`` and keeps the plan (the sweep then sees no candidate
and changes nothing).
"""

from __future__ import annotations

import random
import sys
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
    median,
    new_queue,
    percentile,
    pg_schema,
    pyplot,
    save_plot,
    standalone,
    table,
)

DEAD, LIVE = "w-dead", "w-live"


def build(store: Any, total: int, running: int, retry: int, pending: int) -> float:
    """Fill the tables set-based; returns the seconds it took."""
    from sqlalchemy import text

    t, tr, w = store.t.tasks, store.t.transitions, store.t.workers
    tasks = f'"{t.schema}"."{t.name}"'
    trans = f'"{tr.schema}"."{tr.name}"'
    workers = f'"{w.schema}"."{w.name}"'
    expired = running // 10
    due = retry // 10
    r_end, w_end, p_end = running, running + retry, running + retry + pending
    sql = f"""
    INSERT INTO {tasks} (id, name, state, attempt, token, owner, recoveries, retries,
        args, kwargs, options, lease_ttl, on_timeout, on_exhausted, max_recoveries,
        created_at, updated_at, published_at, publish_count, started_at, progress_at,
        finished_at, next_retry_at, result, reason)
    SELECT 'task-' || g,
        'bench.work',
        CASE WHEN g <= {r_end} THEN 'RUNNING'
             WHEN g <= {w_end} THEN 'RETRY_WAIT'
             WHEN g <= {p_end} THEN 'PENDING'
             WHEN g % 20 = 0 THEN 'FAILED'
             ELSE 'SUCCEEDED' END,
        CASE WHEN g <= {p_end} AND g > {w_end} THEN 0 ELSE 1 END,
        CASE WHEN g <= {r_end} THEN md5(g::text) END,
        CASE WHEN g <= {expired} THEN '{DEAD}' WHEN g <= {r_end} THEN '{LIVE}' END,
        0, CASE WHEN g > {r_end} AND g <= {w_end} THEN 1 ELSE 0 END,
        '[' || g || ']', '{{}}', '{{}}', 30, 'retry', 'fail', 5,
        now() - (g % 86400) * interval '1 second',
        now() - (g % 3600) * interval '1 second',
        CASE WHEN g > {w_end} AND g <= {p_end} THEN now() END,
        1,
        now() - interval '10 minutes', now() - interval '10 minutes',
        CASE WHEN g > {p_end} THEN now() - (g % 3600) * interval '1 second' END,
        CASE WHEN g > {r_end} AND g <= {r_end + due} THEN now() - interval '1 second'
             WHEN g > {r_end} AND g <= {w_end} THEN now() + interval '1 hour' END,
        CASE WHEN g > {p_end} THEN 'null' END,
        'built by the benchmark'
    FROM generate_series(1, {total}) AS g
    """
    audit = f"""
    INSERT INTO {trans} (task_id, from_state, to_state, reason, actor, attempt, at)
    SELECT id, NULL, 'PENDING', 'submitted', 'producer', 0, created_at FROM {tasks}
    """
    started = time.perf_counter()
    with store.engine.begin() as conn:
        # building the table is not a store call: lease_db_timeout does not bound it
        conn.execute(text("SET LOCAL statement_timeout = 0"))
        conn.execute(text(sql))
        conn.execute(text(audit))
        conn.execute(
            text(
                f"INSERT INTO {workers} (id, nodename, hostname, pid, started_at, heartbeat_at) "
                f"VALUES ('{DEAD}', 'dead@bench', 'bench', 1, now() - interval '2 hours', "
                f"now() - interval '1 hour'), ('{LIVE}', 'live@bench', 'bench', 2, now(), now())"
            )
        )
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("SET statement_timeout = 0"))
        conn.execute(text(f"VACUUM ANALYZE {tasks}"))
        conn.execute(text(f"VACUUM ANALYZE {trans}"))
    return time.perf_counter() - started


def rearm(store: Any, expired: int, due: int) -> None:
    """Make ``expired`` more RUNNING rows expired and ``due`` more RETRY_WAIT rows due."""
    from sqlalchemy import text

    t = store.t.tasks
    tasks = f'"{t.schema}"."{t.name}"'
    with store.engine.begin() as conn:
        conn.execute(
            text(
                f"UPDATE {tasks} SET owner = '{DEAD}' WHERE id IN (SELECT id FROM {tasks} "
                f"WHERE state = 'RUNNING' AND owner = '{LIVE}' LIMIT {expired})"
            )
        )
        conn.execute(
            text(
                f"UPDATE {tasks} SET next_retry_at = now() - interval '1 second' WHERE id IN "
                f"(SELECT id FROM {tasks} WHERE state = 'RETRY_WAIT' AND next_retry_at > now() "
                f"LIMIT {due})"
            )
        )


def explain_sweep(reaper: Any, store: Any) -> list[tuple[str, str]]:
    """Plans of every candidate query one sweep sends (the sweep then does nothing)."""
    from sqlalchemy import event

    plans: list[tuple[str, str]] = []

    def before(
        conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool
    ) -> Any:
        if statement.lstrip().upper().startswith("SELECT") and "FOR UPDATE" in statement:
            context._bench_explain = statement
            return "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + statement, params
        return statement, params

    def after(
        conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool
    ) -> None:
        original = getattr(context, "_bench_explain", None)
        if original is not None:
            plan = "\n".join(row[0] for row in cursor.fetchall())
            plans.append((original, plan))

    event.listen(store.engine, "before_cursor_execute", before, retval=True)
    event.listen(store.engine, "after_cursor_execute", after)
    try:
        reaper.sweep()
    finally:
        event.remove(store.engine, "before_cursor_execute", before)
        event.remove(store.engine, "after_cursor_execute", after)
    return plans


def timed_sweep(reaper: Any, store: Any) -> tuple[float, dict[str, float], Any]:
    """One sweep, with the time spent in each store operation."""
    phases: dict[str, float] = {}
    originals = {}
    for name in ("expire", "overrun", "take_due_retries", "take_unpublished", "mark_published"):
        fn = getattr(store, name)
        originals[name] = fn

        def wrapped(*args: Any, __fn: Any = fn, __name: str = name, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return __fn(*args, **kwargs)
            finally:
                phases[__name] = phases.get(__name, 0.0) + time.perf_counter() - t0

        setattr(store, name, wrapped)
    try:
        t0 = time.perf_counter()
        report = reaper.sweep()
        total = time.perf_counter() - t0
    finally:
        for name in originals:
            delattr(store, name)
    phases["publish (broker)"] = total - sum(phases.values())
    return total, phases, report


class Claimer(threading.Thread):
    """Claims PENDING rows one after another, recording each claim's latency."""

    def __init__(self, store: Any, ids: list[str]) -> None:
        super().__init__(daemon=True)
        self.store = store
        self.ids = ids
        self.latencies: list[tuple[float, float]] = []
        self.stop_event = threading.Event()
        self.refused = 0

    def run(self) -> None:
        from celery_lease.store import Refusal

        while self.ids and not self.stop_event.is_set():
            tid = self.ids.pop()
            t0 = time.perf_counter()
            got = self.store.claim(tid, LIVE, "worker:live@bench")
            self.latencies.append((time.time(), time.perf_counter() - t0))
            if isinstance(got, Refusal):
                self.refused += 1

    def between(self, start: float, end: float) -> list[float]:
        return [lat for at, lat in self.latencies if start <= at <= end]


def _keep_alive(store: Any, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        store.renew(LIVE)


def run(ctx: Context) -> Section:
    """Reaper at scale."""
    from celery import Celery

    from celery_lease.reaper import Reaper
    from celery_lease.store import Store

    section = Section("reaper", "4. Reaper at scale (PostgreSQL)")
    started = time.time()
    total = ctx.scale(1_000_000, 20_000)
    running, retry, pending = ctx.scale((10_000, 10_000, 10_000), (1_000, 1_000, 1_000))
    queue = new_queue("reaper")
    app = Celery("bench-reaper", broker=BROKERS["redis"], set_as_current=False)
    app.conf.update(task_default_queue=queue, broker_connection_retry_on_startup=True)
    with pg_schema("reaper") as schema:
        # rows PENDING for the whole benchmark must not look lost (republish_after)
        store = Store(lease_config(PG_URL, schema, republish_after=3600.0))
        stop = threading.Event()
        try:
            store.migrate()
            ctx.log(f"reaper: building {total:,} rows")
            build_s = build(store, total, running, retry, pending)
            ctx.log(f"reaper: built in {build_s:.1f} s")
            # the live worker's heartbeat was written when the build began: a build
            # slower than the TTL would leave its rows expired too
            store.renew(LIVE)
            keeper = threading.Thread(target=_keep_alive, args=(store, stop), daemon=True)
            keeper.start()
            reaper = Reaper(app, actor="reaper:bench", store=store)
            plans = explain_sweep(reaper, store)
            ctx.log("reaper: full sweep")
            sweep_s, phases, report = timed_sweep(reaper, store)
            idle = []
            for _ in range(ctx.scale(5, 2)):
                idle.append(timed_sweep(reaper, store)[0])
            # claim latency: baseline, then during sweeps that have work
            ctx.log("reaper: claim latency with and without sweeps")
            pending_ids = [
                f"task-{i}" for i in range(running + retry + 1, running + retry + pending + 1)
            ]
            random.shuffle(pending_ids)
            claimer = Claimer(store, pending_ids)
            claimer.start()
            time.sleep(ctx.scale(3.0, 0.5))
            base_window = (time.time() - ctx.scale(3.0, 0.5), time.time())
            during: list[float] = []
            sweep_times = []
            for _ in range(ctx.scale(3, 1)):
                rearm(store, ctx.scale(1000, 100), ctx.scale(1000, 100))
                a = time.time()
                sweep_times.append(timed_sweep(reaper, store)[0])
                during += claimer.between(a, time.time())
            claimer.stop_event.set()
            claimer.join(10)
            baseline = claimer.between(*base_window)
        finally:
            stop.set()
            store.dispose()
            delete_queue(BROKERS["redis"], queue)
            app.close()
    section.data = {
        "rows": total,
        "build_s": build_s,
        "sweep_s": sweep_s,
        "phases": phases,
        "report": report.as_dict(),
        "idle_sweep_s": idle,
        "claim_baseline_ms": [1000 * x for x in baseline],
        "claim_during_ms": [1000 * x for x in during],
    }
    seq_scans = [p for _, p in plans if "Seq Scan on lease_tasks" in p]
    section.data["plans"] = len(plans)
    section.data["seq_scans"] = len(seq_scans)
    section.add(
        f"Table: {total:,} tasks ({running:,} RUNNING of which {running // 10:,} owned by a dead "
        f"worker, {retry:,} RETRY_WAIT of which {retry // 10:,} due, {pending:,} PENDING, the "
        f"rest terminal) and {total:,} audit rows, built set-based in {build_s:.1f} s "
        "(`INSERT ... SELECT ... generate_series`, then `VACUUM ANALYZE`). Batch size 100 "
        "(the reaper's batch), broker Redis.",
        "",
        *table(
            ["measure", "value"],
            [
                ("one full sweep (s)", sweep_s),
                ("  rows expired (RUNNING -> TIMEOUT -> RETRY_WAIT)", report.expired),
                ("  due retries re-published", report.due),
                *[(f"  time in {k} (s)", v) for k, v in phases.items()],
                ("sweep with nothing to do, median (ms)", 1000 * median(idle)),
                ("sweeps with 1,000 + 1,000 rows of work, median (s)", median(sweep_times)),
                (
                    "claim latency without sweep p50 / p99 / max (ms)",
                    f"{1000 * median(baseline):.2f} / {1000 * percentile(baseline, 99):.2f} / "
                    f"{1000 * max(baseline, default=float('nan')):.2f} ({len(baseline)} claims)",
                ),
                (
                    "claim latency during sweeps p50 / p99 / max (ms)",
                    f"{1000 * median(during):.2f} / {1000 * percentile(during, 99):.2f} / "
                    f"{1000 * max(during, default=float('nan')):.2f} ({len(during)} claims)",
                ),
                ("claims refused (must be 0)", claimer.refused),
                (
                    "candidate plans with a sequential scan of the tasks table",
                    f"{len(seq_scans)} of {len(plans)}",
                ),
            ],
        ),
        "",
        "Candidate queries of one sweep (the exact SQL the reaper sends), with "
        "`EXPLAIN (ANALYZE, BUFFERS)` on the full table:",
        "",
    )
    for sql, plan in plans:
        shown = " ".join(sql.split()).replace(f"{schema}.", "")
        section.add("```sql", shown, "```", "```", plan, "```", "")
    section.add(f"Load average at the end: {loadavg()}.")
    plt = pyplot(ctx)
    if plt is not None and baseline and during:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.hist(
            [[1000 * x for x in baseline], [1000 * x for x in during]],
            bins=40,
            label=["no sweep", "during sweeps"],
            density=True,
        )
        ax.set_xlabel("claim latency (ms)")
        ax.set_ylabel("density")
        ax.set_yscale("log")
        ax.legend()
        save_plot(ctx, section, fig, "reaper-claims")
    section.seconds = time.time() - started
    return section


if __name__ == "__main__":
    raise SystemExit(standalone(run))
