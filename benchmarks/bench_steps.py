"""Steps: database writes and added latency per ``self.step()``, idempotent or not.

What one step costs on top of calling its function, measured in-process through
:class:`celery_lease.worker.pool.execution.Execution` (the object ``LeasedTask.step`` delegates
to) against a real store: a SQLite file (WAL) and PostgreSQL (a schema of its own).
The step functions do nothing, so the time is the step machinery and its database
round trips. Statements, BEGIN/COMMIT and round trips are counted with SQLAlchemy's
``before_cursor_execute``/``begin``/``commit`` events (see ``_sqlcount.py``).

Kinds measured, each over N distinct step names in one execution, repeated in rounds
(medians reported):

- ``idempotent``: ``step(name, fn, idempotent=True)``: one transaction (fence + result).
- ``non-idempotent``: ``step(name, fn)``: two transactions (start recorded before the
  call, then the result), so a crash in between is known to be "outcome unknown".
- ``replayed``: the same N steps in a re-run (a later attempt): every step is done and
  returns its stored result; the recorded steps are read once per execution.
- ``save_progress``: one progress cursor write.

    python benchmarks/bench_steps.py [--quick]
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    Context,
    Section,
    lease_config,
    median,
    pg_schema,
    standalone,
    store_url,
    table,
)
from _sqlcount import SqlCounter, summarize

KINDS = ("idempotent", "non-idempotent", "replayed", "save_progress")


def _noop(i: int) -> dict[str, int]:
    return {"i": i}


def _claim(store: Any) -> Any:
    from celery_lease.store import Claim, NewTask

    task_id = f"bench-steps-{uuid.uuid4().hex}"
    store.submit(
        NewTask(
            id=task_id,
            name="bench.steps",
            args="[]",
            kwargs="{}",
            options="{}",
            lease_ttl=30.0,
            max_recoveries=5,
        )
    )
    claim = store.claim(task_id, "bench-owner", "worker:bench")
    assert isinstance(claim, Claim), claim
    return claim


def _reclaim(store: Any, task_id: str) -> Any:
    from celery_lease.store import Claim

    store.expire(actor="bench", reason="re-run", task_ids=[task_id], only_expired=False)
    store.take_due_retries(actor="bench", limit=100_000)
    claim = store.claim(task_id, "bench-owner", "worker:bench")
    assert isinstance(claim, Claim), claim
    return claim


def _execution(store: Any, claim: Any) -> Any:
    from celery_lease.worker.pool.execution import Execution

    # the default heartbeat interval: a boundary reads the row at most every 5 s
    return Execution(store=store, claim=claim, fenced=lambda: False, check_interval=5.0)


def _one_round(store: Any, kind: str, n: int, counter: SqlCounter) -> tuple[float, dict[str, int]]:
    """Seconds for ``n`` operations of ``kind`` in one execution, and what they sent."""
    claim = _claim(store)
    ex = _execution(store, claim)
    if kind == "replayed":
        for i in range(n):
            ex.step(f"s{i}", _noop, (i,), {}, idempotent=True, check=None)
        ex = _execution(store, _reclaim(store, claim.lease.task_id))
    ops: Callable[[int], Any]
    if kind == "save_progress":

        def ops(i: int) -> Any:
            return ex.save_progress({"next": i})

    else:
        idempotent = kind != "non-idempotent"

        def ops(i: int) -> Any:
            return ex.step(f"s{i}", _noop, (i,), {}, idempotent=idempotent, check=None)

    counter.take()
    t0 = time.perf_counter()
    for i in range(n):
        ops(i)
    elapsed = time.perf_counter() - t0
    counts, _ = counter.take()
    store.finish(ex.lease, _succeeded(), actor="worker:bench", reason="bench")
    return elapsed, counts


def _succeeded() -> Any:
    from celery_lease import State

    return State.SUCCEEDED


def _baseline_us(n: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        _noop(i)
    return (time.perf_counter() - t0) / n * 1e6


def _measure(ctx: Context, backend: str, url: str, schema: str | None) -> list[dict[str, Any]]:
    from celery_lease.store import Store

    n = ctx.scale(400, 40)
    rounds = ctx.scale(5, 2)
    store = Store(lease_config(url, schema))
    store.migrate()
    counter = SqlCounter(role=lambda: "task").attach(store.engine, store.engine.pool)
    out = []
    try:
        _one_round(store, "idempotent", max(5, n // 10), counter)  # warm the pool
        samples: dict[str, list[float]] = {k: [] for k in KINDS}
        counted: dict[str, dict[str, int]] = {}
        for r in range(rounds):
            order = KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]  # rotate the order
            for kind in order:
                seconds, counts = _one_round(store, kind, n, counter)
                samples[kind].append(seconds / n * 1e6)
                counted[kind] = counts
        for kind in KINDS:
            per = summarize(counted[kind], "task", n)
            writes = sum(v for k, v in per.items() if k in ("verb:INSERT", "verb:UPDATE"))
            # reads end in a rollback: only committed transactions wrote something
            commits = counted[kind].get("task:tx:COMMIT", 0) / n
            out.append(
                {
                    "backend": backend,
                    "kind": kind,
                    "us_per_step": median(samples[kind]),
                    "us_rounds": samples[kind],
                    "writes_per_step": writes,
                    "transactions_per_step": commits,
                    "statements_per_step": per["statements"],
                    "round_trips_per_step": per["round_trips_no_ping"],
                    "n": n,
                    "rounds": rounds,
                }
            )
            ctx.log(f"steps {backend} {kind}: {out[-1]['us_per_step']:.0f} us/step")
    finally:
        counter.detach(store.engine, store.engine.pool)
        store.dispose()
    return out


def run(ctx: Context) -> Section:
    """Database writes and added latency per step, idempotent vs not, SQLite and PostgreSQL."""
    section = Section("steps", "2. Steps: added latency and writes per step")
    rows: list[dict[str, Any]] = []
    rows += _measure(ctx, "sqlite", store_url("sqlite", ctx, "steps"), None)
    with pg_schema("steps") as schema:
        rows += _measure(ctx, "postgresql", store_url("postgresql", ctx, "steps"), schema)
    baseline = _baseline_us(100_000)
    section.add(
        "Each `self.step()` runs its function once per task and records it, so a re-run "
        "after a crash skips it. The functions here do nothing: the figures are what the "
        f"step machinery adds (a bare call costs {baseline:.2f} us). One execution runs "
        f"{rows[0]['n']} steps with distinct names; medians of {rows[0]['rounds']} rounds, "
        "in-process against a real store (SQLite file in WAL mode with synchronous=NORMAL; "
        "PostgreSQL over TCP on the same machine with its default synchronous_commit=on).",
        "",
        *table(
            [
                "store",
                "kind",
                "us per step",
                "write statements / step",
                "write transactions / step",
                "statements / step",
                "round trips / step",
            ],
            [
                [
                    r["backend"],
                    r["kind"],
                    r["us_per_step"],
                    r["writes_per_step"],
                    r["transactions_per_step"],
                    r["statements_per_step"],
                    r["round_trips_per_step"],
                ]
                for r in rows
            ],
        ),
        "",
        "An idempotent step is one transaction: the fenced lease check (which also "
        "counts as progress and brings back a cancel request) and the result, first "
        "writer wins. A non-idempotent step adds a transaction before the call that "
        "records its start: the price of knowing, after a crash, that its outcome is "
        "unknown. A replayed step (a re-run) writes nothing: the recorded steps are read "
        "once per execution. Steps never take a lock another worker waits on for longer "
        "than one short transaction.",
    )
    section.data = {"rows": rows, "baseline_us": baseline}
    return section


if __name__ == "__main__":
    sys.exit(standalone(run))
