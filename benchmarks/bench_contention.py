"""Dedup under contention and claim contention.

Dedup: 8 producer processes submit 10,000 tasks over 100 dedup keys at once (Redis
broker); the queue must then hold exactly 100 messages, the store exactly 100 rows,
and a worker must run exactly 100 executions. Submissions per second are timed from
the barrier to the last producer's end, with the statements each submission sent.

Claims: 8 processes race to claim the same PENDING rows (each walks all of them in
its own random order) on PostgreSQL; every row must be claimed exactly once
(attempt 1, one PENDING -> RUNNING audit row), and claims per second are timed.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import random
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
    pg_schema,
    redis_client,
    standalone,
    store_url,
    table,
    wait_for,
)

DEDUP_SOURCE = """
import redis

from celery_lease import LeasedTask

_r = redis.Redis.from_url(os.environ["BENCH_REDIS_URL"])


@app.task(base=LeasedTask, name="bench.dedup", shared=False)
def dedup(i, counter):
    _r.incr(counter)
"""


def _produce(
    project_dir: str,
    module_name: str,
    env: dict[str, str],
    queue: str,
    counter: str,
    indexes: list[int],
    keys: int,
    barrier: Any,
    results: Any,
) -> None:
    """Child process: submit ``indexes`` with dedup keys ``key-(i % keys)``."""
    sys.path.insert(0, project_dir)
    sys.path.insert(0, str(BENCH_DIR))
    os.environ.update(env)
    from _sqlcount import SqlCounter

    from celery_lease._runtime import runtime

    module = importlib.import_module(module_name)
    task = module.app.tasks["bench.dedup"]
    store = runtime(module.app).store
    counter_sql = SqlCounter(role=lambda: "p").attach(store.engine, store.engine.pool)
    store.ping()
    module.app.connection_for_write().ensure_connection()
    barrier.wait(60)
    t0 = time.time()
    for i in indexes:
        task.apply_async((i, counter), dedup_key=f"key-{i % keys}", queue=queue)
    t1 = time.time()
    counts, _ = counter_sql.take()
    results.put((t0, t1, counts))


def dedup_run(ctx: Context, kind: str, schema: str | None) -> dict[str, Any]:
    from celery_lease.states import State
    from celery_lease.store import Store

    total, producers, keys = ctx.scale((10_000, 8, 100), (400, 4, 20))
    url = store_url(kind, ctx, f"dedup-{uuid.uuid4().hex[:6]}")
    store = Store(lease_config(url, schema))
    store.migrate()
    settings: dict[str, Any] = {
        "broker_connection_retry_on_startup": True,
        "task_ignore_result": True,
        "lease_database_url": url,
    }
    if schema:
        settings["lease_schema"] = schema
    env = {"BENCH_REDIS_URL": REDIS_URL}
    project = Project.write(
        ctx, broker_url=BROKERS["redis"], settings=settings, source=DEDUP_SOURCE, env=env
    )
    queue = f"bench-dedup-{uuid.uuid4().hex[:8]}"
    counter = f"bench:dedup:{uuid.uuid4().hex[:8]}"
    mp = multiprocessing.get_context("spawn")
    barrier = mp.Barrier(producers)
    results: Any = mp.Queue()
    indexes = list(range(total))
    random.shuffle(indexes)
    chunks = [indexes[p::producers] for p in range(producers)]
    procs = [
        mp.Process(
            target=_produce,
            args=(
                str(project.directory),
                project.module,
                env,
                queue,
                counter,
                chunk,
                keys,
                barrier,
                results,
            ),
        )
        for chunk in chunks
    ]
    client = redis_client()
    worker = None
    try:
        for p in procs:
            p.start()
        got = [results.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(30)
        start = min(g[0] for g in got)
        end = max(g[1] for g in got)
        counts: dict[str, int] = {}
        for _, _, c in got:
            for k, v in c.items():
                counts[k] = counts.get(k, 0) + v
        messages = int(client.llen(queue))
        rows = sum(store.counts().values())
        worker = project.worker(queue, pool="prefork", concurrency=2).start()
        wait_for(
            lambda: worker.check_alive() or store.counts()[State.SUCCEEDED] >= rows,
            120,
            "dedup tasks done",
        )
        time.sleep(1.0)  # an extra execution would show up here
        executions = int(client.get(counter) or 0)
    finally:
        if worker is not None:
            worker.stop()
        for p in procs:
            if p.is_alive():
                p.kill()
        delete_queue(BROKERS["redis"], queue)
        client.delete(counter)
        client.close()
        store.dispose()
    statements = sum(v for k, v in counts.items() if k.startswith("p:stmt:"))
    trips = statements + sum(v for k, v in counts.items() if k.startswith(("p:tx:", "p:pool:ping")))
    return {
        "store": kind,
        "producers": producers,
        "submissions": total,
        "keys": keys,
        "seconds": end - start,
        "per_s": total / (end - start),
        "messages": messages,
        "rows": rows,
        "executions": executions,
        "statements_per_submission": statements / total,
        "round_trips_per_submission": trips / total,
    }


def _claim(url: str, schema: str, worker: int, ids: list[str], barrier: Any, results: Any) -> None:
    """Child process: try to claim every id, in its own order."""
    from celery_lease.store import Refusal, Store

    store = Store(lease_config(url, schema))
    store.ping()
    random.shuffle(ids)
    barrier.wait(60)
    t0 = time.time()
    won = 0
    for tid in ids:
        if not isinstance(store.claim(tid, f"claimer-{worker}", f"worker:c{worker}"), Refusal):
            won += 1
    results.put((t0, time.time(), won))
    store.dispose()


def claims_run(ctx: Context, schema: str) -> dict[str, Any]:
    from sqlalchemy import func, select, text

    from celery_lease.store import Store

    n, racers = ctx.scale((5_000, 8), (200, 4))
    store = Store(lease_config(PG_URL, schema))
    store.migrate()
    t, tr = store.t.tasks, store.t.transitions
    tasks = f'"{t.schema}"."{t.name}"'
    trans = f'"{tr.schema}"."{tr.name}"'
    with store.engine.begin() as conn:
        conn.execute(
            text(
                f"INSERT INTO {tasks} (id, name, state, args, kwargs, options, lease_ttl, "
                "max_recoveries, created_at, updated_at, published_at, publish_count) "
                "SELECT 'claim-' || g, 'bench.c', 'PENDING', '[]', '{}', '{}', 30, 5, now(), "
                "now(), now(), 1 FROM generate_series(1, :n) AS g"
            ),
            {"n": n},
        )
        conn.execute(
            text(
                f"INSERT INTO {trans} (task_id, from_state, to_state, reason, actor, attempt, "
                f"at) SELECT id, NULL, 'PENDING', 'submitted', 'producer', 0, now() FROM {tasks} "
                "WHERE id LIKE 'claim-%'"
            )
        )
    for k in range(racers):
        store.register_worker(f"claimer-{k}", f"c{k}@bench", "bench", k)
    ids = [f"claim-{i}" for i in range(1, n + 1)]
    mp = multiprocessing.get_context("spawn")
    barrier = mp.Barrier(racers)
    results: Any = mp.Queue()
    procs = [
        mp.Process(target=_claim, args=(PG_URL, schema, k, list(ids), barrier, results))
        for k in range(racers)
    ]
    try:
        for p in procs:
            p.start()
        got = [results.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(30)
        with store.engine.connect() as conn:
            mine = t.c.id.like("claim-%")
            running = conn.execute(
                select(func.count()).where(mine, t.c.state == "RUNNING", t.c.attempt == 1)
            ).scalar_one()
            claims = conn.execute(
                select(func.count()).where(tr.c.task_id.like("claim-%"), tr.c.to_state == "RUNNING")
            ).scalar_one()
            owners = conn.execute(
                select(func.count(func.distinct(t.c.owner))).where(mine)
            ).scalar_one()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        store.dispose()
    start = min(g[0] for g in got)
    end = max(g[1] for g in got)
    won = sum(g[2] for g in got)
    return {
        "rows": n,
        "racers": racers,
        "seconds": end - start,
        "claims_per_s": n / (end - start),
        "attempts_per_s": n * racers / (end - start),
        "won": won,
        "running_attempt_1": running,
        "audit_claims": claims,
        "owners": owners,
        "double_claims": won - n,
    }


def run(ctx: Context) -> Section:
    """Dedup under contention and claim contention."""
    section = Section("contention", "6-7. Dedup and claims under contention")
    started = time.time()
    dedups = []
    with pg_schema("contention") as schema:
        for kind in ("postgresql", "sqlite"):
            ctx.log(f"contention: dedup on {kind}")
            dedups.append(dedup_run(ctx, kind, schema if kind == "postgresql" else None))
        ctx.log("contention: claim race on PostgreSQL")
        claims = claims_run(ctx, schema)
    section.data = {"dedup": dedups, "claims": claims}
    section.add(
        "### Dedup under contention",
        "",
        f"{dedups[0]['producers']} producer processes submit {dedups[0]['submissions']:,} "
        f"tasks over {dedups[0]['keys']} dedup keys at the same moment (Redis broker).",
        "",
        *table(
            [
                "store",
                "submissions /s",
                "messages published",
                "rows",
                "executions",
                "statements / submission",
                "round trips / submission",
            ],
            [
                (
                    d["store"],
                    d["per_s"],
                    d["messages"],
                    d["rows"],
                    d["executions"],
                    d["statements_per_submission"],
                    d["round_trips_per_submission"],
                )
                for d in dedups
            ],
        ),
        "",
        "### Claim contention (PostgreSQL)",
        "",
        f"{claims['racers']} processes each try to claim all {claims['rows']:,} PENDING rows "
        "(each in its own random order), one compare-and-set per attempt.",
        "",
        *table(
            ["measure", "value"],
            [
                ("rows claimed per second", claims["claims_per_s"]),
                ("claim attempts per second (won + refused)", claims["attempts_per_s"]),
                ("claims won (must equal the rows)", claims["won"]),
                ("rows RUNNING with attempt 1", claims["running_attempt_1"]),
                ("PENDING -> RUNNING audit rows", claims["audit_claims"]),
                ("double claims (must be 0)", claims["double_claims"]),
            ],
        ),
        "",
        f"Load average at the end: {loadavg()}.",
    )
    section.seconds = time.time() - started
    return section


if __name__ == "__main__":
    raise SystemExit(standalone(run))
