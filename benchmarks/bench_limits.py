"""What concurrency and rate limits cost the store (PostgreSQL), side by side in one run.

1. **Per task.** The same lifecycle (claim, then the fenced outcome) of N submitted
   rows, one process, for an unlimited task, a task with a ``concurrency_limit`` that
   is never reached, one with a ``global_rate_limit`` that never paces, and one with
   both. A limited outcome also runs what a worker runs after it: the grant of the
   slot it freed (no row waits, so nothing is granted). Figures: the client's CPU and
   the PostgreSQL backend's CPU per task, and the wall time per task.
2. **At scale.** 1,000 keys of one task, limit 2, each with 2 RUNNING rows and 10 rows
   waiting (2,000 RUNNING, 10,000 waiting): the time of a claim that finds its key
   full (it marks the row waiting), of an outcome that frees a slot and the grant that
   gives it to the key's oldest waiting row, of the reaper's backstop sweep over every
   key when none is free, and the plans of the statements that count a key's slots
   and read its waiting rows (index scans: a claim never reads the waiting rows).

3. **With workers.** Three prefork workers of two processes on Redis (issue 26's
   set-up): the throughput of a no-op task unlimited, with a ``concurrency_limit`` of
   6, the pool size, and of 1,000, never reached (the limited claim is made by the pool
   process, not ahead in a batch), and how many deliveries found no slot (published
   again once granted one); with a limit of 2 and short tasks, the time from a run's
   end (its outcome's commit, database time) to the next waiting row's claim: through
   the grant, the broker and a pool process; and with ``global_rate_limit="50/s"``, the starts per
   second over the run, from the claims in the audit trail.

``--only throughput`` runs the throughput rounds alone (a minute or two).

``--only rate`` runs the rate round alone (3,000 tasks submitted at once at "50/s",
about a minute): starts a second over the run and over its first minute, the starts
in each whole second (min, p5, p95, max), the most starts within any window of one
interval and of one second, and how late each paced start came after its reserved one.
"""

from __future__ import annotations

import sys
import textwrap
import time
import uuid
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
    lease_config,
    loadavg,
    median,
    new_queue,
    noop_row,
    percentile,
    pg_backends,
    pg_schema,
    proc_cpu_each,
    proc_cpu_since,
    standalone,
    table,
    wait_for,
    with_app_name,
)

#: (variant, concurrency limit, seconds between starts): limits never reached or paced.
VARIANTS: list[tuple[str, int | None, float | None]] = [
    ("unlimited", None, None),
    ("concurrency_limit=1000", 1000, None),
    ("global_rate_limit=1000000/s", None, 1e-6),
    ("both", 1000, 1e-6),
]


def _store(schema: str) -> Any:
    from celery_lease.store import Store

    store = Store(lease_config(with_app_name(PG_URL), schema))
    store.migrate()
    # what a worker's runtime attaches: the slots an outcome frees are granted at once
    store.on_slots_freed = lambda pairs: store.grant(pairs)
    return store


def _worker(store: Any) -> str:
    worker_id = uuid.uuid4().hex
    store.register_worker(worker_id, "bench@host", "host", 1)
    return worker_id


def _published(store: Any, n: int) -> tuple[str, list[str]]:
    """A worker registered, and ``n`` no-op rows submitted and published: (its id, theirs)."""
    ids = [uuid.uuid4().hex for _ in range(n)]
    store.submit_many([noop_row(i) for i in ids])
    store.mark_published(ids)
    return _worker(store), ids


def lifecycle(ctx: Context, variant: str, limit: int | None, interval: float | None) -> dict:
    """Claim and finish N rows of one variant; figures per task."""
    from celery_lease.states import State
    from celery_lease.store import Claim, Slot

    n = ctx.scale(3000, 100)
    with pg_schema("limits_cost") as schema:
        store = _store(schema)
        try:
            owner, ids = _published(store, n)
            slot = None
            if limit is not None or interval is not None:
                slot = Slot("bench.noop", "", limit or 0, interval)
            holds = bool(limit)  # as a worker says: the run holds a slot
            db = pg_backends()
            d0, c0, t0 = proc_cpu_each(db), time.process_time(), time.monotonic()
            for task_id in ids:
                claim = store.claim(task_id, owner, "bench", slot=slot)
                assert isinstance(claim, Claim), claim
                assert store.finish(
                    claim.lease, State.SUCCEEDED, actor="bench", reason="ok", holds_slot=holds
                )
            wall, cpu = time.monotonic() - t0, time.process_time() - c0
            pg = proc_cpu_since(d0, pg_backends())
        finally:
            store.dispose()
    return {
        "variant": variant,
        "n": n,
        "client_ms": cpu / n * 1000,
        "pg_ms": pg / n * 1000,
        "wall_ms": wall / n * 1000,
    }


