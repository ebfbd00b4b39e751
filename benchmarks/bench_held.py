"""Long delays held in the store (issue 27, part 2): queue, worker memory, lateness.

N leased no-op tasks submitted with ETAs spread evenly over a window that starts
``LEAD`` seconds ahead (``submit_many``, PostgreSQL store, Redis broker), then one
worker (prefork, 2 processes; its embedded reaper at the default interval, 5 s). Every
second: the messages in the broker's queue (``LLEN``), the messages a worker has taken
and not acknowledged (kombu's ``unacked`` hash: an ETA task a worker holds in memory),
and the resident memory of the worker's processes. Side by side in the same run:
``lease_hold_eta_after`` 20 s (the tasks held in the store) and ``None`` (published at
once, as plain Celery). Lateness is read from the rows (database time): a task's
start (its claim) minus its ETA, and its publication minus its ETA (negative: published
ahead, the worker waiting out the rest).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    PG_URL,
    REDIS_URL,
    Context,
    Project,
    Section,
    clear_redis_unacked,
    delete_queue,
    flush_published,
    lease_config,
    loadavg,
    new_queue,
    percentile,
    pg_schema,
    redis_client,
    standalone,
    table,
)

SOURCE = """
from celery_lease import LeasedTask


@app.task(base=LeasedTask, name="bench.noop")
def noop(i):
    return i
"""

#: The held variant's threshold: below the benchmark's lead, so that every task is held
#: (a quick run's lead is 12 s: its threshold is 6 s).
HOLD_AFTER = 20.0
QUICK_HOLD_AFTER = 6.0


def rss_kib(pids: list[int]) -> int:
    """Resident memory of these processes together (KiB, from /proc)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def scenario(
    ctx: Context, hold: float | None, span: float | None = None, tasks: int | None = None
) -> dict[str, Any]:
    """One round: ``hold`` is ``lease_hold_eta_after``; ``tasks`` tasks (default 20,000,
    300 in a quick run) with ETAs spread over ``span`` seconds (default 120 s, 5 s in a
    quick run)."""
    from sqlalchemy import select

    from celery_lease import State
    from celery_lease._runtime import runtime
    from celery_lease.store.schema import seconds_between

    n = tasks or ctx.scale(20_000, 300)
    # the first ETA, seconds after submission starts: past the submission and the
    # worker's start, so that no task is due before the worker is there
    lead = ctx.scale(90.0, 12.0)
    span = span or ctx.scale(120.0, 5.0)  # ETAs spread evenly over this window
    queue = new_queue("held")
    clear_redis_unacked(REDIS_URL)
    client = redis_client()
    with pg_schema("held") as schema:
        cfg = lease_config(PG_URL, schema)
        settings = {
            "task_default_queue": queue,
            "broker_connection_retry_on_startup": True,
            "lease_database_url": cfg.database_url,
            "lease_schema": schema,
            "lease_auto_migrate": True,
            "lease_hold_eta_after": hold,
        }
        project = Project.write(ctx, broker_url=REDIS_URL, settings=settings, source=SOURCE)
        module = project.load()
        app = module.app
        store = runtime(app).store
        store.migrate()
        worker = None
        samples: list[tuple[float, int, int, int]] = []
        try:
            t0 = time.monotonic()
            items = [{"args": (i,), "countdown": lead + span * i / n} for i in range(n)]
            for start in range(0, n, 1000):
                app.tasks["bench.noop"].submit_many(items[start : start + 1000])
            submit_s = time.monotonic() - t0
            flush_published(store)
            worker = project.worker(
                queue, pool="prefork", concurrency=2, nodename="held@bench", loglevel="INFO"
            ).start()
            worker.wait_ready()
            deadline = time.monotonic() + lead + span + ctx.scale(300.0, 60.0)
            while store.live_counts()[State.PENDING] > 0 or store.live_counts()[State.RUNNING]:
                if time.monotonic() > deadline:
                    raise RuntimeError("the held tasks did not all run")
                pids = [p for p in [worker.pid, *worker.children()] if p]
                samples.append(
                    (
                        time.monotonic() - t0,
                        int(client.llen(queue)),
                        int(client.hlen("unacked")),
                        rss_kib(pids),
                    )
                )
                time.sleep(1.0)
            t = store.t.tasks
            with store.engine.connect() as conn:
                rows = conn.execute(
                    select(
                        seconds_between(t.c.started_at, t.c.eta).label("start"),
                        seconds_between(t.c.published_at, t.c.eta).label("publish"),
                    ).where(t.c.name == "bench.noop")
                ).all()
        finally:
            if worker is not None:
                worker.stop()
            runtime(app).reset()
            delete_queue(REDIS_URL, queue)
            clear_redis_unacked(REDIS_URL)
            client.close()
    # nothing due yet, nor published ahead (the reaper publishes up to its interval, 5 s,
    # before the ETA), with a second to spare
    before_first = [s for s in samples if s[0] < lead - 6.0]
    starts = [float(r.start) for r in rows if r.start is not None]
    publishes = [float(r.publish) for r in rows if r.publish is not None]
    return {
        "variant": f"held (lease_hold_eta_after {hold:g})" if hold else "None (plain)",
        "tasks": n,
        "lead": lead,
        "span": span,
        "submit_s": submit_s,
        "max_queue_before_due": max((s[1] for s in before_first), default=0),
        "max_unacked_before_due": max((s[2] for s in before_first), default=0),
        "rss_first_mib": samples[0][3] / 1024 if samples else 0.0,
        "rss_max_before_due_mib": max((s[3] for s in before_first), default=0) / 1024,
        "rss_max_mib": max((s[3] for s in samples), default=0) / 1024,
        "start_p50": percentile(starts, 50),
        "start_p95": percentile(starts, 95),
        "start_max": max(starts),
        "publish_p50": percentile(publishes, 50),
        "publish_p95": percentile(publishes, 95),
    }


