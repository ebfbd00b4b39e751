"""Operations at scale (PostgreSQL): retention's purge rate on a large table, claim
latency while it purges, and the plans and cost of the health figures.

The table is built set-based (``INSERT ... SELECT ... FROM generate_series``) with the
secondary indexes dropped and built again afterwards (much faster than maintaining
them row by row): ``CELERY_LEASE_BENCH_OPS_ROWS`` tasks (default 10,000,000), of which
10% finished within the last two hours (the health window), 10,000 PENDING (claimed
during the purge), 1,000 RUNNING, 100 RUNNING owned by a dead worker (zombies),
1,000 WAIT_MANUAL finished a month ago (must never be purged), and the rest finished
8 to 37 days ago (older than the default retention of 7 days). Three audit rows per
task and one recorded step per ten.

The transition counters: the table is built with an empty transition-totals table
(watermark 0), as a database just migrated to schema version 5 over a full audit
table is. The first Prometheus scrape is timed then (the reaper has folded nothing:
the scrape counts a capped tail and reports the lag), then the reaper's fold
(``Reaper.fold_transitions``, its bounded batches) is timed until it has caught up,
and the first scrape of a fresh collector afterwards, with ``EXPLAIN`` of every query
of the scrapes and of one fold batch.

The purge runs the reaper's own retention batches (``Reaper.purge_expired``) for a
fixed time; a second thread claims PENDING rows one after another the whole time.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    PG_URL,
    Context,
    Section,
    lease_config,
    loadavg,
    median,
    percentile,
    pg_schema,
    standalone,
    table,
)

LIVE, DEAD = "w-live", "w-dead"
PENDING, RUNNING, ZOMBIES, MANUAL = 10_000, 1_000, 100, 1_000


def build(store: Any, total: int, ctx: Context) -> dict[str, float]:
    """Fill the tables; returns seconds per phase."""
    from sqlalchemy import text

    t, tr, s, w = store.t.tasks, store.t.transitions, store.t.steps, store.t.workers

    def q(table: Any) -> str:
        return f'"{table.schema}"."{table.name}"'

    young = total // 10
    p_end = PENDING
    r_end = p_end + RUNNING
    z_end = r_end + ZOMBIES
    m_end = z_end + MANUAL
    y_end = m_end + young
    tasks_sql = f"""
    INSERT INTO {q(t)} (id, name, state, attempt, token, owner, recoveries, retries,
        args, kwargs, options, lease_ttl, max_runtime, on_timeout, on_exhausted,
        max_recoveries, created_at, updated_at, published_at, publish_count, started_at,
        progress_at, finished_at, result, reason)
    SELECT 'task-' || g,
        'bench.t' || (g % 5),
        CASE WHEN g <= {p_end} THEN 'PENDING'
             WHEN g <= {z_end} THEN 'RUNNING'
             WHEN g <= {m_end} THEN 'WAIT_MANUAL'
             WHEN g % 20 = 0 THEN 'FAILED'
             WHEN g % 50 = 1 THEN 'CANCELLED'
             ELSE 'SUCCEEDED' END,
        CASE WHEN g <= {p_end} THEN 0 ELSE 1 END,
        CASE WHEN g > {p_end} AND g <= {z_end} THEN md5(g::text) END,
        CASE WHEN g > {p_end} AND g <= {r_end} THEN '{LIVE}'
             WHEN g > {r_end} AND g <= {z_end} THEN '{DEAD}'
             WHEN g > {p_end} THEN '{LIVE}' END,
        0, 0, '[' || g || ']', '{{}}', '{{}}', 30,
        CASE WHEN g % 5 = 0 THEN 60 END,
        'retry', 'fail', 5,
        base.at, base.at,
        CASE WHEN g <= {p_end} THEN now() END, 1,
        CASE WHEN g > {p_end} THEN base.at + interval '1 second' END,
        CASE WHEN g > {p_end} THEN base.at + interval '1 second' END,
        CASE WHEN g > {z_end}
             THEN base.at + interval '1 second' + (g % 5 + 1) * (g % 1000) * interval '1 ms'
             END,
        CASE WHEN g > {z_end} THEN 'null' END,
        'built by the benchmark'
    FROM generate_series(1, {total}) AS g,
    LATERAL (SELECT CASE
        WHEN g <= {p_end} THEN now() - interval '10 seconds'
        WHEN g <= {z_end} THEN now() - (g % 600) * interval '1 second'
        WHEN g <= {m_end} THEN now() - interval '30 days'
        WHEN g <= {y_end} THEN now() - (g % 7200) * interval '1 second' - interval '10 s'
        ELSE now() - interval '8 days' - (g % 2592000) * interval '1 second' END AS at) AS base
    """
    audit_sql = f"""
    INSERT INTO {q(tr)} (task_id, from_state, to_state, reason, actor, attempt, at)
    SELECT id, k.f, k.t, 'built', 'bench', 1, created_at
    FROM {q(t)}, (VALUES (NULL, 'PENDING', 1), ('PENDING', 'RUNNING', 2),
                         ('RUNNING', 'SUCCEEDED', 3)) AS k(f, t, n)
    WHERE state <> 'PENDING' OR k.n = 1
    """
    steps_sql = f"""
    INSERT INTO {q(s)} (task_id, name, state, idempotent, checkable, attempt, result,
        started_at, finished_at)
    SELECT id, 'a', 'DONE', true, false, 1, 'null', created_at, created_at FROM {q(t)}
    WHERE state <> 'PENDING' AND right(id, 1) = '0'
    """
    times: dict[str, float] = {}
    indexes = [*t.indexes, *tr.indexes]
    # building takes minutes: no statement timeout (lease_db_timeout) on these
    no_timeout = text("SET LOCAL statement_timeout = 0")
    with store.engine.begin() as conn:
        conn.execute(no_timeout)
        for index in indexes:
            index.drop(conn)
    for label, sql in (("tasks", tasks_sql), ("audit", audit_sql), ("steps", steps_sql)):
        ctx.log(f"operations: inserting {label}")
        t0 = time.perf_counter()
        with store.engine.begin() as conn:
            conn.execute(no_timeout)
            conn.execute(text(sql))
        times[f"insert {label}"] = time.perf_counter() - t0
    ctx.log("operations: building indexes")
    t0 = time.perf_counter()
    with store.engine.begin() as conn:
        conn.execute(no_timeout)
        conn.execute(text("SET LOCAL maintenance_work_mem = '512MB'"))
        for index in indexes:
            index.create(conn)
        conn.execute(
            text(
                f"INSERT INTO {q(w)} (id, nodename, hostname, pid, started_at, heartbeat_at) "
                f"VALUES ('{DEAD}', 'dead@bench', 'bench', 1, now() - interval '2 hours', "
                f"now() - interval '1 hour'), ('{LIVE}', 'live@bench', 'bench', 2, now(), now())"
            )
        )
    times["build indexes"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("SET statement_timeout = 0"))
        for table_ in (t, tr, s):
            conn.execute(text(f"VACUUM ANALYZE {q(table_)}"))
    times["vacuum analyze"] = time.perf_counter() - t0
    return times


def explain(store: Any, fn: Any) -> list[tuple[str, str]]:
    """Plans (``EXPLAIN (ANALYZE, BUFFERS)``) of every query that ``fn()`` sends, each
    explained on a connection of its own and rolled back (a retention batch explained
    deletes nothing), while ``fn()`` itself runs as usual."""
    from sqlalchemy import event

    plans: list[tuple[str, str]] = []
    raw = store.engine.raw_connection()

    def before(
        conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool
    ) -> None:
        if many or not statement.lstrip().upper().startswith(("SELECT", "WITH")):
            return
        try:
            cur = raw.cursor()
            cur.execute("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + statement, params)
            plans.append((statement, "\n".join(row[0] for row in cur.fetchall())))
        finally:
            raw.rollback()

    event.listen(store.engine, "before_cursor_execute", before)
    try:
        fn()
    finally:
        event.remove(store.engine, "before_cursor_execute", before)
        raw.close()
    return plans


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
            time.sleep(0.002)  # a steady trickle, not a flood: latency, not throughput

    def between(self, start: float, end: float) -> list[float]:
        return [lat for at, lat in self.latencies if start <= at <= end]


def _counter_rows(counters: dict[str, Any], cfg: Any) -> list[tuple[str, Any]]:
    """The transition counters' rows of the table (none without prometheus-client)."""
    if not counters:
        return [("Prometheus scrapes", "not measured: prometheus-client is not installed")]
    cold, warm = counters["cold"], counters["warm"]
    rate = counters["folded"] / counters["fold_s"] if counters["fold_s"] else 0.0
    return [
        ("audit rows (highest audit id)", f"{counters['audit_rows']:,}"),
        (
            "first scrape, nothing folded yet (s; `celery_lease_up`)",
            f"{counters['cold_s']:.3f} (up={cold['up']:.0f})",
        ),
        (
            "  its transitions counted / fold lag / uncounted (audit ids)",
            f"{cold['transitions']:,.0f} / {cold.get('fold_lag', 0):,.0f} / "
            f"{cold.get('uncounted', 0):,.0f}",
        ),
        (
            f"reaper fold to catch up (one batch explained, then {counters['fold_sweeps'] - 1} "
            f"reaper fold passes of up to 20 batches of {cfg.totals_batch_size:,} ids)",
            f"{counters['folded']:,} rows in {counters['fold_s']:.1f} s ({rate:,.0f} rows/s)",
        ),
        (
            "first scrape of a fresh collector after the fold (s)",
            f"{counters['warm_s']:.3f} (up={warm['up']:.0f})",
        ),
        (
            "  its transitions counted / fold lag / uncounted",
            f"{warm['transitions']:,.0f} / {warm.get('fold_lag', 0):,.0f} / "
            f"{warm.get('uncounted', 0):,.0f}",
        ),
        ("scrape after the fold, median of 3 more (s)", median(counters["warm_again_s"])),
    ]


