"""Bulk submission and retry latency.

1. Submission of a ``group`` of N no-op tasks (Redis broker, no worker running), side
   by side in one run, alternating, medians: a plain Celery group; a leased group
   submitted one row at a time (a plain ``group(...).apply_async()``); the same leased
   group inside ``celery_lease.bulk()``; and ``LeasedTask.submit_many`` of N items.
   PostgreSQL and SQLite stores. Reported: seconds, tasks/s, rows/s into the store, and
   the ratio to the plain group.
2. Retry latency: a leased task that calls ``self.retry(countdown=0.5)`` once, on a
   real worker (prefork 2, Redis, SQLite and PostgreSQL stores): the time from the
   claim of the attempt that retried (its PENDING -> RUNNING audit row: the task calls
   ``retry()`` at once) to the claim of the retry, in database time, p50 and p95 over
   the tasks; and from its RUNNING -> RETRY_WAIT row, which the worker's outcome writer
   writes up to its flush interval (50 ms) after the task asked. The writer
   publishes the retry's message after that row, with what is left of its countdown.

    python benchmarks/bench_bulk.py [--quick]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    REDIS_URL,
    Context,
    Project,
    Section,
    delete_queue,
    median,
    new_queue,
    percentile,
    pg_schema,
    standalone,
    store_url,
    table,
    wait_for,
)

SOURCE = """
from celery_lease import LeasedTask

@app.task(shared=False, name="b.plain")
def plain(i):
    return i

@app.task(base=LeasedTask, shared=False, name="b.leased")
def leased(i):
    return i

@app.task(base=LeasedTask, bind=True, shared=False, name="b.retry_once", max_retries=3)
def retry_once(self, i):
    if self.request.retries == 0:
        raise self.retry(countdown=0.5)
    return i
"""

#: "leased group" is a plain ``group(...).apply_async()`` of a leased task, which writes
#: its rows in multi-row statements by itself (``lease_batch_groups``).
VARIANTS = ("plain group", "leased group", "leased group in bulk()", "submit_many")


def _project(ctx: Context, url: str, schema: str | None) -> Any:
    settings: dict[str, Any] = {"lease_database_url": url, "lease_auto_migrate": True}
    if schema is not None:
        settings["lease_schema"] = schema
    return Project.write(ctx, broker_url=REDIS_URL, settings=settings, source=SOURCE)


def _submit(module: Any, variant: str, n: int, queue: str) -> float:
    from celery import group

    import celery_lease

    app = module.app
    plain, leased = app.tasks["b.plain"], app.tasks["b.leased"]
    t0 = time.perf_counter()
    if variant == "plain group":
        group(plain.s(i) for i in range(n)).apply_async(queue=queue)
    elif variant == "leased group":
        group(leased.s(i) for i in range(n)).apply_async(queue=queue)
    elif variant == "leased group in bulk()":
        with celery_lease.bulk(app):
            group(leased.s(i) for i in range(n)).apply_async(queue=queue)
    else:
        leased.submit_many([((i,), {}) for i in range(n)], queue=queue)
    return time.perf_counter() - t0


def _measure_submission(ctx: Context, backend: str, url: str, schema: str | None) -> list[dict]:
    from _common import truncate_store

    from celery_lease._runtime import runtime

    n = ctx.scale(2000, 100)
    rounds = ctx.scale(5, 1)
    project = _project(ctx, url, schema)
    module = project.load()
    store = runtime(module.app).store
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for variant in order:
            queue = new_queue("bulk")
            try:
                times[variant].append(_submit(module, variant, n, queue))
            finally:
                delete_queue(REDIS_URL, queue)
                truncate_store(store)
        ctx.log(f"bulk {backend} round {r + 1}/{rounds}")
    inserted = _insert_rate(module, store, n, rounds)
    runtime(module.app).reset()
    plain = median(times["plain group"])
    rows = []
    for variant in VARIANTS:
        seconds = median(times[variant])
        rows.append(
            {
                "backend": backend,
                "variant": variant,
                "n": n,
                "seconds": seconds,
                "per_second": n / seconds,
                "vs_plain": plain / seconds,
                "rows_per_second": inserted if variant != "plain group" else None,
            }
        )
    return rows


def _insert_rate(module: Any, store: Any, n: int, rounds: int) -> float:
    """Rows per second into the store alone: ``Store.submit_many`` of ``n`` rows as a
    leased group's (their messages built beforehand, nothing published), median."""
    from _common import truncate_store
    from celery.utils import uuid

    from celery_lease.producer import submission as _submission

    task = module.app.tasks["b.leased"]
    seconds = []
    for _ in range(rounds):
        rows = [
            _submission.prepare(task, (i,), {}, uuid(), None, {"queue": "unused"})[0]
            for i in range(n)
        ]
        t0 = time.perf_counter()
        answers = store.submit_many(rows)
        seconds.append(time.perf_counter() - t0)
        assert all(created for _, created in answers)
        truncate_store(store)
    return n / median(seconds)


