"""What a lifecycle's WAL is made of: PostgreSQL 15's ``pg_walinspect`` around a batch.

    python benchmarks/wal_breakdown.py [--batch 100] [--rounds 10] [--single]
        [--message BYTES] [--marks] [--sql STATEMENT] [--quick]

Runs ``rounds`` batched lifecycles as ``bench_store_lifecycle.py`` does
(``submit_many``, ``claim_many``, ``finish_many``; with ``--marks`` also the producer's
"published" mark between submit and claim; with ``--single`` each lifecycle one by one,
a commit per statement, as ``submit``, ``claim`` and ``finish`` write it), then reads
every WAL record between the LSNs before and after (``pg_get_wal_records_info``) and
prints bytes per lifecycle by resource manager, record type and relation (the table or
index each record's first block belongs to), with the full-page images apart.
``--message`` gives each row a message of that many bytes (a real no-op task's message
is about 850 bytes; the store benchmark's rows carry none). Needs the ``pg_walinspect``
extension in the benchmark database (created here if missing, which takes a superuser).
Also printed: the CPU of the PostgreSQL backends serving the store's connections (found by
``application_name``, read from ``/proc``: other sessions of a shared server are not counted).
Not part of ``run_all.py``; its figures are quoted in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import uuid
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import PG_URL, lease_config, libpq_url, noop_row, pg_schema

_REL = re.compile(r"rel \d+/\d+/(\d+)")
_TICK = os.sysconf("SC_CLK_TCK")


def backends_cpu(conn: object, name: str) -> float:
    """CPU seconds (user + system) of the server processes serving the connections
    named ``name`` (``application_name``): this benchmark's, not the server's others."""
    pids = conn.execute(  # type: ignore[attr-defined]
        b"SELECT pid FROM pg_stat_activity WHERE application_name = %s", (name,)
    ).fetchall()
    total = 0
    for (pid,) in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _TICK


def main(argv: list[str] | None = None) -> None:
    import psycopg

    from celery_lease.states import State
    from celery_lease.store import Claim, Outcome, Store

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--message", type=int, default=0, help="bytes of message per row")
    parser.add_argument("--marks", action="store_true", help="also mark rows published")
    parser.add_argument("--single", action="store_true", help="lifecycles one by one")
    parser.add_argument("--quick", action="store_true", help="a few rounds (CI smoke)")
    parser.add_argument(
        "--sql",
        action="append",
        default=[],
        help="a statement run after the migration ({schema}: the schema), to try a change",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.batch = 2, 20
    message = None
    if args.message:
        message = '{"headers": {"lang": "py", "task": "bench.noop", "x": "%s"}}' % (
            "h" * max(0, args.message - 50)
        )

    with pg_schema("walinspect") as schema:
        app_name = f"lease-walbench-{os.getpid()}"
        sep = "&" if "?" in PG_URL else "?"
        store = Store(lease_config(f"{PG_URL}{sep}application_name={app_name}", schema))
        store.migrate()
        for statement in args.sql:
            conn0 = psycopg.connect(libpq_url(PG_URL), autocommit=True)
            conn0.execute(statement.replace("{schema}", schema).encode())
            conn0.close()
        store.register_worker("w-bench", "wal@bench", "bench", os.getpid())
        conn = psycopg.connect(libpq_url(PG_URL), autocommit=True)
        try:
            conn.execute(b"CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        except psycopg.Error as error:
            sys.exit(f"pg_walinspect is needed (PostgreSQL 15 or later, a superuser): {error}")

        def rounds(n: int) -> None:
            for _ in range(n):
                ids = [uuid.uuid4().hex for _ in range(args.batch)]
                rows = [dataclasses.replace(noop_row(t), message=message) for t in ids]
                if args.single:
                    for row in rows:
                        store.submit(row)
                        if args.marks:
                            store.mark_published([row.id])
                        claim = store.claim(row.id, "w-bench", "worker:bench")
                        assert isinstance(claim, Claim), "every row claimed"
                        store.finish(
                            claim.lease, State.SUCCEEDED, actor="worker:bench", reason="ok"
                        )
                    continue
                store.submit_many(rows)
                if args.marks:
                    store.mark_published(ids)
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

        rounds(2)  # warm up: statements prepared, first pages written
        conn.execute(b"CHECKPOINT")  # every run starts after a checkpoint: FPIs comparable
        start = conn.execute(b"SELECT pg_current_wal_lsn()").fetchone()[0]  # type: ignore[index]
        cpu0 = backends_cpu(conn, app_name)
        rounds(args.rounds)
        cpu = backends_cpu(conn, app_name) - cpu0
        end = conn.execute(b"SELECT pg_current_wal_lsn()").fetchone()[0]  # type: ignore[index]
        names = dict(
            conn.execute(
                b"SELECT pg_relation_filenode(c.oid)::text, c.relname FROM pg_class c "
                b"JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s",
                (schema,),
            ).fetchall()
        )
        try:
            records = conn.execute(
                b"SELECT xid, resource_manager, record_type, record_length, fpi_length, "
                b"block_ref FROM pg_get_wal_records_info(%s, %s)",
                (start, end),
            ).fetchall()
        except psycopg.errors.UndefinedFile as error:
            sys.exit(
                f"the server recycled WAL written during the run before it was read ({error}): "
                "run fewer rounds, or raise wal_keep_size"
            )
        size = conn.execute(
            b"SELECT pg_relation_size(format('%%I.%%I', %s::text, 'lease_tasks')::regclass), "
            b'(SELECT count(*) FROM "' + schema.encode() + b'".lease_tasks)',
            (schema,),
        ).fetchone()
        conn.close()
        store.dispose()

    lifecycles = args.rounds * args.batch

    # the server's WAL is shared: keep the records of this schema's relations and of
    # the transactions that wrote them (their commit records)
    def relation(block_ref: str | None) -> str | None:
        match = _REL.search(block_ref or "")
        return None if match is None else names.get(match.group(1))

    ours = {r[0] for r in records if r[0] and relation(r[5]) is not None}
    groups: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    for xid, rmgr, rtype, length, fpi, block_ref in records:
        rel = relation(block_ref)
        if rel is None:
            if not xid or xid not in ours:
                continue
            rel = "-"
        g = groups[(rmgr, rtype, rel.removeprefix("lease_"))]
        g[0] += 1
        g[1] += length - fpi
        g[2] += fpi
    total = sum(g[1] + g[2] for g in groups.values())
    print(
        f"WAL per lifecycle: {total / lifecycles:,.0f} bytes ({lifecycles} lifecycles, "
        f"{'one by one' if args.single else f'{args.batch} per statement'}, "
        f"message {args.message} B, marks {'on' if args.marks else 'off'})"
    )
    print(f"PostgreSQL CPU of its backends: {cpu / lifecycles * 1e3:.3f} ms per lifecycle")
    print(f"tasks table: {size[0] / size[1]:,.0f} bytes of heap per row ({size[1]} rows)")  # type: ignore[index]
    print("| resource manager | record | relation | records/lifecycle | bytes | FPI bytes |")
    print("|---|---|---|---|---|---|")
    for (rmgr, rtype, rel), (n, size, fpi) in sorted(
        groups.items(), key=lambda kv: -(kv[1][1] + kv[1][2])
    ):
        if (size + fpi) / lifecycles < 1:
            continue
        print(
            f"| {rmgr} | {rtype} | {rel} | {n / lifecycles:.2f} | {size / lifecycles:,.0f} "
            f"| {fpi / lifecycles:,.0f} |"
        )


if __name__ == "__main__":
    main()