def _ms(values: list[float]) -> str:
    if not values:
        return "-"
    return (
        f"{1000 * median(values):.2f} / {1000 * percentile(values, 99):.2f} / "
        f"{1000 * max(values):.2f} ({len(values)} claims)"
    )


def _scrape(app: Any, store: Any) -> tuple[float, dict[str, float], list[tuple[str, str]]]:
    """A fresh collector's first scrape: (seconds, the counters' gauges, its plans)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from celery_lease.metrics import registry

    t0 = time.perf_counter()
    body = generate_latest(registry(app, store)).decode()
    took = time.perf_counter() - t0
    gauges: dict[str, float] = {"up": 0.0, "transitions": 0.0}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == "celery_lease_up":
                gauges["up"] = sample.value
            elif sample.name == "celery_lease_transitions_total":
                gauges["transitions"] += sample.value
            elif sample.name in (
                "celery_lease_transitions_fold_lag",
                "celery_lease_transitions_uncounted",
            ):
                gauges[sample.name.removeprefix("celery_lease_transitions_")] = sample.value
    plans = explain(store, lambda: generate_latest(registry(app, store)))
    return took, gauges, plans


def measure_counters(app: Any, store: Any, ctx: Context) -> dict[str, Any]:
    """The transition counters on the full audit table: before and after the fold."""
    from celery_lease.reaper import Reaper

    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return {}
    out: dict[str, Any] = {}
    ctx.log("operations: first scrape, nothing folded")
    out["cold_s"], out["cold"], cold_plans = _scrape(app, store)
    reaper = Reaper(app, actor="reaper:bench", store=store)
    ctx.log("operations: folding the audit table")
    first: list[Any] = []
    t0 = time.perf_counter()
    out["fold_plans"] = explain(store, lambda: first.append(store.fold_transitions()))
    sweeps, folded = 1, first[0].rows  # one batch, explained (its time counts)
    while True:
        n = reaper.fold_transitions()
        if n == 0:
            break
        folded += n
        sweeps += 1
    out["fold_s"] = time.perf_counter() - t0
    out["folded"], out["fold_sweeps"] = folded, sweeps
    out["warm_s"], out["warm"], warm_plans = _scrape(app, store)
    again = []
    for _ in range(3):
        t0 = time.perf_counter()
        _scrape_once(app, store)
        again.append(time.perf_counter() - t0)
    out["warm_again_s"] = again
    out["audit_rows"] = store.transition_totals().top
    out["plans"] = [("cold", *p) for p in cold_plans] + [("warm", *p) for p in warm_plans]
    return out


def _scrape_once(app: Any, store: Any) -> None:
    from prometheus_client import generate_latest

    from celery_lease.metrics import registry

    generate_latest(registry(app, store))


def run(ctx: Context) -> Section:
    """Retention and health figures at scale."""
    from celery import Celery

    from celery_lease import State, admin
    from celery_lease._runtime import runtime
    from celery_lease.reaper import Reaper

    section = Section("operations", "9. Retention and health figures at scale (PostgreSQL)")
    total = ctx.scale(int(os.environ.get("CELERY_LEASE_BENCH_OPS_ROWS", "10000000")), 30_000)
    purge_for = ctx.scale(60.0, 3.0)
    app = Celery("bench-operations", set_as_current=False)
    with pg_schema("operations") as schema:
        cfg = lease_config(PG_URL, schema, republish_after=3600.0)
        app.conf.update(
            lease_database_url=cfg.database_url,
            lease_schema=schema,
            lease_republish_after=cfg.republish_after,
            lease_auto_migrate=True,
        )
        rt = runtime(app)
        store = rt.store  # the admin API and the metrics read this store
        try:
            ctx.log(f"operations: building {total:,} rows")
            build_times = build(store, total, ctx)
            ctx.log(f"operations: built {build_times}")
            store.renew(LIVE)
            api = admin(app)
            stats_plans = explain(store, lambda: api.stats())
            t0 = time.perf_counter()
            snapshot = api.stats()
            stats_s = time.perf_counter() - t0
            stats_again = []
            for _ in range(3):
                t0 = time.perf_counter()
                api.stats()
                stats_again.append(time.perf_counter() - t0)
            counters = measure_counters(app, store, ctx)
            purge_plans = explain(store, lambda: store.purge_expired(cfg.retention, limit=1000))
            # purge the whole time while a claimer claims; baseline first
            reaper = Reaper(app, actor="reaper:bench", store=store)
            ids = [f"task-{i}" for i in range(1, PENDING + 1)]
            random.shuffle(ids)
            claimer = Claimer(store, ids)
            claimer.start()
            base_start = time.time()
            time.sleep(ctx.scale(5.0, 0.5))
            base_end = time.time()
            ctx.log(f"operations: purging for {purge_for:.0f} s")
            purged = 0
            sweeps = 0
            p_start = time.time()
            while time.time() - p_start < purge_for:
                purged += reaper.purge_expired()
                sweeps += 1
            p_end = time.time()
            claimer.stop_event.set()
            claimer.join(10)
            baseline = claimer.between(base_start, base_end)
            during = claimer.between(p_start, p_end)
            manual_left = store.counts()[State.WAIT_MANUAL]
        finally:
            rt.reset()
            app.close()
    rate = purged / (p_end - p_start)
    seq = [p for _, p in [*stats_plans, *purge_plans] if "Seq Scan on lease_tasks" in p]
    scrape_plans = [(sql, plan) for _, sql, plan in counters.get("plans", [])]
    big = ("Seq Scan on lease_tasks", "Seq Scan on lease_transitions")
    scrape_seq = [p for _, p in scrape_plans if any(b in p for b in big)]
    fold_plans = counters.get("fold_plans", [])
    section.data = {
        "rows": total,
        "build": build_times,
        "stats_s": stats_s,
        "stats_again_s": stats_again,
        "counters": {k: v for k, v in counters.items() if not k.endswith("plans")},
        "scrape_seq_scans": len(scrape_seq),
        "purged": purged,
        "purge_seconds": p_end - p_start,
        "purge_rate": rate,
        "claim_baseline_ms": [1000 * x for x in baseline],
        "claim_during_ms": [1000 * x for x in during],
        "refused": claimer.refused,
        "manual_left": manual_left,
        "seq_scans": len(seq),
        "plans": len(stats_plans) + len(purge_plans),
        "health": snapshot.as_dict(),
    }
    built = sum(build_times.values())
    section.add(
        f"Table: {total:,} tasks and about {3 * total:,} audit rows and {total // 10:,} steps, "
        f"built set-based in {built:.0f} s ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in build_times.items())
        + f"). {total - total // 10 - PENDING - RUNNING - ZOMBIES - MANUAL:,} rows finished "
        "8 to 37 days ago (older than the default `lease_retention` of 7 days); "
        f"{total // 10:,} finished in the last two hours; {PENDING:,} PENDING, "
        f"{RUNNING:,} RUNNING, {ZOMBIES} zombies, {MANUAL:,} WAIT_MANUAL finished a month ago.",
        "",
        *table(
            ["measure", "value"],
            [
                (
                    f"retention: rows purged in {p_end - p_start:.0f} s "
                    f"({sweeps} reaper retention passes of up to 20 batches of "
                    f"{cfg.retention_batch_size})",
                    f"{purged:,}",
                ),
                (
                    "retention: purge rate (tasks/s, with their audit rows and steps)",
                    f"{rate:,.0f}",
                ),
                ("claim latency before the purge p50 / p99 / max (ms)", _ms(baseline)),
                ("claim latency during the purge p50 / p99 / max (ms)", _ms(during)),
                ("claims refused (must be 0)", claimer.refused),
                ("WAIT_MANUAL rows left (must be 1,000)", f"{manual_left:,}"),
                ("`admin(app).stats()` (`lease stats`), first call (s)", stats_s),
                ("`admin(app).stats()`, median of 3 more (s)", median(stats_again)),
                *_counter_rows(counters, cfg),
                (
                    "scrape plans with a sequential scan of the tasks or audit table",
                    f"{len(scrape_seq)} of {len(scrape_plans)}",
                ),
                (
                    "plans with a sequential scan of the tasks table",
                    f"{len(seq)} of {len(stats_plans) + len(purge_plans)}",
                ),
            ],
        ),
        "",
        "Queries of `stats()` and of one retention batch (the exact SQL sent), with "
        "`EXPLAIN (ANALYZE, BUFFERS)` on the full table:",
        "",
    )
    for sql, plan in [*stats_plans, *purge_plans]:
        shown = " ".join(sql.split()).replace(f"{schema}.", "")
        section.add("```sql", shown, "```", "```", plan, "```", "")
    if counters:
        section.add(
            "The transition counters' queries: a scrape's (a fresh collector, nothing folded "
            "yet, then after the fold; the queries shared with `stats()` are above) and one "
            "fold batch's, with `EXPLAIN (ANALYZE, BUFFERS)`:",
            "",
        )
        seen: set[str] = set()
        counter_plans = [(w, q, p) for w, q, p in counters["plans"]]
        counter_plans += [("fold", q, p) for q, p in fold_plans]
        for when, sql, plan in counter_plans:
            if not any(
                name in sql for name in ("lease_transition", "FROM lease_counters", "lease_workers")
            ):
                continue  # the stats() queries, shown above
            key = f"{when}:{sql}"
            if key in seen:
                continue
            seen.add(key)
            shown = " ".join(sql.split()).replace(f"{schema}.", "")
            section.add(f"{when}:", "", "```sql", shown, "```", "```", plan, "```", "")
    section.add(f"Load average at the end: {loadavg()}.")
    return section


if __name__ == "__main__":
    raise SystemExit(standalone(run))
