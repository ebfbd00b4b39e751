"""Task overhead against plain Celery: publish rate, execution rate, statements per task.

The same task (no-op, and ``time.sleep(0.05)``) as a plain Celery task and as a
LeasedTask, on the same broker (Redis, RabbitMQ) and the same worker (prefork 2,
threads 8), with PostgreSQL and SQLite stores. Each round publishes N messages to a
fresh queue with no worker running (publish rate), then starts the worker and times
the completions (execution rate: completions are appended as 8-byte timestamps to a
file per process from ``task_postrun``, equal for every variant). Variants alternate
within a round (order rotated per round); figures are medians over rounds.

A separate counting run (SQLAlchemy events in the producer and in the worker
processes) gives statements and round trips per task lifecycle, and a libpq trace of
the store's own calls checks the round-trip model at the protocol level.
"""

from __future__ import annotations

import contextlib
import cProfile
import dataclasses
import io
import pstats
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
    broker_pids,
    delete_queue,
    done_count,
    done_times,
    flush_published,
    lease_config,
    loadavg,
    median,
    new_queue,
    noop_row,
    pg_backends,
    pg_schema,
    pg_wal_position,
    proc_cpu_each,
    proc_cpu_since,
    pyplot,
    redis_client,
    save_plot,
    standalone,
    store_url,
    table,
    truncate_store,
    wait_for,
    with_app_name,
)
from _sqlcount import SqlCounter, summarize, wire_trace

TASKS_SOURCE = """
import time
if os.environ.get("BENCH_LEASED"):
    from celery_lease import LeasedTask as _Base
else:
    from celery import Task as _Base

if os.environ.get("BENCH_COUNT_SQL"):
    import sys
    sys.path.insert(0, os.environ["BENCH_DIR"])
    from _sqlcount import SqlCounter

    _MAIN_PID = os.getpid()  # pool children are forked later: their pid differs

    def _role():
        name = threading.current_thread().name
        if name == "celery-lease-agent":
            return "claims"  # the lease agent (a process of its own): batched claims
        if os.getpid() != _MAIN_PID:
            return "task"  # a prefork pool process: claims and outcomes
        if name in ("celery-lease-heartbeat", "celery-lease-reaper"):
            return "background"
        if name == "celery-lease-outcomes":
            return "outcomes"  # the outcome writer: lifecycle writes, batched
        return "main"  # start-up and shutdown of the worker's main process

    _counter = SqlCounter(role=_role).attach()
    _key = os.environ["BENCH_COUNT_SQL"]
    _url = os.environ["BENCH_REDIS_URL"]

    @signals.worker_process_init.connect
    def _warm(**kwargs):
        # one-time start-up of a pool process (engine, schema check) is not a lifecycle cost
        if os.environ.get("BENCH_LEASED"):
            from celery_lease._runtime import runtime

            runtime(app).store.ping()
        _counter.take()

    @signals.task_postrun.connect
    def _flush_counts(**kwargs):
        _counter.flush_to_redis(_url, _key)

    @signals.worker_shutdown.connect
    def _flush_background(**kwargs):
        _counter.flush_to_redis(_url, _key)

    from sqlalchemy import event as _event
    from sqlalchemy.engine import Engine as _Engine

    @_event.listens_for(_Engine, "after_cursor_execute")
    def _flush_agent(*args, **kwargs):
        # the lease agent ends with os._exit (no signal, no atexit): it reports each
        # statement as it goes (counting runs only, never timed ones)
        if threading.current_thread().name == "celery-lease-agent":
            _counter.flush_to_redis(_url, _key)

if os.environ.get("BENCH_PROFILE"):
    # profile a solo worker from ready until its n-th task is done (no start-up, no idle)
    import cProfile

    _prof_path, _prof_n = os.environ["BENCH_PROFILE"].rsplit(":", 1)
    _prof = cProfile.Profile()
    _prof_done = [0]

    @signals.worker_ready.connect
    def _prof_start(**kwargs):
        _prof.enable()

    @signals.task_postrun.connect
    def _prof_count(**kwargs):
        _prof_done[0] += 1
        if _prof_done[0] == int(_prof_n):
            _prof.disable()
            _prof.dump_stats(_prof_path + ".tmp")
            os.replace(_prof_path + ".tmp", _prof_path)  # readers never see half a file


@app.task(base=_Base, name="bench.noop", shared=False)
def noop(i):
    return None


@app.task(base=_Base, name="bench.sleep", shared=False)
def sleep(i, seconds):
    time.sleep(seconds)
"""


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    leased: bool
    store: str | None = None
    #: ``lease_outcome_write_through``: each pool process writes its own outcomes
    write_through: bool = False

    @property
    def label(self) -> str:
        return self.name