def parts_round(variant: str, slot: Any, batched: bool, n: int) -> list[dict]:
    """Claims, then outcomes, of ``n`` rows, measured apart: one by one (a pool
    process's own claim, an outcome written through) or in batches of 50 (the lease
    agent's claims made ahead, the outcome writer's batches)."""
    from celery_lease.states import State
    from celery_lease.store import Claim, Outcome

    out = []
    with pg_schema("limits_parts") as schema:
        store = _store(schema)
        try:
            owner, ids = _published(store, n)
            leases: list[Any] = []

            def claims() -> None:
                if not batched:
                    for task_id in ids:
                        got = store.claim(task_id, owner, "bench", slot=slot)
                        assert isinstance(got, Claim), got
                        leases.append(got.lease)
                    return
                for k in range(0, n, 50):
                    asks = [(i, uuid.uuid4().hex) for i in ids[k : k + 50]]
                    leases.extend(c.lease for c in store.claim_many(asks, owner, "bench").values())

            def outcomes() -> None:
                if not batched:
                    holds = slot is not None and slot.limit > 0  # as a worker says
                    for lease in leases:
                        assert store.finish(
                            lease, State.SUCCEEDED, actor="bench", reason="ok", holds_slot=holds
                        )
                    return
                for k in range(0, n, 50):
                    batch = [Outcome(x, State.SUCCEEDED, "ok") for x in leases[k : k + 50]]
                    assert all(store.finish_many(batch, actor="bench"))

            for part, fn in (("claim", claims), ("outcome", outcomes)):
                d0, c0 = proc_cpu_each(pg_backends()), time.process_time()
                fn()
                cpu = time.process_time() - c0
                pg = proc_cpu_since(d0, pg_backends())
                assert len(leases) == n
                out.append(
                    {
                        "variant": variant,
                        "mode": "batches of 50" if batched else "one by one",
                        "part": part,
                        "n": n,
                        "client_ms": cpu / n * 1000,
                        "pg_ms": pg / n * 1000,
                    }
                )
        finally:
            store.dispose()
    return out


def parts(ctx: Context) -> list[dict]:
    """Claims and outcomes apart, unlimited (one by one and in batches) and with a
    concurrency limit that never binds (one by one: a limited claim is the pool
    process's own, and its outcome, written through, runs the grant's first read)."""
    from celery_lease.store import Slot

    n = ctx.scale(2000, 100)
    limited = Slot("bench.noop", "", 100000, None)
    return [
        *parts_round("unlimited", None, False, n),
        *parts_round("unlimited", None, True, n),
        *parts_round("concurrency_limit=100000", limited, False, n),
    ]


#: Processes claiming and freeing one key at once in :func:`contended` (the pool
#: processes of issue 26's three workers of two).
CONTENDERS = 6


def _contender(schema: str, limit: int, n: int, results: Any, go: Any, read: Any) -> None:
    """One process of :func:`contended`: ``n`` lifecycles of its own rows, one by one as
    a pool process runs limited tasks; reports its CPU and the grants its frees asked
    for."""
    from celery_lease.states import State
    from celery_lease.store import Claim, Slot

    store = _store(schema)
    asked = 0
    granting = store.on_slots_freed

    def hook(pairs: Any) -> None:
        nonlocal asked
        asked += 1
        granting(pairs)

    store.on_slots_freed = hook
    try:
        owner, ids = _published(store, n)
        slot = Slot("bench.noop", "", limit)
        results.put("ready")
        go.wait(120)
        c0 = time.process_time()
        for task_id in ids:
            claim = store.claim(task_id, owner, "bench", slot=slot)
            assert isinstance(claim, Claim), claim
            assert store.finish(
                claim.lease, State.SUCCEEDED, actor="bench", reason="ok", holds_slot=True
            )
        results.put((time.process_time() - c0, asked))
        read.wait(120)  # the connection stays open until its backend's CPU is read
    finally:
        store.dispose()