def _retry_latency(ctx: Context, backend: str, url: str, schema: str | None) -> dict[str, Any]:
    from celery_lease import State
    from celery_lease._runtime import runtime

    n = ctx.scale(40, 4)
    project = _project(ctx, url, schema)
    module = project.load()
    store = runtime(module.app).store
    queue = new_queue("retry")
    worker = project.worker(queue, pool="prefork", concurrency=2, loglevel="INFO").start()
    try:
        worker.wait_ready()
        task = module.app.tasks["b.retry_once"]
        ids = [str(task.apply_async((i,), queue=queue).id) for i in range(n)]

        def all_done() -> bool:
            worker.check_alive()
            return all(
                (rec := store.get(task_id)) is not None and rec.state is State.SUCCEEDED
                for task_id in ids
            )

        wait_for(all_done, 120, "every retried task succeeded")
        delays, from_row = [], []
        for task_id in ids:
            trail = store.history(task_id)
            wait = next(i for i, h in enumerate(trail) if h.to_state is State.RETRY_WAIT)
            first = trail[wait - 1]  # the claim of the attempt that retried
            assert (first.from_state, first.to_state) == (State.PENDING, State.RUNNING)
            claim = next(
                h
                for h in trail[wait:]
                if (h.from_state, h.to_state) == (State.PENDING, State.RUNNING)
            )
            delays.append((claim.at - first.at).total_seconds())
            from_row.append((claim.at - trail[wait].at).total_seconds())
    finally:
        worker.stop()
        delete_queue(REDIS_URL, queue)
        runtime(module.app).reset()
    return {
        "backend": backend,
        "n": n,
        "countdown": 0.5,
        "p50": percentile(delays, 50),
        "p95": percentile(delays, 95),
        "max": max(delays),
        "row_p50": percentile(from_row, 50),
        "row_p95": percentile(from_row, 95),
    }


def run(ctx: Context) -> Section:
    """Bulk submission against a plain Celery group, and retry latency."""
    section = Section("bulk", "8. Bulk submission and retry latency")
    rows = _measure_submission(ctx, "sqlite", store_url("sqlite", ctx, "bulk"), None)
    with pg_schema("bulk") as schema:
        rows += _measure_submission(ctx, "postgresql", store_url("postgresql", ctx, "bulk"), schema)
    retries = [_retry_latency(ctx, "sqlite", store_url("sqlite", ctx, "retry"), None)]
    with pg_schema("retry") as schema:
        url = store_url("postgresql", ctx, "retry")
        retries.append(_retry_latency(ctx, "postgresql", url, schema))
    section.add(
        f"Submitting a group of {rows[0]['n']} no-op tasks to Redis (no worker running), "
        "medians of alternating rounds. `leased group` is a plain `group(...).apply_async()` "
        "of a leased task: its rows go in multi-row statements of up to 500 rows, then "
        "the messages are published (`lease_batch_groups`), as inside an explicit "
        "`celery_lease.bulk()` block; `submit_many` is the same for one task with many "
        "argument sets.",
        "",
        *table(
            ["store", "variant", "seconds", "tasks/s", "vs plain group"],
            [
                [r["backend"], r["variant"], r["seconds"], r["per_second"], r["vs_plain"]]
                for r in rows
            ],
        ),
        "",
        "Rows per second into the store alone (`Store.submit_many` of the same rows, "
        "their messages built beforehand, nothing published; median of the rounds):",
        "",
        *table(
            ["store", "rows/s"],
            [[r["backend"], r["rows_per_second"]] for r in rows if r["variant"] == "submit_many"],
        ),
        "",
        f"Retry latency: {retries[0]['n']} tasks each calling `self.retry(countdown=0.5)` "
        "once on a prefork-2 worker (Redis); from the claim of the attempt that retried to "
        "the claim of the retry, and from the RUNNING -> RETRY_WAIT row (written by the "
        "worker's outcome writer) to that claim, in database time:",
        "",
        *table(
            ["store", "p50 s", "p95 s", "max s", "from the row: p50 s", "p95 s"],
            [
                [r["backend"], r["p50"], r["p95"], r["max"], r["row_p50"], r["row_p95"]]
                for r in retries
            ],
        ),
    )
    section.data = {"submission": rows, "retry": retries}
    return section


if __name__ == "__main__":
    sys.exit(standalone(run))