PLAIN = Variant("plain Celery", False)
LEASED_PG = Variant("LeasedTask, PostgreSQL", True, "postgresql")
LEASED_SQLITE = Variant("LeasedTask, SQLite", True, "sqlite")
#: Outcomes as before the outcome writer: one commit per task in the pool process.
LEASED_PG_WT = Variant("LeasedTask, PostgreSQL, write-through", True, "postgresql", True)


@dataclasses.dataclass
class Round:
    variant: str
    broker: str
    pool: str
    task: str
    n: int
    publish_rate: float
    exec_rate: float
    #: CPU milliseconds per task: the producer process, the worker's processes, and the
    #: PostgreSQL backends of the benchmark's connections (while publishing / executing)
    publish_cpu_ms: float = float("nan")
    publish_db_cpu_ms: float = float("nan")
    worker_cpu_ms: float = float("nan")
    worker_db_cpu_ms: float = float("nan")
    #: of ``worker_cpu_ms``, the worker's main process (consumer, event loop, threads)
    main_cpu_ms: float = float("nan")
    #: the main process's CPU seconds per second while the tasks ran (1.0: a whole core,
    #: the most one Python process holding the GIL gets)
    main_busy: float = float("nan")
    #: of ``worker_cpu_ms``, the pool processes (prefork's children; 0 for threads)
    pool_cpu_ms: float = float("nan")
    #: CPU milliseconds per task of the broker's server process (:func:`broker_pids`)
    publish_broker_cpu_ms: float = float("nan")
    worker_broker_cpu_ms: float = float("nan")
    #: WAL bytes per task the PostgreSQL server wrote (every session of it, not only the
    #: benchmark's: plain Celery's figure is what the rest of the machine wrote)
    publish_wal_bytes: float = float("nan")
    worker_wal_bytes: float = float("nan")


class Env:
    """Projects (one per variant and broker) and stores of one benchmark run."""

    def __init__(self, ctx: Context, schema: str) -> None:
        self.ctx = ctx
        self.schema = schema
        self._projects: dict[tuple[Variant, str], tuple[Project, Any]] = {}
        self.stores: dict[str, Any] = {}

    def settings(self, variant: Variant) -> dict[str, Any]:
        out: dict[str, Any] = {
            "broker_connection_retry_on_startup": True,
            "task_ignore_result": True,
            "worker_hijack_root_logger": False,
        }
        if variant.leased:
            assert variant.store is not None
            out["lease_database_url"] = store_url(variant.store, self.ctx, "overhead")
            if variant.store == "postgresql":
                out["lease_database_url"] = with_app_name(PG_URL)
                out["lease_schema"] = self.schema
            if variant.write_through:
                out["lease_outcome_write_through"] = True
        return out

    def project(self, variant: Variant, broker: str) -> tuple[Project, Any]:
        key = (variant, broker)
        if key not in self._projects:
            env = {"BENCH_DIR": str(BENCH_DIR), "BENCH_REDIS_URL": REDIS_URL}
            if variant.leased:
                env["BENCH_LEASED"] = "1"
            project = Project.write(
                self.ctx,
                broker_url=BROKERS[broker],
                settings=self.settings(variant),
                source=TASKS_SOURCE,
                env=env,
            )
            if variant.leased:
                self.store(variant)  # the tables exist before any process uses them
            module = project.load()
            if variant.leased:
                from celery_lease._runtime import runtime

                runtime(module.app).store.ensure_schema()  # creates the tables (SQLite)
            self._projects[key] = (project, module)
        return self._projects[key]

    def store(self, variant: Variant) -> Any:
        from celery_lease.store import Store

        assert variant.store is not None
        if variant.store not in self.stores:
            cfg = lease_config(
                store_url(variant.store, self.ctx, "overhead"),
                self.schema if variant.store == "postgresql" else None,
            )
            store = Store(cfg)
            store.migrate()
            self.stores[variant.store] = store
        return self.stores[variant.store]

    def close(self) -> None:
        from celery_lease._runtime import runtime

        for _, module in self._projects.values():
            with contextlib.suppress(Exception):
                runtime(module.app).reset()
            with contextlib.suppress(Exception):
                module.app.close()
        for store in self.stores.values():
            store.dispose()