def contended(ctx: Context, limit: int) -> dict:
    """:data:`CONTENDERS` processes claiming and freeing rows of one key at once (a
    limit of ``limit``): CPU per lifecycle, and how many frees asked for a grant."""
    import multiprocessing

    n = ctx.scale(400, 20)
    # forked: the processes name their connections as the benchmark does (PG_APP_NAME)
    mp = multiprocessing.get_context("fork")
    results = mp.Queue()
    go, read = mp.Event(), mp.Event()
    with pg_schema("limits_contended") as schema:
        _store(schema).dispose()  # migrated once, before the processes start
        procs = [
            mp.Process(target=_contender, args=(schema, limit, n, results, go, read))
            for _ in range(CONTENDERS)
        ]
        for proc in procs:
            proc.start()
        for _ in procs:
            assert results.get(timeout=120) == "ready"
        d0 = proc_cpu_each(pg_backends())
        go.set()
        got = [results.get(timeout=600) for _ in procs]
        pg = proc_cpu_since(d0, pg_backends())
        read.set()
        for proc in procs:
            proc.join(30)
    total = n * CONTENDERS
    return {
        "variant": f"concurrency_limit={limit}",
        "n": total,
        "client_ms": sum(cpu for cpu, _ in got) / total * 1000,
        "pg_ms": pg / total * 1000,
        "grants": sum(asked for _, asked in got) / total,
    }


def run_parts(ctx: Context) -> Section:
    """claims and outcomes in the store, measured apart: one by one and in batches,
    unlimited and limited; then six processes claiming and freeing one key (a minute)"""
    section = Section("limits-parts", "15. Concurrency limits: claims and outcomes, apart")
    rows = parts(ctx)
    section.lines += table(
        ["variant", "how", "part", "N", "client CPU ms / task", "PostgreSQL CPU ms / task", "both"],
        [
            [
                r["variant"],
                r["mode"],
                r["part"],
                r["n"],
                r["client_ms"],
                r["pg_ms"],
                r["client_ms"] + r["pg_ms"],
            ]
            for r in rows
        ],
    )
    ctx.log(f"limits: {CONTENDERS} processes, one key")
    shared = [contended(ctx, limit) for limit in (1000, CONTENDERS)]
    section.lines += [
        "",
        f"{CONTENDERS} processes claiming and freeing rows of one key:",
        "",
    ]
    section.lines += table(
        [
            "variant",
            "N",
            "client CPU ms / task",
            "PostgreSQL CPU ms / task",
            "both",
            "grants asked per free",
        ],
        [
            [
                r["variant"],
                r["n"],
                r["client_ms"],
                r["pg_ms"],
                r["client_ms"] + r["pg_ms"],
                r["grants"],
            ]
            for r in shared
        ],
    )
    section.lines += ["", f"Load average at the end: {loadavg()}."]
    section.data = {"parts": rows, "contended": shared}
    return section


