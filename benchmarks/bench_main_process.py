"""What bounds a prefork worker on Redis: its main process.

Runs plain Celery and ``LeasedTask`` (PostgreSQL store) side by side with
:func:`bench_overhead.one_round` (no-op task, Redis broker, prefork 2 by default,
variants alternating), and prints, per variant, the execution rate, the worker's CPU
per task, the share of it spent in the worker's main process (Celery's consumer and
event loop, celery-lease's threads there), in its other processes (the pool processes
and the lease agent), and in PostgreSQL's backends, and how busy the main process was:
CPU seconds per second while the tasks ran, where 1.0 is a whole core, the most one
Python process gets.

    python benchmarks/bench_main_process.py [--quick] [--broker redis|rabbitmq]
        [--pool prefork|threads|solo] [--concurrency N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import bench_overhead as bo
from _common import describe_machine_text, make_context, median, pg_schema, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny N: a smoke run")
    parser.add_argument("--broker", default="redis", choices=["redis", "rabbitmq"])
    parser.add_argument("--pool", default="prefork", choices=["prefork", "threads", "solo"])
    parser.add_argument("--concurrency", type=int, default=0, help="default: 2 (8 threads)")
    args = parser.parse_args(argv)
    ctx = make_context(args.quick, Path(tempfile.mkdtemp(prefix="bench-main-")), plots=False)
    n, rounds = ctx.scale(4000, 60), ctx.scale(3, 1)
    variants = [bo.PLAIN, bo.LEASED_PG]
    concurrency = args.concurrency or (8 if args.pool == "threads" else 2)
    results: dict[str, list[bo.Round]] = {v.name: [] for v in variants}
    print(describe_machine_text(), flush=True)
    with pg_schema("mainproc") as schema:
        env = bo.Env(ctx, schema)
        try:
            for r in range(rounds):
                for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
                    ctx.log(f"main process: {args.broker} {v.name} #{r}")
                    results[v.name].append(
                        bo.one_round(env, v, args.broker, args.pool, concurrency, "noop", n)
                    )
        finally:
            env.close()
    base = median([x.exec_rate for x in results[bo.PLAIN.name]])
    rows = []
    for name, rs in results.items():
        rate = median([x.exec_rate for x in rs])
        main_ms = median([x.main_cpu_ms for x in rs])
        rows.append(
            (
                name,
                f"{rate:,.0f}",
                f"{rate / base:.2f}x",
                f"{median([x.worker_cpu_ms for x in rs]):.2f}",
                f"{main_ms:.2f}",
                f"{median([x.worker_cpu_ms - x.main_cpu_ms for x in rs]):.2f}",
                f"{median([x.worker_db_cpu_ms for x in rs]):.2f}",
                f"{median([x.main_busy for x in rs]):.2f}",
                # a quick run can end before the main process's CPU clock ticks once
                f"{1000 / main_ms:,.0f}" if main_ms > 0 else "no CPU measured",
            )
        )
    print(
        f"\nno-op tasks, {args.broker}, {args.pool} {concurrency}, N={n}, "
        f"medians of {rounds} rounds:\n"
    )
    headers = [
        "variant",
        "execute /s",
        "vs plain",
        "worker CPU ms / task",
        "of which main process",
        "pool processes + agent",
        "PostgreSQL ms / task",
        "main process busy",
        "main process bound /s",
    ]
    print("\n".join(table(headers, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