def one_round(
    env: Env,
    variant: Variant,
    broker: str,
    pool: str,
    concurrency: int,
    task_kind: str,
    n: int,
    *,
    counting: str | None = None,
) -> Round:
    ctx = env.ctx
    project, module = env.project(variant, broker)
    if variant.leased:
        truncate_store(env.store(variant))
    queue = new_queue("overhead")
    done_dir = ctx.work_dir / f"done-{uuid.uuid4().hex[:8]}"
    done_dir.mkdir()
    task = module.app.tasks["bench.noop" if task_kind == "noop" else "bench.sleep"]
    extra: tuple[Any, ...] = () if task_kind == "noop" else (0.05,)
    worker = None
    try:
        task.apply_async((0, *extra), queue=queue)  # connections warm: not timed
        db_pids = pg_backends() if variant.store == "postgresql" else []
        mq_pids = broker_pids(BROKERS[broker])
        wal0, mq0 = pg_wal_position(), proc_cpu_each(mq_pids)
        db0, cpu0 = proc_cpu_each(db_pids), time.process_time()
        t0 = time.perf_counter()
        for i in range(1, n):
            task.apply_async((i, *extra), queue=queue)
        if variant.leased:
            # the last rows' "published" marks wait a few ms for a batch: part of the cost
            from celery_lease._runtime import runtime

            flush_published(runtime(module.app).store)
        published = time.perf_counter() - t0
        publish_cpu = (time.process_time() - cpu0) * 1000 / (n - 1)
        publish_db = (
            proc_cpu_since(db0, pg_backends() if db_pids else []) * 1000 / (n - 1)
            if db_pids
            else float("nan")
        )
        publish_mq = proc_cpu_since(mq0) * 1000 / (n - 1) if mq_pids else float("nan")
        publish_wal = (pg_wal_position() - wal0) / (n - 1)
        worker_env = {"BENCH_DONE_DIR": str(done_dir)}
        if counting:
            worker_env["BENCH_COUNT_SQL"] = counting
        worker = project.worker(
            queue,
            pool=pool,
            concurrency=concurrency,
            env=worker_env,
            # a node name of its own: its pidbox queue is exclusive on the broker, and
            # another benchmark may run on the same vhost
            nodename=f"bench-{pool}-{uuid.uuid4().hex[:6]}@%h",
        ).start()
        timeout = 90 + n * (0.05 if task_kind == "sleep" else 0.02)
        # CPU from the first completion to the last (start-up excluded)
        wait_for(
            lambda: worker.check_alive() or done_count(done_dir) >= 1,
            timeout,
            f"{variant.name}: first task done",
        )
        first = done_count(done_dir)
        # the pool processes with the lease agent (a child that is not a pool process):
        # the per-task work besides the main process's
        agent = worker.lease_agent()
        pool_pids = [*worker.children(), *([agent] if agent else [])]
        own = [worker.pid, *pool_pids]
        db_pids = pg_backends() if variant.store == "postgresql" else []
        wal0, q0 = pg_wal_position(), proc_cpu_each(mq_pids)
        # per process, so that a child gone meanwhile (a pool process replaced) takes
        # its last moments with it instead of making the pool's figure negative
        w0, d0, t_w0 = proc_cpu_each(own), proc_cpu_each(db_pids), time.time()
        wait_for(
            lambda: worker.check_alive() or done_count(done_dir) >= n,
            timeout,
            f"{variant.name}: {n} tasks done",
        )
        w = proc_cpu_since(w0)
        m = proc_cpu_since({p: c for p, c in w0.items() if p == worker.pid})
        d, t_w1 = proc_cpu_since(d0, pg_backends() if db_pids else []), time.time()
        wal1, q = pg_wal_position(), proc_cpu_since(q0)
        counted = max(n - first, 1)
        times = done_times(done_dir)
        span = times[-1] - times[0]
        exec_rate = (len(times) - 1) / span if span > 0 else float("nan")
        if variant.leased:
            check_succeeded(env.store(variant), n)
    finally:
        if worker is not None:
            worker.stop()
        delete_queue(BROKERS[broker], queue)
    return Round(
        variant.name,
        broker,
        pool,
        task_kind,
        n,
        (n - 1) / published,
        exec_rate,
        publish_cpu,
        publish_db,
        w * 1000 / counted,
        d * 1000 / counted if db_pids else float("nan"),
        m * 1000 / counted,
        m / (t_w1 - t_w0) if t_w1 > t_w0 else float("nan"),
        (w - m) * 1000 / counted,
        publish_mq,
        q * 1000 / counted if mq_pids else float("nan"),
        publish_wal,
        (wal1 - wal0) / counted,
    )