def at_scale(ctx: Context) -> dict:
    """1,000 keys with their slots full and rows waiting: claim, free + grant, sweep."""
    from sqlalchemy import select, text, update

    from celery_lease.states import State
    from celery_lease.store import Claim, Refusal, Slot
    from celery_lease.store._slots import WAITING, holders
    from celery_lease.store.schema import after

    keys, waiting_per_key, limit = ctx.scale((1000, 10, 2), (50, 4, 2))
    probes = ctx.scale(300, 20)
    with pg_schema("limits_scale") as schema:
        store = _store(schema)
        try:
            owner = _worker(store)
            t = store.t.tasks
            per_key = limit + waiting_per_key
            ids = {k: [uuid.uuid4().hex for _ in range(per_key)] for k in range(keys)}
            every = [i for k in range(keys) for i in ids[k]]
            for start in range(0, len(every), 1000):
                store.submit_many([noop_row(i) for i in every[start : start + 1000]])
            store.mark_published(every)
            # submission order within each key, a millisecond apart
            with store.engine.begin() as conn:
                for k in range(keys):
                    for j, task_id in enumerate(ids[k]):
                        conn.execute(
                            update(t)
                            .where(t.c.id == task_id)
                            .values(created_at=after(t.c.created_at, (j - per_key) / 1000))
                        )
            leases: dict[int, list[Any]] = {}
            for k in range(keys):
                slot = Slot("bench.noop", f"k={k}", limit)
                for task_id in ids[k]:
                    got = store.claim(task_id, owner, "bench", slot=slot)
                    if isinstance(got, Claim):
                        leases.setdefault(k, []).append(got.lease)
            running = sum(len(v) for v in leases.values())
            waiting = len(store.waiting_rows(limit=1_000_000))
            with store.engine.begin() as conn:
                conn.execute(text(f'ANALYZE "{schema}"."{t.name}"'))

            # a fresh delivery to a full key: counted, refused, marked waiting
            extra = [uuid.uuid4().hex for _ in range(probes)]
            store.submit_many([noop_row(i) for i in extra])
            store.mark_published(extra)
            full: list[float] = []
            for n, task_id in enumerate(extra):
                slot = Slot("bench.noop", f"k={n % keys}", limit)
                t0 = time.perf_counter()
                got = store.claim(task_id, owner, "bench", slot=slot)
                full.append(time.perf_counter() - t0)
                assert isinstance(got, Refusal) and got.waiting, got

            # nothing free: the reaper's backstop over every key grants nothing
            sweeps: list[float] = []
            for _ in range(ctx.scale(5, 2)):
                t0 = time.perf_counter()
                assert store.take_waiting(limit=keys) == []
                sweeps.append(time.perf_counter() - t0)

            # an outcome frees a slot; its grant gives it to the key's oldest waiting row
            frees: list[float] = []
            for n in range(probes):
                lease = leases[n % keys].pop(0)
                t0 = time.perf_counter()
                assert store.finish(
                    lease, State.SUCCEEDED, actor="bench", reason="ok", holds_slot=True
                )
                frees.append(time.perf_counter() - t0)

            # the plans: a key's slots counted, its waiting rows read in order
            count = select(holders(t, store.t.workers, "bench.noop", "k=7"))
            queue = (
                select(t.c.id)
                .where(
                    t.c.name == "bench.noop",
                    t.c.slot_key == "k=7",
                    t.c.slot.is_not(None),
                    t.c.slot == WAITING,
                    t.c.state == State.PENDING.value,
                )
                .order_by(t.c.created_at, t.c.id)
                .limit(1)
            )
            plans = {}
            with store.engine.connect() as conn:
                for label, stmt in (("slots in use", count), ("oldest waiting", queue)):
                    sql = str(stmt.compile(store.engine, compile_kwargs={"literal_binds": True}))
                    rows = conn.execute(text(f"EXPLAIN (ANALYZE, COSTS OFF) {sql}")).all()
                    plans[label] = [str(r[0]) for r in rows]
        finally:
            store.dispose()
    return {
        "keys": keys,
        "running": running,
        "waiting": waiting,
        "full_ms": [x * 1000 for x in full],
        "free_grant_ms": [x * 1000 for x in frees],
        "sweep_ms": [x * 1000 for x in sweeps],
        "plans": plans,
        "seq_scans": sum("Seq Scan" in line for p in plans.values() for line in p),
    }


#: The workers' throughput rounds (three workers of two: a pool of six): no limit, a
#: limit of the pool size, a limit never reached.
THROUGHPUT = [
    ("unlimited", ""),
    ("concurrency_limit=6", ", concurrency_limit=6"),
    ("concurrency_limit=1000", ", concurrency_limit=1000"),
]


JOB = """
import time

from celery_lease import LeasedTask


@app.task(base=LeasedTask, name="bench.job", shared=False{options})
def job(i, pause):
    if pause:
        time.sleep(pause)
    return i
"""


