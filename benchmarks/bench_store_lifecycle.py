"""Lifecycles per second through the store alone: submit, claim, outcome, no broker.

    python benchmarks/bench_store_lifecycle.py [--batch 100] [--rounds 20] [--quick]

What one PostgreSQL can carry of the lease's own work, apart from Celery and the broker
(like ``river bench``): each round submits ``batch`` rows in one ``submit_many``, claims
them in one ``claim_many`` and writes their outcomes in one ``finish_many``, the three
batched statements a worker's claimer and outcome writer make. Printed per lifecycle:
the wall time, the CPU of this process (the client: SQLAlchemy and psycopg) and of every
PostgreSQL process (read from ``/proc``: the server's backends, WAL writer and
checkpointer), and the WAL bytes written (``pg_current_wal_lsn()`` before and after).
The same is printed for the single-row forms (``submit``, ``claim``, ``finish``, one
commit each) for comparison. Run on a quiet machine: the PostgreSQL CPU read from
``/proc`` counts every session of the server.

Not part of ``run_all.py``; its figures are quoted in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import PG_URL, lease_config, libpq_url, noop_row, pg_schema

_TICK = os.sysconf("SC_CLK_TCK")


def postgres_cpu() -> float:
    """CPU seconds (user + system) of every process named ``postgres`` on this machine."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        if name != "postgres" and not name.startswith("postgres:"):
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _TICK


def wal_lsn(conn: object) -> int:
    row = conn.execute(b"SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()  # type: ignore[attr-defined]
    return int(row[0])


def measure(
    label: str, lifecycles: int, work: Callable[[], None], conn: object
) -> dict[str, float]:
    wal0, pg0 = wal_lsn(conn), postgres_cpu()
    cpu0, t0 = time.process_time(), time.perf_counter()
    work()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    pg, wal = postgres_cpu() - pg0, wal_lsn(conn) - wal0
    return {
        "label": label,  # type: ignore[dict-item]
        "rate": lifecycles / wall,
        "client_ms": cpu / lifecycles * 1e3,
        "pg_ms": pg / lifecycles * 1e3,
        "wal_bytes": wal / lifecycles,
    }


def main(argv: list[str] | None = None) -> None:
    import psycopg

    from celery_lease.states import State
    from celery_lease.store import Claim, Outcome, Store

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--single", type=int, default=300, help="lifecycles one by one")
    parser.add_argument("--quick", action="store_true", help="a few rounds (CI smoke)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.single = 2, 20

    with pg_schema("lifecycle") as schema:
        store = Store(lease_config(PG_URL, schema))
        store.migrate()
        store.register_worker("w-bench", "lifecycle@bench", "bench", os.getpid())
        conn = psycopg.connect(libpq_url(PG_URL), autocommit=True)

        def batched() -> None:
            for _ in range(args.rounds):
                ids = [uuid.uuid4().hex for _ in range(args.batch)]
                store.submit_many([noop_row(t) for t in ids])
                claims = store.claim_many(
                    [(t, uuid.uuid4().hex) for t in ids], "w-bench", "worker:bench"
                )
                assert len(claims) == len(ids), "every row claimed"
                done = store.finish_many(
                    [
                        Outcome(lease=c.lease, to=State.SUCCEEDED, reason="ok", result="0")
                        for c in claims.values()
                    ],
                    actor="worker:bench",
                )
                assert all(done), "every outcome written"

        def single() -> None:
            for _ in range(args.single):
                tid = uuid.uuid4().hex
                store.submit(noop_row(tid))
                claim = store.claim(tid, "w-bench", "worker:bench")
                assert isinstance(claim, Claim)
                store.finish(claim.lease, State.SUCCEEDED, actor="worker:bench", reason="ok")

        batched()  # warm up: statements prepared, the pool connected
        rows = [
            measure(
                f"batched, {args.batch} per statement", args.rounds * args.batch, batched, conn
            ),
            measure("one by one (a commit per statement)", args.single, single, conn),
        ]
        counts = store.counts()
        conn.close()
        store.dispose()
    finished = counts.get(State.SUCCEEDED, 0)
    print(f"store-only lifecycles (submit + claim + outcome), PostgreSQL, {finished} rows")
    print("| form | lifecycles/s | client CPU ms | PostgreSQL CPU ms | WAL bytes |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['label']} | {r['rate']:,.0f} | {r['client_ms']:.3f} | {r['pg_ms']:.3f} "
            f"| {r['wal_bytes']:,.0f} |"
        )
    print(f"batched / one by one: {rows[0]['rate'] / rows[1]['rate']:.1f}x")


if __name__ == "__main__":
    main()
