"""What one PostgreSQL commit costs on this machine: the bound of the lifecycle's rates.

    python benchmarks/bench_commit.py [N]

Every lifecycle statement of celery-lease commits on its own (autocommit): the
submit before the message is published, the claim before the task runs, the outcome
after. Each commit waits for PostgreSQL to flush its WAL to disk (``synchronous_commit
= on``, the default). This prints, per statement (median of N, alternating), the
latency of a read, of a one-row insert that commits, and of the store's own submit,
claim and outcome, with ``synchronous_commit`` on and off for the session: the
difference is the disk flush. Not part of ``run_all.py``; its figures are quoted in
``findings.md``.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import PG_URL, lease_config, libpq_url, noop_row, pg_schema


def main(n: int) -> None:
    import psycopg

    from celery_lease.states import State
    from celery_lease.store import Claim, Store

    rows: dict[str, list[float]] = {}

    @contextlib.contextmanager
    def timed(key: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        rows.setdefault(key, []).append((time.perf_counter() - t0) * 1e6)

    with pg_schema("commit") as schema:
        conn = psycopg.connect(libpq_url(PG_URL), autocommit=True)
        conn.execute(f'CREATE SCHEMA "{schema}"'.encode())
        conn.execute(f'CREATE TABLE "{schema}".probe (x int)'.encode())
        stores = {}
        for mode in ("on", "off"):
            url = f"{PG_URL}{'&' if '?' in PG_URL else '?'}options=-csynchronous_commit%3D{mode}"
            store = Store(lease_config(url, schema))
            store.migrate()
            store.register_worker(f"w-{mode}", "commit@bench", "bench", 1)
            stores[mode] = store
        for i in range(n):
            for mode, store in stores.items():
                conn.execute(f"SET synchronous_commit = {mode}".encode())
                with timed("SELECT 1 (no commit)"):
                    conn.execute(b"SELECT 1").fetchone()
                with timed(f"INSERT one row, commit, synchronous_commit={mode}"):
                    conn.execute(f'INSERT INTO "{schema}".probe VALUES ({i})'.encode())
                tid = uuid.uuid4().hex
                new = noop_row(tid)
                with timed(f"store.submit, synchronous_commit={mode}"):
                    store.submit(new)
                with timed(f"store.claim, synchronous_commit={mode}"):
                    claim = store.claim(tid, f"w-{mode}", "worker")
                assert isinstance(claim, Claim)
                with timed(f"store.finish, synchronous_commit={mode}"):
                    store.finish(claim.lease, State.SUCCEEDED, actor="worker", reason="ok")
        for store in stores.values():
            store.dispose()
        conn.close()
    print(f"| statement (N={n}, alternating) | median µs | p90 µs |")
    print("|---|---|---|")
    for key, values in sorted(rows.items()):
        p90 = statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]
        print(f"| {key} | {statistics.median(values):,.0f} | {p90:,.0f} |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