def check_succeeded(store: Any, n: int) -> None:
    from celery_lease.states import State

    # the worker's outcome writer writes the last outcomes a few ms after their tasks
    # returned (completions are timed in the pool process): wait for them
    deadline = time.monotonic() + 30
    counts = store.counts()
    while counts[State.SUCCEEDED] != n and time.monotonic() < deadline:
        time.sleep(0.05)
        counts = store.counts()
    if counts[State.SUCCEEDED] != n:
        raise AssertionError(f"expected {n} SUCCEEDED rows, found {counts}")


# -- statements per lifecycle ------------------------------------------------------------


def count_lifecycle(env: Env, variant: Variant, n: int) -> dict[str, Any]:
    """Statements and round trips per task, producer and worker, from SQLAlchemy events."""
    from celery_lease._runtime import runtime

    _project, module = env.project(variant, "redis")
    store = runtime(module.app).store
    key = f"bench:sql:{uuid.uuid4().hex[:8]}"
    counter = SqlCounter(role=lambda: "producer").attach(store.engine, store.engine.pool)
    client = redis_client()
    try:
        one_round(env, variant, "redis", "prefork", 2, "noop", n, counting=key)
        producer, producer_s = counter.take()
        worker = {k.decode(): float(v) for k, v in client.hgetall(key).items()}
    finally:
        counter.detach(store.engine, store.engine.pool)
        client.delete(key)
        client.close()
    # the warm-up message is part of the n lifecycles; the outcome writer's statements
    # (worker main process) are lifecycle writes too
    for k in list(worker):
        if k.startswith(("outcomes:", "claims:")):
            task_key = "task:" + k.split(":", 1)[1]
            worker[task_key] = worker.get(task_key, 0.0) + worker[k]
    return {
        "producer": summarize(producer, "producer", n),
        "producer_ms": 1000 * producer_s.get("producer", 0.0) / n,
        "task": summarize(worker, "task", n),
        "task_ms": 1000 * worker.get("task:seconds", 0.0) / n,
        "outcomes": summarize(worker, "outcomes", n),
        "claims": summarize(worker, "claims", n),
    }


def wire_lifecycle(ctx: Context, schema: str, n: int) -> dict[str, float]:
    """The store's lifecycle calls, counted at the protocol level (libpq trace).

    As in a real run, a producer first submits the ``n`` tasks and records each as
    published (``mark_published_soon``: carried by the next submit, the last ones
    flushed in one statement); then a worker claims and finishes each."""
    from celery_lease.states import State
    from celery_lease.store import Store

    store = Store(lease_config(PG_URL, schema))
    store.register_worker("wire-w", "wire@bench", "bench", 1)
    per: dict[str, float] = {"submit + mark published": 0, "claim": 0, "finish": 0}
    ids = [uuid.uuid4().hex for _ in range(n)]
    try:
        with wire_trace(store.engine, ctx.work_dir / f"trace-{uuid.uuid4().hex[:6]}") as trips:
            store.ping()  # connect outside the counted calls
            before = trips()
            for tid in ids:
                new = noop_row(tid)
                store.submit(new)
                store.mark_published_soon(tid)
            flush_published(store)
            after = trips()
            per["submit + mark published"] += after - before
            unmarked = sum(1 for tid in ids if store.get(tid).published_at is None)  # type: ignore[union-attr]
            if unmarked:
                raise AssertionError(f"{unmarked} rows not marked published")
            after = trips()
            for tid in ids:
                claim = store.claim(tid, "wire-w", "worker:wire@bench")
                before, after = after, trips()
                per["claim"] += after - before
                store.finish(
                    claim.lease,  # type: ignore[union-attr]
                    State.SUCCEEDED,
                    actor="worker:wire@bench",
                    reason="succeeded",
                    result="null",
                )
                before, after = after, trips()
                per["finish"] += after - before
    finally:
        store.dispose()
    out = {k: v / n for k, v in per.items()}
    out["total"] = sum(out.values())
    return out


