"""CPU per task of every process, plain Celery against ``LeasedTask``, per broker x pool.

    python benchmarks/bench_cpu_table.py [--quick] [--broker redis|rabbitmq]
        [--pool prefork|threads] [--store postgresql|sqlite|both] [--n N] [--rounds R]

The same no-op task as a plain Celery task and as a ``LeasedTask`` (PostgreSQL store;
``--store sqlite`` or ``both`` for the SQLite store), on Redis and RabbitMQ, with
prefork 2 and threads 8, through :func:`bench_overhead.one_round`: N messages published
one by one with no worker running, then the worker started and its completions timed.
Variants alternate within each round (order rotated per round); figures are medians
over the rounds.

Per task, CPU milliseconds (user + system, from ``/proc``) from the worker's first
completion to its last, of each process that does the work:

- **main**: the worker's main process (Celery's consumer and event loop; celery-lease's
  outcome writer, heartbeat and reaper threads; with threads 8, the tasks too);
- **pool**: its pool processes (prefork's children; none with threads) and the
  worker's lease agent (the child process that makes the batched claims);
- **PostgreSQL**: the server backends of the benchmark's connections
  (:func:`_common.pg_backends`, read at both ends of the window); none for plain Celery
  and the SQLite store. A connection opened and closed inside the window (an overflow
  connection of the store's pool, with threads 8) is never seen: there the figure is a
  lower bound;
- **broker**: the broker's server process (:func:`_common.broker_pids`: the
  ``redis-server`` the benchmark uses, or RabbitMQ's ``beam.smp``, which also serves
  every other user of that server).

"added" is the leased total minus the plain total. WAL bytes per task is the server's
``pg_current_wal_lsn()`` difference (``pg_wal_lsn_diff``) over the same window: every
session of the server writes it, so plain Celery's figure is what the rest of the
machine wrote meanwhile. The publishing phase gives the one-by-one ``.delay()`` figures
(client CPU of this process per call, PostgreSQL CPU per call, the rate), and a second
set of rounds runs a 50 ms task (``time.sleep(0.05)``) for its execution rate.

Run it on your own Redis (``CELERY_LEASE_BENCH_REDIS_URL``) so the broker's CPU is the
benchmark's alone. Not part of ``run_all.py`` (it overlaps section 1); its figures are
quoted in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_overhead as bo
from _common import (
    BROKERS,
    Context,
    broker_pids,
    describe_machine_text,
    loadavg,
    make_context,
    median,
    pg_schema,
    table,
)

POOLS = {"prefork": 2, "threads": 8}
BROKER_NAMES = {"redis": "Redis", "rabbitmq": "RabbitMQ"}
#: the per-process split, in the order of the table's column
PARTS = ("main", "pool", "PostgreSQL", "broker")


def _parts(rounds: Sequence[bo.Round]) -> dict[str, float]:
    """Median CPU ms per task of each process group, and their total."""
    out = {
        "main": median([r.main_cpu_ms for r in rounds]),
        "pool": median([r.pool_cpu_ms for r in rounds]),
        # no PostgreSQL connection at all (plain Celery, SQLite store): nothing spent
        "PostgreSQL": median(
            [0.0 if math.isnan(x) else x for x in [r.worker_db_cpu_ms for r in rounds]]
        ),
        "broker": median([r.worker_broker_cpu_ms for r in rounds]),
    }
    out["total"] = sum(v for v in out.values() if not math.isnan(v))
    return out


def _split(parts: dict[str, float]) -> str:
    return " / ".join("-" if math.isnan(parts[p]) else f"{parts[p]:.2f}" for p in PARTS)


def _label(broker: str, pool: str, variant: bo.Variant | None = None) -> str:
    out = f"{BROKER_NAMES[broker]}, {pool} {POOLS[pool]}"
    if variant is not None and variant.store == "sqlite":
        out += ", SQLite store"
    return out


def run_rounds(
    env: bo.Env,
    ctx: Context,
    groups: list[tuple[str, str, str, int, int]],
    variants: list[bo.Variant],
) -> list[bo.Round]:
    results: list[bo.Round] = []
    for kind, broker, pool, n, rounds in groups:
        for r in range(rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for variant in order:
                ctx.log(f"cpu table: {broker} {pool} {kind} n={n} {variant.name} #{r}")
                res = bo.one_round(env, variant, broker, pool, POOLS[pool], kind, n)
                ctx.log(
                    f"  publish {res.publish_rate:.0f}/s, execute {res.exec_rate:.0f}/s, "
                    f"main {res.main_cpu_ms:.2f} pool {res.pool_cpu_ms:.2f} "
                    f"pg {res.worker_db_cpu_ms:.2f} broker {res.worker_broker_cpu_ms:.2f} ms, "
                    f"WAL {res.worker_wal_bytes:,.0f} B per task"
                )
                results.append(res)
    return results


def report(results: list[bo.Round], variants: list[bo.Variant], n: int, rounds: int) -> list[str]:
    by: dict[tuple[str, str, str, str], list[bo.Round]] = {}
    for r in results:
        by.setdefault((r.task, r.broker, r.pool, r.variant), []).append(r)
    combos = sorted({(r.broker, r.pool) for r in results}, key=lambda c: (c[0] != "redis", c))
    leased = [v for v in variants if v.leased]
    plain_name = bo.PLAIN.name
    out: list[str] = []

    rows = []
    detail = []
    for broker, pool in combos:
        plain = by.get(("noop", broker, pool, plain_name), [])
        p_parts = _parts(plain)
        p_rate = median([r.exec_rate for r in plain])
        detail.append(_detail_row(broker, pool, bo.PLAIN, plain, p_parts))
        for v in leased:
            rs = by.get(("noop", broker, pool, v.name), [])
            l_parts = _parts(rs)
            l_rate = median([r.exec_rate for r in rs])
            rows.append(
                (
                    _label(broker, pool, v),
                    f"{p_rate:,.0f}",
                    f"{l_rate:,.0f}",
                    f"{l_rate / p_rate:.2f}",
                    f"{_split(p_parts)} → {_split(l_parts)}",
                    f"{l_parts['total'] - p_parts['total']:+.2f} ms",
                )
            )
            detail.append(_detail_row(broker, pool, v, rs, l_parts))
    out += [
        f"No-op task, N={n} per round, medians of {rounds} rounds, variants alternating. "
        "CPU ms per task from the first completion to the last (`/proc`, user + system).",
        "",
        *table(
            [
                "broker, pool",
                "plain tasks/s",
                "leased tasks/s",
                "ratio",
                "CPU ms per task plain → leased (main / pool / PostgreSQL / broker)",
                "added",
            ],
            rows,
        ),
        "",
        "Per variant (total = main + pool + PostgreSQL + broker; WAL bytes per task "
        "written by the whole PostgreSQL server over the same window: plain Celery's "
        "and the SQLite store's are what other sessions wrote meanwhile):",
        "",
        *table(
            [
                "broker, pool",
                "variant",
                "tasks/s",
                "main",
                "pool",
                "PostgreSQL",
                "broker",
                "total CPU ms",
                "main busy",
                "WAL bytes / task",
            ],
            detail,
        ),
        "",
    ]

    # one-by-one .delay(): the publishing phase of the same no-op rounds, both pools
    delay_rows = []
    for broker in sorted({b for b, _ in combos}, key=lambda b: b != "redis"):
        plain = [
            r for r in results if (r.task, r.broker, r.variant) == ("noop", broker, plain_name)
        ]
        p_rate = median([r.publish_rate for r in plain])
        p_cpu = median([r.publish_cpu_ms for r in plain])
        p_mq = median([r.publish_broker_cpu_ms for r in plain])
        for v in leased:
            rs = [r for r in results if (r.task, r.broker, r.variant) == ("noop", broker, v.name)]
            l_rate = median([r.publish_rate for r in rs])
            pg = median([r.publish_db_cpu_ms for r in rs])
            delay_rows.append(
                (
                    BROKER_NAMES[broker] + (", SQLite store" if v.store == "sqlite" else ""),
                    f"{p_rate:,.0f}",
                    f"{l_rate:,.0f}",
                    f"{l_rate / p_rate:.2f}",
                    f"{p_cpu:.2f} → {median([r.publish_cpu_ms for r in rs]):.2f}",
                    "-" if math.isnan(pg) else f"{pg:.2f}",
                    f"{p_mq:.2f} → {median([r.publish_broker_cpu_ms for r in rs]):.2f}",
                    f"{median([r.publish_wal_bytes for r in plain]):,.0f} → "
                    f"{median([r.publish_wal_bytes for r in rs]):,.0f}",
                )
            )
    out += [
        "One-by-one `.delay()` (the publishing phase of the same rounds, one producer "
        f"thread, {n - 1} calls per round; medians over both pools' rounds):",
        "",
        *table(
            [
                "broker",
                "plain calls/s",
                "leased calls/s",
                "ratio",
                "client CPU ms per call",
                "PostgreSQL CPU ms per call",
                "broker CPU ms per call",
                "WAL bytes per call",
            ],
            delay_rows,
        ),
        "",
    ]

    sleep_rows = []
    for broker, pool in combos:
        plain = by.get(("sleep", broker, pool, plain_name), [])
        if not plain:
            continue
        p_rate = median([r.exec_rate for r in plain])
        for v in leased:
            rs = by.get(("sleep", broker, pool, v.name), [])
            l_rate = median([r.exec_rate for r in rs])
            sleep_rows.append(
                (
                    _label(broker, pool, v),
                    f"{p_rate:,.1f}",
                    f"{l_rate:,.1f}",
                    f"{l_rate / p_rate:.3f}",
                    f"{plain[0].n} x {len(rs)}",
                )
            )
    if sleep_rows:
        out += [
            "50 ms task (`time.sleep(0.05)`), execution rate:",
            "",
            *table(
                ["broker, pool", "plain tasks/s", "leased tasks/s", "ratio", "N x rounds"],
                sleep_rows,
            ),
            "",
        ]
    return out


def _detail_row(
    broker: str, pool: str, variant: bo.Variant, rs: list[bo.Round], parts: dict[str, float]
) -> tuple[str, ...]:
    def f(x: float) -> str:
        return "-" if math.isnan(x) else f"{x:.2f}"

    return (
        _label(broker, pool),
        variant.name,
        f"{median([r.exec_rate for r in rs]):,.0f}",
        *(f(parts[p]) for p in PARTS),
        f(parts["total"]),
        f(median([r.main_busy for r in rs])),
        f"{median([r.worker_wal_bytes for r in rs]):,.0f}",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny N: a smoke run")
    parser.add_argument("--broker", choices=["redis", "rabbitmq"], help="only this broker")
    parser.add_argument("--pool", choices=list(POOLS), help="only this pool")
    parser.add_argument(
        "--store",
        choices=["postgresql", "sqlite", "both"],
        default="postgresql",
        help="the leased variant's store (default: postgresql)",
    )
    parser.add_argument("--n", type=int, default=None, help="no-op tasks per round")
    parser.add_argument("--rounds", type=int, default=None, help="no-op rounds per broker x pool")
    parser.add_argument("--no-sleep", action="store_true", help="skip the 50 ms task rounds")
    args = parser.parse_args(argv)
    ctx = make_context(args.quick, Path(tempfile.mkdtemp(prefix="bench-cpu-")), plots=False)
    n = args.n or ctx.scale(2000, 40)
    rounds = args.rounds or ctx.scale(3, 1)
    n_sleep = {"prefork": ctx.scale(150, 6), "threads": ctx.scale(600, 24)}
    sleep_rounds = ctx.scale(2, 1)
    brokers = [args.broker] if args.broker else ["redis", "rabbitmq"]
    pools = [args.pool] if args.pool else list(POOLS)
    variants = [bo.PLAIN]
    if args.store in ("postgresql", "both"):
        variants.append(bo.LEASED_PG)
    if args.store in ("sqlite", "both"):
        variants.append(bo.LEASED_SQLITE)

    command = "python benchmarks/bench_cpu_table.py " + shlex.join(argv or sys.argv[1:])
    print(describe_machine_text(), flush=True)
    for broker in brokers:
        pids = broker_pids(BROKERS[broker])
        print(
            f"{broker} server processes read: {pids or 'none found (broker CPU not measured)'}",
            flush=True,
        )
    groups = [("noop", b, p, n, rounds) for b in brokers for p in pools]
    if not args.no_sleep:
        groups += [("sleep", b, p, n_sleep[p], sleep_rounds) for b in brokers for p in pools]
    load_start = loadavg()
    with pg_schema("cputable") as schema:
        env = bo.Env(ctx, schema)
        try:
            results = run_rounds(env, ctx, groups, variants)
        finally:
            env.close()
    lines = [
        "",
        f"`{command.strip()}`; load average (1, 5, 15 min) {load_start} at the start, "
        f"{loadavg()} at the end.",
        "",
        *report(results, variants, n, rounds),
    ]
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