def with_workers(
    ctx: Context, variant: str, options: str, n: int, pause: float, *, backlog: bool = True
) -> dict:
    """N tasks through three prefork workers (2 processes each) on Redis: the rate of
    completions, every claim's time, and for each run that waited for a slot, end ->
    next claim. ``backlog``: the N tasks are queued before the workers consume any
    (the rate and CPU are then the workers' own); without it they are submitted while
    the workers run them (the rate round, as it was measured)."""
    from sqlalchemy import func, select

    from celery_lease._runtime import runtime
    from celery_lease.states import State

    queue = new_queue("limits")
    done = ctx.work_dir / f"done-{uuid.uuid4().hex[:6]}"
    done.mkdir(parents=True)
    workers: list[Any] = []
    with pg_schema("limits_workers") as schema:
        settings = {
            "task_default_queue": queue,
            "lease_database_url": with_app_name(PG_URL),
            "lease_schema": schema,
            "lease_auto_migrate": True,
        }
        project = Project.write(
            ctx,
            broker_url=BROKERS["redis"],
            settings=settings,
            source=JOB.format(options=options),
            env={"BENCH_DONE_DIR": str(done)},
        )
        module = project.load()
        store = runtime(module.app).store
        store.migrate()
        try:
            workers = [
                project.worker(
                    queue, pool="prefork", concurrency=2, nodename=f"w{i}@%h", loglevel="INFO"
                ).start()
                for i in range(ctx.scale(3, 2))  # a quick run: two, to keep it short
            ]
            for worker in workers:
                worker.wait_ready()
            # the whole backlog first, the workers consuming nothing meanwhile: the rate
            # and the CPU are the workers' on a full queue, not the submitting loop's
            # (3,000 leased submissions take longer than the workers take to run them)
            control = module.app.control
            if backlog:
                stopped = control.cancel_consumer(queue, reply=True, timeout=10)
                assert len(stopped) == len(workers), f"cancel_consumer: {stopped}"
                ids = [module.job.delay(i, pause).id for i in range(n)]
            # the CPU the workers (every process of each) and their database sessions
            # spend on the run: on a machine that others share, steadier than the rate
            worker_pids = [pid for worker in workers for pid in worker.group()]
            cpu0, db0 = proc_cpu_each(worker_pids), proc_cpu_each(pg_backends())
            if backlog:
                started = control.add_consumer(queue, reply=True, timeout=10)
                assert len(started) == len(workers), f"add_consumer: {started}"
            else:
                ids = [module.job.delay(i, pause).id for i in range(n)]
            wait_for(
                lambda: any(w.check_alive() for w in workers) or done_count(done) >= n,
                ctx.scale(600.0, 120.0),
                f"limits, {variant}: {n} tasks done",
            )
            times = done_times(done)
            t = store.t.tasks
            succeeded = select(func.count()).where(t.c.state == State.SUCCEEDED.value)

            def written() -> bool:  # the outcomes are written in batches, a moment later
                with store.engine.connect() as conn:
                    return int(conn.execute(succeeded).scalar_one()) >= n

            # a paced delivery counts as done too: the paced runs come later
            wait_for(written, ctx.scale(600.0, 120.0), f"limits, {variant}: {n} outcomes written")
            worker_cpu = proc_cpu_since(cpu0)
            pg_cpu = proc_cpu_since(db0, pg_backends())
            # a delivery that found no slot was acked, granted a slot later and published
            # again: its row was published twice
            with store.engine.connect() as conn:
                republished = int(
                    conn.execute(select(func.count()).where(t.c.publish_count > 1)).scalar_one()
                )
            spans = []
            late = []
            with store.engine.connect() as conn:
                # a paced row's ETA is the start reserved for it (a submission has none)
                etas = dict(conn.execute(select(t.c.id, t.c.eta).where(t.c.eta.is_not(None))).all())
            for task_id in ids:
                trail = store.history(task_id)
                began = [r.at.timestamp() for r in trail if r.to_state is State.RUNNING]
                ended = [r.at.timestamp() for r in trail if r.from_state is State.RUNNING]
                spans.append((began[-1], ended[-1]))
                if etas.get(task_id) is not None:
                    late.append((began[-1] - etas[task_id].timestamp()) * 1000)
        finally:
            for worker in workers:
                worker.stop()
            store.dispose()
            delete_queue(BROKERS["redis"], queue)
    spans.sort()
    gaps = []
    for start, _ in spans:
        before = [end for _, end in spans if end <= start]
        if before:  # a claim made after some run ended: a slot it may have waited for
            gaps.append((start - max(before)) * 1000)
    return {
        "variant": variant,
        "n": n,
        "rate": (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan"),
        "gaps_ms": gaps,
        "starts": [start for start, _ in spans],
        "republished": republished,
        "worker_cpu_ms": worker_cpu / n * 1000,
        "pg_cpu_ms": pg_cpu / n * 1000,
        "late_ms": late,
    }


def flows_table(ctx: Context, flows: list[dict]) -> list[str]:
    """The workers' rounds against the first (unlimited): CPU per task of every process
    of the workers and of their PostgreSQL sessions; "published again": deliveries that
    found no slot, were acked, granted one later and published a second time."""
    plain = flows[0]["rate"]
    return table(
        [
            f"{ctx.scale('three', 'two')} prefork workers x 2, Redis",
            "N",
            "tasks/s",
            "vs unlimited",
            "workers' CPU ms / task",
            "PostgreSQL CPU ms / task",
            "published again",
        ],
        [
            [
                r["variant"],
                f"{r['n']:,}",
                f"{r['rate']:,.0f}",
                f"{r['rate'] / plain:.2f}x",
                f"{r['worker_cpu_ms']:.2f}",
                f"{r['pg_cpu_ms']:.2f}",
                str(r["republished"]),
            ]
            for r in flows
        ],
    )


def rate_round(ctx: Context) -> dict:
    """``global_rate_limit="50/s"``, 3,000 tasks submitted at once, three prefork
    workers of two: how the starts (claims, database time) are spread."""
    per_second = ctx.scale(50, 20)
    rate = f"global_rate_limit='{per_second}/s'"
    ctx.log(f"limits: workers, {rate} (load {loadavg()})")
    paced = with_workers(ctx, rate, f", {rate}", ctx.scale(3000, 20), 0.0, backlog=False)
    starts = sorted(paced["starts"])
    span = starts[-1] - starts[0] if len(starts) > 1 else float("nan")
    # starts in each whole second from the first, the last (partial) second left out
    buckets = [0] * max(1, int(span))
    for at in starts:
        index = int(at - starts[0])
        if index < len(buckets):
            buckets[index] += 1
    minute = min(60.0, span)
    in_minute = sum(1 for at in starts if at - starts[0] < minute)

    def most_within(window: float) -> int:
        """The most starts in any window of ``window`` seconds (sliding)."""
        best, lo = 0, 0
        for hi, at in enumerate(starts):
            while at - starts[lo] >= window:
                lo += 1
            best = max(best, hi - lo + 1)
        return best

    interval = 1.0 / per_second
    late = paced["late_ms"]
    lines = [
        f"{rate}, {paced['n']:,} tasks submitted at once: {(len(starts) - 1) / span:.1f} "
        f"starts/s over the run ({span:.1f} s, {(len(starts) - 1) / span / per_second:.3f}x "
        f"the rate); {in_minute / minute:.1f} starts/s over its first {minute:.0f} s. Starts "
        f"in each whole second: min {min(buckets)}, p5 {percentile(buckets, 5):.0f}, "
        f"p95 {percentile(buckets, 95):.0f}, max {max(buckets)}. Most starts within any "
        f"{interval * 1000:g} ms (one interval): {most_within(interval)}; within any second "
        f"(sliding): {most_within(1.0)}. {len(late):,} starts were paced first; their start "
        f"after the one reserved for them: p50 {median(late):.1f} ms, p95 "
        f"{percentile(late, 95):.1f} ms, max {max(late, default=float('nan')):.1f} ms.",
        "",
    ]
    return {
        "lines": lines,
        "data": {
            "per_second": per_second,
            "n": paced["n"],
            "measured": (len(starts) - 1) / span,
            "first_minute": in_minute / minute,
            "buckets": buckets,
            "most_per_interval": most_within(interval),
            "most_per_second": most_within(1.0),
            "late_ms": late,
        },
    }


def run_rate(ctx: Context) -> Section:
    """the rate round alone (global_rate_limit="50/s", about a minute)"""
    section = Section("limits-rate", "15. Concurrency and rate limits: the rate round")
    paced = rate_round(ctx)
    section.lines += [*paced["lines"], f"Load average at the end: {loadavg()}."]
    section.data = {"paced": paced["data"]}
    return section


def run(ctx: Context) -> Section:
    """The cost of concurrency and rate limits in the store."""
    section = Section("limits", "15. Concurrency and rate limits: cost per task, and at scale")
    rounds = []
    for variant, limit, interval in VARIANTS:
        ctx.log(f"limits: lifecycle, {variant}")
        rounds.append(lifecycle(ctx, variant, limit, interval))
    ctx.log("limits: 1,000 keys")
    scale = at_scale(ctx)
    n_noop = ctx.scale(3000, 20)
    flows = []
    for variant, options in THROUGHPUT:
        ctx.log(f"limits: workers, {variant}")
        flows.append(with_workers(ctx, variant, options, n_noop, 0.0))
    ctx.log("limits: workers, concurrency_limit=2, 20 ms tasks")
    waited = with_workers(
        ctx, "concurrency_limit=2", ", concurrency_limit=2", ctx.scale(400, 12), 0.02
    )
    paced = rate_round(ctx)
    base = rounds[0]
    section.lines += textwrap.dedent(__doc__ or "").strip().splitlines()[2:]
    section.lines += [""]
    section.lines += table(
        [
            "variant",
            "N",
            "client CPU ms / task",
            "PostgreSQL CPU ms / task",
            "wall ms / task",
            "wall vs unlimited",
        ],
        [
            [
                r["variant"],
                f"{r['n']:,}",
                f"{r['client_ms']:.3f}",
                f"{r['pg_ms']:.3f}",
                f"{r['wall_ms']:.3f}",
                f"{r['wall_ms'] / base['wall_ms']:.2f}x",
            ]
            for r in rounds
        ],
    )

    def p(values: list[float], pct: float) -> str:
        return f"{percentile(values, pct):.2f}"

    section.lines += [""]
    section.lines += table(
        ["at scale", "p50 ms", "p95 ms", "max ms"],
        [
            [label, f"{median(v):.2f}", p(v, 95), f"{max(v):.2f}"]
            for label, v in (
                ("claim of a full key (marked waiting)", scale["full_ms"]),
                ("outcome that frees a slot + its grant", scale["free_grant_ms"]),
                ("backstop sweep over every key, none free", scale["sweep_ms"]),
            )
        ],
    )
    section.lines += [
        "",
        f"{scale['keys']:,} keys, {scale['running']:,} RUNNING, {scale['waiting']:,} waiting "
        f"(before the probes). Plans (EXPLAIN ANALYZE), {scale['seq_scans']} sequential "
        "scans:",
        "",
    ]
    for label, lines in scale["plans"].items():
        section.lines += [f"{label}:", "", "```", *lines, "```", ""]
    plain, limited = flows[0], flows[1]
    gaps = waited["gaps_ms"]
    section.lines += flows_table(ctx, flows)
    section.lines += [
        "",
        f"concurrency_limit=2, {waited['n']:,} tasks of 20 ms: a run's end -> the next "
        f"claim (database time), over {len(gaps)} claims: p50 {median(gaps):.1f} ms, "
        f"p95 {percentile(gaps, 95):.1f} ms, max {max(gaps, default=float('nan')):.1f} ms.",
        "",
    ]
    section.lines += paced["lines"]
    section.lines += [f"Load average at the end: {loadavg()}."]
    section.data = {
        "rounds": rounds,
        "scale": scale,
        "workers": flows,
        "waited": {"n": waited["n"], "rate": waited["rate"], "gaps_ms": gaps},
        "limited_vs_plain": limited["rate"] / plain["rate"],
        "paced": paced["data"],
    }
    return section


def run_throughput(ctx: Context) -> Section:
    """the workers' throughput round alone (no-op tasks through three prefork workers of
    two: unlimited, a limit of the pool size, a limit never reached; a minute or two)"""
    section = Section("limits-throughput", "15. Concurrency limits: throughput with workers")
    n = ctx.scale(3000, 20)
    flows = []
    for variant, options in THROUGHPUT:
        ctx.log(f"limits: workers, {variant}")
        flows.append(with_workers(ctx, variant, options, n, 0.0))
    section.lines += flows_table(ctx, flows)
    section.lines += ["", f"Load average at the end: {loadavg()}."]
    section.data = {
        r["variant"]: {k: r[k] for k in ("rate", "worker_cpu_ms", "pg_cpu_ms", "republished")}
        for r in flows
    }
    return section


if __name__ == "__main__":
    raise SystemExit(
        standalone(run, parts={"rate": run_rate, "throughput": run_throughput, "parts": run_parts})
    )