def profile_publish(env: Env, variant: Variant, n: int) -> str:
    """cProfile of the producer loop: where a publish spends its time."""
    _project, module = env.project(variant, "redis")
    if variant.leased:
        truncate_store(env.store(variant))
    task = module.app.tasks["bench.noop"]
    queue = new_queue("profile")
    try:
        task.apply_async((0,), queue=queue)
        prof = cProfile.Profile()
        prof.enable()
        for i in range(1, n):
            task.apply_async((i,), queue=queue)
        prof.disable()
    finally:
        delete_queue(BROKERS["redis"], queue)
    return _grouped(pstats.Stats(prof, stream=io.StringIO()), n - 1, "µs per publish")


def _grouped(stats: pstats.Stats, per: int, unit: str) -> str:
    """Own time of a profile grouped by who spends it, per task."""
    total = stats.total_tt  # type: ignore[attr-defined]
    groups = {
        "database (SQLAlchemy + psycopg/sqlite3, incl. waiting for answers)": (
            "sqlalchemy",
            "psycopg",
            "sqlite3",
        ),
        "broker (kombu + redis-py)": ("kombu", "redis"),
        "celery + billiard (messages, tracing, signals)": ("celery/", "billiard"),
        "celery_lease (rows, JSON, claims)": ("celery_lease",),
    }
    own: dict[str, float] = dict.fromkeys(groups, 0.0)
    other = 0.0
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    for (filename, _line, _fn), (_cc, _nc, tt, _ct, _callers) in raw.items():
        for label, needles in groups.items():
            if any(needle in filename for needle in needles):
                own[label] += tt
                break
        else:
            other += tt
    rows = [(label, f"{1e6 * secs / per:.0f}") for label, secs in own.items()]
    rows.append(("other (interpreter, sockets, epoll)", f"{1e6 * other / per:.0f}"))
    rows.append(("total", f"{1e6 * total / per:.0f}"))
    return "\n".join(table(["where (own time, cProfile)", unit], rows))


def profile_worker(env: Env, variant: Variant, n: int) -> tuple[str, float]:
    """cProfile of a solo worker running ``n`` queued no-op tasks: where a task's time
    goes on the worker side. Returns the table and the (profiled) execution rate."""
    project, module = env.project(variant, "redis")
    if variant.leased:
        truncate_store(env.store(variant))
    task = module.app.tasks["bench.noop"]
    queue = new_queue("profile")
    done_dir = env.ctx.work_dir / f"done-{uuid.uuid4().hex[:8]}"
    done_dir.mkdir()
    out = env.ctx.work_dir / f"worker-{uuid.uuid4().hex[:8]}.prof"
    worker = None
    try:
        for i in range(n):
            task.apply_async((i,), queue=queue)
        worker = project.worker(
            queue,
            pool="solo",
            concurrency=1,
            env={"BENCH_DONE_DIR": str(done_dir), "BENCH_PROFILE": f"{out}:{n}"},
        ).start()
        wait_for(
            lambda: worker.check_alive() or done_count(done_dir) >= n,
            120 + n * 0.05,
            "profiled worker done",
        )
        times = done_times(done_dir)
        rate = (len(times) - 1) / (times[-1] - times[0])
        wait_for(out.exists, 30, "profile written")
    finally:
        if worker is not None:
            worker.kill()
        delete_queue(BROKERS["redis"], queue)
    if not out.exists():
        return "(no profile written)", rate
    return _grouped(
        pstats.Stats(str(out), stream=io.StringIO()), n, "µs per task (solo worker)"
    ), rate