class _Captured(Exception):
    """Raised by the statement listener: the sweep's SELECT is recorded, not run."""


def sweep_plan(ctx: Context, kind: str) -> list[str]:
    """The plan of the held sweep's SELECT over ``held`` rows held an hour ahead
    and 50 due, beside 20,000 PENDING rows not held: the statement the store runs
    (captured, not rebuilt here), explained as it stands."""
    import uuid

    from sqlalchemy import event

    from celery_lease.store import NewTask, Store

    held = ctx.scale(100_000, 2_000)
    url = PG_URL if kind == "postgresql" else f"sqlite:///{ctx.work_dir / 'plan.sqlite3'}"
    with pg_schema("heldplan") as schema:
        store = Store(lease_config(url, schema if kind == "postgresql" else None))
        try:
            store.migrate()

            def row(countdown: float | None, is_held: bool) -> NewTask:
                return NewTask(
                    id=uuid.uuid4().hex,
                    name="bench.noop",
                    args="[0]",
                    kwargs="{}",
                    options="{}",
                    lease_ttl=30.0,
                    max_recoveries=5,
                    countdown=countdown,
                    held=is_held,
                )

            rows = [row(60.0 + 3600.0 * i / held, True) for i in range(held)]
            rows += [row(-1.0, True) for _ in range(50)]
            rows += [row(None, False) for _ in range(20_000)]
            store.submit_many(rows)
            with store.engine.begin() as conn:
                conn.exec_driver_sql("ANALYZE")
            captured: list[tuple[str, Any]] = []

            def capture(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
                if statement.lstrip().upper().startswith("SELECT") and "held" in statement:
                    captured.append((statement, params))
                    raise _Captured

            event.listen(store.engine, "before_cursor_execute", capture)
            try:
                store.take_held()
            except _Captured:
                pass
            finally:
                event.remove(store.engine, "before_cursor_execute", capture)
            statement, params = captured[0]
            explain = (
                "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) "
                if kind == "postgresql"
                else "EXPLAIN QUERY PLAN "
            )
            with store.engine.connect() as conn:
                plan = conn.exec_driver_sql(explain + statement, params).all()
                conn.rollback()
            lines = [str(r[-1]) for r in plan]
        finally:
            store.dispose()
    shown = " ".join(statement.split())
    if kind == "postgresql":
        shown = shown.replace(f"{schema}.", "")  # the run's own schema, not worth reading
    return [shown, "", *lines]


def _rounds_table(section: Section, rows: list[dict[str, Any]]) -> None:
    r0 = rows[0]
    last = f" (and, last row, to {r0['lead'] + 600:.0f} s)" if len(rows) > 2 else ""
    section.add(
        f"{r0['tasks']:,} no-op tasks submitted with `submit_many`, their ETAs spread evenly "
        f"from {r0['lead']:.0f} s to {r0['lead'] + r0['span']:.0f} s ahead{last} (PostgreSQL "
        "store, Redis broker); one worker, prefork with 2 processes, its embedded reaper "
        "every 5 s (the default). Sampled every second; lateness from the rows, in "
        "database time (publication before the ETA is negative: the reaper publishes a "
        "held row up to one reaper interval ahead and the worker waits out the rest).",
        "",
        *table(
            [
                "lease_hold_eta_after",
                "due per second",
                "submit (s)",
                "most in queue before due",
                "most held by the worker before due",
                "worker RSS at start (MiB)",
                "most before due (MiB)",
                "most (MiB)",
                "start - ETA p50 / p95 / max (s)",
                "publish - ETA p50 / p95 (s)",
            ],
            [
                (
                    r["variant"],
                    f"{r['tasks'] / r['span']:.0f}",
                    f"{r['submit_s']:.1f}",
                    f"{r['max_queue_before_due']:,}",
                    f"{r['max_unacked_before_due']:,}",
                    f"{r['rss_first_mib']:.0f}",
                    f"{r['rss_max_before_due_mib']:.0f}",
                    f"{r['rss_max_mib']:.0f}",
                    f"{r['start_p50']:.2f} / {r['start_p95']:.2f} / {r['start_max']:.2f}",
                    f"{r['publish_p50']:.2f} / {r['publish_p95']:.2f}",
                )
                for r in rows
            ],
        ),
        "",
        f"Load average at the end: {loadavg()}.",
    )


def run(ctx: Context) -> Section:
    """Long delays held in the store."""
    section = Section("held", "13. Long delays held in the store (issue 27, part 2)")
    rows = []
    for hold in (ctx.scale(HOLD_AFTER, QUICK_HOLD_AFTER), None):
        ctx.log(f"held: lease_hold_eta_after={hold}")
        rows.append(scenario(ctx, hold))
    if not ctx.quick:  # the same tasks due at a fifth of the rate (the is lower)
        ctx.log("held: lease_hold_eta_after=20, ETAs over 600 s")
        rows.append(scenario(ctx, HOLD_AFTER, span=600.0))
    section.data = {"rounds": rows}
    _rounds_table(section, rows)
    for kind in ("postgresql", "sqlite"):
        ctx.log(f"held: the sweep's plan on {kind}")
        statement, _, *plan = sweep_plan(ctx, kind)
        section.add(
            "",
            f"The held sweep's statement on {kind}, over {ctx.scale(100_000, 2_000):,} rows "
            "held an hour ahead, 50 due and 20,000 PENDING rows not held (the partial "
            "index has an entry for each held row only; the sweep reads the due ones):",
            "",
            "```",
            statement,
            "```",
            "",
            "```",
            *plan,
            "```",
        )
    return section


def run_long(ctx: Context, tasks: int, span: float) -> Section:
    """The held round alone, ``tasks`` tasks over ``span`` seconds (the issue's target:
    100,000 over an hour)."""
    section = Section("held", f"Long delays held in the store: {tasks:,} over {span:g} s")
    rows = [scenario(ctx, ctx.scale(HOLD_AFTER, QUICK_HOLD_AFTER), span=span, tasks=tasks)]
    section.data = {"rounds": rows}
    _rounds_table(section, rows)
    return section


if __name__ == "__main__":
    import argparse

    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--tasks", type=int, default=None, help="the held round alone: N tasks")
    extra.add_argument("--span", type=float, default=3600.0, help="... with ETAs over S s")
    args, rest = extra.parse_known_args()
    if args.tasks is None:
        raise SystemExit(standalone(run, rest))
    long_run = lambda ctx: run_long(ctx, args.tasks, args.span)  # noqa: E731
    long_run.__doc__ = run_long.__doc__
    raise SystemExit(standalone(long_run, rest))
