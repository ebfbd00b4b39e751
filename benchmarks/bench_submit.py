"""Submission cost: one-by-one ``.delay()`` of a no-op task, plain Celery against
``LeasedTask`` (PostgreSQL store), on Redis and RabbitMQ, side by side in one run.

Each round sends N ``.delay()`` calls to a fresh queue with no worker running (the
projects and stores of :mod:`bench_overhead`), variants alternating, order rotated per
round; figures are medians over rounds. Per call: the rate, the client's CPU (the
whole process: the caller's thread and celery-lease's "published" recorder), and the
CPU of the PostgreSQL backends the benchmark's connections use. The same again with 8
threads of one process submitting at once (a web server's workers), and a cProfile of
the leased call, grouped by who spends the time.

    python benchmarks/bench_submit.py [--quick] [--threads 8]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_overhead as bo
from _common import (
    BROKERS,
    delete_queue,
    describe_machine_text,
    flush_published,
    make_context,
    median,
    new_queue,
    pg_backends,
    pg_schema,
    proc_cpu,
    table,
    truncate_store,
)

VARIANTS = (bo.PLAIN, bo.LEASED_PG)


@dataclasses.dataclass
class Round:
    variant: str
    broker: str
    threads: int
    n: int
    rate: float
    #: CPU milliseconds per call: this process, and the PostgreSQL backends
    client_cpu_ms: float
    db_cpu_ms: float


def _task_on(module: Any, queue: str) -> Any:
    """The no-op task, routed to ``queue`` by its own ``queue`` attribute: ``.delay()``
    with no options, as an application calls it."""
    task = module.app.tasks["bench.noop"]
    task.queue = queue
    task._exec_options = None  # Celery caches the task's routing options
    return task


def one_round(env: bo.Env, variant: bo.Variant, broker: str, n: int, threads: int) -> Round:
    _project, module = env.project(variant, broker)
    if variant.leased:
        truncate_store(env.store(variant))
    queue = new_queue("submit")
    task = _task_on(module, queue)
    per_thread = max(n // threads, 1)
    total = per_thread * threads
    try:
        # connections warm (one per thread, as a web server's would be): not timed
        warm = [threading.Thread(target=task.delay, args=(0,)) for _ in range(threads)]
        for t in warm:
            t.start()
        for t in warm:
            t.join()
        store = None
        if variant.leased:
            from celery_lease._runtime import runtime

            store = runtime(module.app).store
            flush_published(store)
        db_pids = pg_backends() if variant.leased else []
        start = threading.Barrier(threads + 1)

        def submit(first: int) -> None:
            start.wait()
            for i in range(first, first + per_thread):
                task.delay(i)

        workers = [
            threading.Thread(target=submit, args=(1 + k * per_thread,)) for k in range(threads)
        ]
        for t in workers:
            t.start()
        db0, cpu0 = proc_cpu(db_pids), time.process_time()
        start.wait()
        t0 = time.perf_counter()
        for t in workers:
            t.join()
        if store is not None:
            # the last rows' "published" marks wait a few ms for a batch: part of the cost
            flush_published(store)
        elapsed = time.perf_counter() - t0
        cpu = (time.process_time() - cpu0) * 1000 / total
        db = (proc_cpu(db_pids) - db0) * 1000 / total if db_pids else float("nan")
        if db_pids and set(pg_backends()) != set(db_pids):
            # connections opened and closed during the run (more threads than the pool
            # keeps): the CPU of a backend that exited cannot be read, so none is shown
            db = float("nan")
        if variant.leased:
            counts = env.store(variant).counts()
            written = sum(counts.values())
            if written != total + threads:
                raise AssertionError(f"{written} rows written for {total + threads} calls")
    finally:
        delete_queue(BROKERS[broker], queue)
    return Round(variant.name, broker, threads, total, total / elapsed, cpu, db)


def profile(env: bo.Env, variant: bo.Variant, broker: str, n: int) -> tuple[str, str]:
    """cProfile of one thread's ``.delay()`` loop: own time grouped, and the top
    functions by cumulative time."""
    _project, module = env.project(variant, broker)
    if variant.leased:
        truncate_store(env.store(variant))
    queue = new_queue("submit-prof")
    task = _task_on(module, queue)
    try:
        task.delay(0)
        prof = cProfile.Profile()
        prof.enable()
        for i in range(1, n):
            task.delay(i)
        prof.disable()
        if variant.leased:
            from celery_lease._runtime import runtime

            flush_published(runtime(module.app).store)
    finally:
        delete_queue(BROKERS[broker], queue)
    stats = pstats.Stats(prof, stream=io.StringIO())
    top = io.StringIO()
    pstats.Stats(prof, stream=top).sort_stats("cumulative").print_stats(25)
    return bo._grouped(stats, n - 1, "µs per .delay()"), top.getvalue()


def _db_figure(values: list[float]) -> str:
    read = [v for v in values if v == v]  # NaN: backends came and went during the round
    if not read:
        return "n/a (connections opened and closed)"
    return f"{median(read):.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny N: a smoke run")
    parser.add_argument("--threads", type=int, default=8, help="submitting threads (0: none)")
    parser.add_argument("--brokers", default="redis,rabbitmq")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions")
    parser.add_argument("--n", type=int, default=0, help="calls per round (default 3000)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds (default 3)")
    args = parser.parse_args(argv)
    ctx = make_context(args.quick, Path(tempfile.mkdtemp(prefix="bench-submit-")), plots=False)
    n, rounds = args.n or ctx.scale(3000, 40), args.rounds or ctx.scale(3, 1)
    brokers = args.brokers.split(",")
    modes = [1] + ([args.threads] if args.threads > 1 else [])
    results: list[Round] = []
    profiles: dict[str, tuple[str, str]] = {}
    print(describe_machine_text(), flush=True)
    with pg_schema("submit") as schema:
        env = bo.Env(ctx, schema)
        try:
            for broker in brokers:
                for threads in modes:
                    for r in range(rounds):
                        order = VARIANTS[r % 2 :] + VARIANTS[: r % 2]
                        for v in order:
                            res = one_round(env, v, broker, n, threads)
                            ctx.log(
                                f"submit: {broker} threads={threads} {v.name} #{r}: "
                                f"{res.rate:,.0f}/s, client {res.client_cpu_ms:.3f} ms, "
                                f"PostgreSQL {res.db_cpu_ms:.3f} ms"
                            )
                            results.append(res)
            for v in VARIANTS:
                profiles[v.name] = profile(env, v, brokers[0], ctx.scale(2000, 20))
        finally:
            env.close()
    rows = []
    for broker in brokers:
        for threads in modes:
            base = None
            for v in VARIANTS:
                rs = [
                    x
                    for x in results
                    if (x.variant, x.broker, x.threads) == (v.name, broker, threads)
                ]
                rate = median([x.rate for x in rs])
                base = rate if base is None else base
                rows.append(
                    (
                        broker,
                        str(threads),
                        v.name,
                        f"{rate:,.0f}",
                        f"{rate / base:.2f}x",
                        f"{median([x.client_cpu_ms for x in rs]):.3f}",
                        _db_figure([x.db_cpu_ms for x in rs]) if v.leased else "-",
                    )
                )
    print(f"\none-by-one .delay() of a no-op task, N={n} per round, medians of {rounds}:\n")
    headers = [
        "broker",
        "threads",
        "variant",
        ".delay() /s",
        "vs plain",
        "client CPU ms / call",
        "PostgreSQL CPU ms / call",
    ]
    print("\n".join(table(headers, rows)))
    for name, (grouped, top) in profiles.items():
        print(f"\nwhere a .delay() spends its time ({brokers[0]}, one thread), {name}:\n")
        print(grouped)
        if args.profile:
            print(top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