# -- the benchmark ------------------------------------------------------------------------


def run(ctx: Context) -> Section:
    """Task overhead against plain Celery."""
    section = Section("overhead", "1. Task overhead against plain Celery")
    started = time.time()
    rounds_n = ctx.scale(3, 1)
    n_noop = ctx.scale(5000, 60)
    n_sleep = {"prefork": ctx.scale(300, 10), "threads": ctx.scale(1200, 24)}
    pools = {"prefork": 2, "threads": 8}
    brokers = ["redis", "rabbitmq"]
    results: list[Round] = []
    with pg_schema("overhead") as schema:
        env = Env(ctx, schema)
        try:
            # 1. the matrix, variants alternating within each round
            # (task label, broker, pool, task, N, rounds, variants)
            groups: list[tuple[str, str, str, str, int, int, list[Variant]]] = []
            main = [PLAIN, LEASED_PG, LEASED_SQLITE]
            for broker in brokers:
                for pool in pools:
                    rounds = rounds_n if broker == "redis" else ctx.scale(2, 1)
                    variants = [*main, LEASED_PG_WT] if broker == "redis" else main
                    if ctx.quick:
                        # the smoke run covers each code path once: every variant on
                        # Redis with prefork, then the leased ones on the other pool and
                        # broker
                        if (broker, pool) == ("rabbitmq", "threads"):
                            continue
                        if (broker, pool) == ("redis", "threads"):
                            variants = [LEASED_PG, LEASED_PG_WT]
                        elif broker == "rabbitmq":
                            variants = [LEASED_PG]
                    groups.append(("noop", broker, pool, "noop", n_noop, rounds, variants))
            for broker in brokers:
                for pool in pools:
                    if ctx.quick and (broker, pool) != ("redis", "prefork"):
                        continue
                    rounds = ctx.scale(2, 1)
                    variants = [LEASED_PG] if ctx.quick else main
                    groups.append(("sleep", broker, pool, "sleep", n_sleep[pool], rounds, variants))
            for label, broker, pool, kind, n, rounds, variants in groups:
                for r in range(rounds):
                    order = variants[r % len(variants) :] + variants[: r % len(variants)]
                    for variant in order:
                        ctx.log(f"overhead: {broker} {pool} {label} n={n} {variant.name} #{r}")
                        res = one_round(env, variant, broker, pool, pools[pool], kind, n)
                        res = dataclasses.replace(res, task=label)
                        ctx.log(
                            f"  publish {res.publish_rate:.0f}/s, execute {res.exec_rate:.0f}/s"
                        )
                        results.append(res)
            # 2. statements per lifecycle
            n_count = ctx.scale(300, 20)
            counts = {}
            for variant in (LEASED_PG, LEASED_PG_WT, LEASED_SQLITE):
                ctx.log(f"overhead: counting statements, {variant.name}")
                counts[variant.name] = count_lifecycle(env, variant, n_count)
            wire = {"PostgreSQL": wire_lifecycle(ctx, schema, ctx.scale(200, 5))}
            # 3. where a publish spends its time
            n_prof = ctx.scale(1000, 30)
            profiles = {v.name: profile_publish(env, v, n_prof) for v in (PLAIN, LEASED_PG)}
            worker_profiles = {}
            for v in (PLAIN, LEASED_PG):
                ctx.log(f"overhead: profiling a solo worker, {v.name}")
                try:
                    worker_profiles[v.name] = profile_worker(env, v, n_prof)
                except Exception as error:  # an aid to reading: never lose the matrix to it
                    ctx.log(f"  profile failed: {error!r}")
                    worker_profiles[v.name] = (f"(profile failed: {error!r})", float("nan"))
        finally:
            env.close()
    report(ctx, section, results, counts, wire, profiles, worker_profiles)
    section.seconds = time.time() - started
    return section


def _median_table(
    results: list[Round],
) -> dict[tuple[str, str, str, str], tuple[float, float, int, int]]:
    grouped: dict[tuple[str, str, str, str], list[Round]] = {}
    for r in results:
        grouped.setdefault((r.task, r.broker, r.pool, r.variant), []).append(r)
    return {
        key: (
            median([r.publish_rate for r in rs]),
            median([r.exec_rate for r in rs]),
            len(rs),
            rs[0].n,
        )
        for key, rs in grouped.items()
    }


def report(
    ctx: Context,
    section: Section,
    results: list[Round],
    counts: dict[str, dict[str, Any]],
    wire: dict[str, dict[str, float]],
    profiles: dict[str, str],
    worker_profiles: dict[str, tuple[str, float]],
) -> None:
    med = _median_table(results)
    section.data = {
        "rounds": [dataclasses.asdict(r) for r in results],
        "counts": counts,
        "wire": wire,
    }
    section.add(
        "Same task as plain Celery and as `LeasedTask`, same broker, same worker; N messages "
        "published to a fresh queue with no worker (publish rate, one producer thread), then "
        "the worker started and its completions timed (execution rate, from the first to "
        "the last completion). Medians of the rounds; ratios against plain Celery measured "
        "in the same rounds, variants alternating. Default settings (`lease_ttl` 30 s, "
        "heartbeat 5 s, embedded reaper every 5 s).",
        "",
    )
    rows = []
    for (task, broker, pool, variant), (pub, exe, k, n) in sorted(med.items()):
        base = med.get((task, broker, pool, PLAIN.name))
        pub_ratio = pub / base[0] if base else float("nan")
        exe_ratio = exe / base[1] if base else float("nan")
        rows.append(
            (
                task,
                broker,
                f"{pool} {2 if pool == 'prefork' else 8}",
                variant,
                n,
                k,
                pub,
                f"{pub_ratio:.2f}x",
                exe,
                f"{exe_ratio:.2f}x",
            )
        )
    section.add(
        *table(
            [
                "task",
                "broker",
                "pool",
                "variant",
                "N",
                "rounds",
                "publish /s",
                "vs plain",
                "execute /s",
                "vs plain",
            ],
            rows,
        ),
        "",
    )
    section.data["medians"] = [list(r) for r in rows]
    cpu: dict[tuple[str, str, str, str], list[Round]] = {}
    for r in results:
        if r.task == "noop":
            cpu.setdefault((r.broker, r.pool, r.variant, r.task), []).append(r)
    cpu_rows = []
    for (broker, pool, variant, _task), rs in sorted(cpu.items()):
        wk = median([r.worker_cpu_ms for r in rs])
        wdb = median([r.worker_db_cpu_ms for r in rs])
        pub = median([r.publish_cpu_ms for r in rs])
        pdb = median([r.publish_db_cpu_ms for r in rs])
        per_task = sum(x for x in (wk, wdb, pub, pdb) if x == x)
        main_ms = median([r.main_cpu_ms for r in rs])
        busy = median([r.main_busy for r in rs])
        cpu_rows.append(
            (broker, pool, variant, pub, pdb, wk, main_ms, busy, wdb, per_task, 2000.0 / per_task)
        )
    section.add(
        "### CPU per task: what bounds the no-op rates on this machine",
        "",
        "CPU milliseconds per task, measured from `/proc` (user + system): the producer "
        "process while publishing, the worker's processes from its first completion to "
        "its last, and the PostgreSQL server processes serving the benchmark's "
        "connections (found by `application_name`). The broker's own CPU is not counted. "
        "On 2 cores shared by all of them, 2000 / (total ms) is the most tasks per "
        'second the machine could run end to end. "of which main" is the worker\'s main '
        "process (Celery's consumer and event loop, and celery-lease's threads there); "
        '"main busy" is its CPU seconds per second while the tasks ran: near 1.0 it '
        "holds a whole core, the most one Python process gets, and is the bound.",
        "",
        *table(
            [
                "broker",
                "pool",
                "variant",
                "producer",
                "PostgreSQL (publish)",
                "worker",
                "of which main",
                "main busy",
                "PostgreSQL (execute)",
                "total ms / task",
                "2-core bound /s",
            ],
            cpu_rows,
        ),
        "",
    )
    section.data["cpu"] = [list(r) for r in cpu_rows]
    # statements
    section.add(
        "### Statements and round trips per task lifecycle",
        "",
        "Counted with SQLAlchemy events in the producer and in the worker processes "
        "(Redis broker, prefork 2, no-op task): statements, `BEGIN`/`COMMIT` actually "
        "sent (none in autocommit), and pool pings (only for a connection that sat idle "
        "for 10 s; the store's checkout listener sends them on the raw connection, no "
        "cursor event sees them). The producer's statements include the bulk "
        "`mark_published` flushes of its background thread: a steady stream of submits "
        "carries each earlier row's mark inside the next submit statement. The worker's "
        "side is the lease agent's batched claims (a process of its own), the claims "
        "pool processes still make for themselves (deliveries the agent did not claim) "
        "and the outcome writer's batches (in the worker's main process); the "
        "write-through variant writes each outcome in its pool process "
        "(`lease_outcome_write_through`).",
        "",
    )
    crow = []
    for name, c in counts.items():
        for side in ("producer", "task"):
            s = c[side]
            crow.append(
                (
                    name,
                    "producer (apply_async)" if side == "producer" else "worker (claim + outcome)",
                    s["statements"],
                    s["begin_commit"],
                    s["pings"],
                    s["round_trips"],
                    f"{c[f'{side}_ms']:.2f}",
                )
            )
        total = c["producer"]["round_trips"] + c["task"]["round_trips"]
        crow.append((name, "**lifecycle**", "", "", "", f"**{total:.2f}**", ""))
    section.add(
        *table(
            [
                "store",
                "side",
                "statements",
                "BEGIN/COMMIT",
                "pings",
                "round trips",
                "ms in statements",
            ],
            crow,
        ),
        "",
    )
    section.add(
        "Protocol-level check on PostgreSQL (libpq trace of the store's own calls, per "
        "task: a producer submits the tasks and marks each published the way "
        "`apply_async` does, then a worker claims and finishes each; each frontend "
        "`Query` or `Sync` message is one round trip):",
        "",
        *table(
            ["store", "submit + mark published", "claim", "finish", "total"],
            [
                (k, w["submit + mark published"], w["claim"], w["finish"], w["total"])
                for k, w in wire.items()
            ],
        ),
        "",
    )
    section.add("### Where a publish spends its time (Redis broker)", "")
    for name, text in profiles.items():
        section.add(f"{name}:", "", text, "")
    section.add(
        "### Where a task spends its time in the worker (Redis broker, solo pool, cProfile)",
        "",
        "One worker process running the queued no-op tasks under cProfile (the profiler "
        "slows everything down; compare the rows, not the absolute figures).",
        "",
    )
    for name, (text, rate) in worker_profiles.items():
        section.add(f"{name} ({rate:.0f} tasks/s under the profiler):", "", text, "")
    section.data["worker_profile_rates"] = {k: v[1] for k, v in worker_profiles.items()}
    section.add(f"Load average at the end: {loadavg()}.", "")
    plot(ctx, section, med)


def plot(
    ctx: Context,
    section: Section,
    med: dict[tuple[str, str, str, str], tuple[float, float, int, int]],
) -> None:
    plt = pyplot(ctx)
    if plt is None:
        section.add("(plots skipped: matplotlib is not installed; `pip install -e .[bench]`)")
        return
    for metric, idx in (("publish", 0), ("execute", 1)):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=False)
        for ax, task in zip(axes, ("noop", "sleep"), strict=True):
            keys = sorted({(b, p) for (t, b, p, _v) in med if t == task})
            variants = [PLAIN.name, LEASED_PG.name, LEASED_SQLITE.name]
            width = 0.8 / len(variants)
            for j, v in enumerate(variants):
                vals = [med.get((task, b, p, v), (0.0, 0.0, 0, 0))[idx] for b, p in keys]
                ax.bar([i + j * width for i in range(len(keys))], vals, width, label=v)
            ax.set_xticks([i + width for i in range(len(keys))])
            ax.set_xticklabels([f"{b}\n{p}" for b, p in keys])
            ax.set_title(f"{metric} rate, {'no-op' if task == 'noop' else '50 ms'} task")
            ax.set_ylabel("tasks / s")
        axes[0].legend(fontsize=8)
        save_plot(ctx, section, fig, f"overhead-{metric}")


if __name__ == "__main__":
    raise SystemExit(standalone(run))
