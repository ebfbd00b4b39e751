"""The benchmark scripts still run: ``benchmarks/run_all.py --quick`` (tiny N).

No thresholds (the machine is shared and noisy): only that every benchmark runs to
the end against the real services, prints its figures, and writes the page.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ..helpers import REPO_ROOT

HELD_HEADER = "| lease_hold_eta_after | due per second | submit (s) |"

#: run_all.py's sections in four groups, each a test of its own (``--only``): the whole
#: quick run took five minutes in one test, the suite's longest, and under xdist a test
#: that long, started late, keeps one worker busy after the other has finished.
#: Each group: its keys, its section titles, and figures its output prints.
GROUPS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "overhead": (
        "overhead",
        ("## 1. Task overhead against plain Celery",),
        ("publish /s", "round trips"),
    ),
    "store": (
        "steps,heartbeat,reaper,recovery",
        (
            "## 2. Steps",
            "## 3. Heartbeat cost",
            "## 4. Reaper at scale (PostgreSQL)",
            "## 5. Recovery latency",
        ),
        ("statements / renewal", "EXPLAIN"),
    ),
    "flow": (
        "contention,bulk,operations,backlog",
        ("## 6-7. Dedup and claims under contention", "## 8. Bulk submission and retry latency"),
        ("claims", "vs plain group", "Retry latency"),
    ),
    "capacity": (
        "capacity,held",
        ("## 11. Capacity: 4 workers x prefork 2 on one PostgreSQL",),
        ("WAL bytes / task",),
    ),
}


def _run(
    argv: list[str], cwd: Path, pg_url: str, redis_url: str, timeout: float
) -> subprocess.CompletedProcess[str]:
    """A benchmark script run with this test's services (its schemas inside the
    session database)."""
    env = dict(os.environ)
    env.pop("PYTEST_CURRENT_TEST", None)
    env.pop("PYTHONWARNINGS", None)
    env["CELERY_LEASE_BENCH_PG_URL"] = pg_url
    env["CELERY_LEASE_BENCH_REDIS_URL"] = redis_url
    return subprocess.run(
        [sys.executable, *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.timeout(900)
@pytest.mark.parametrize("group", list(GROUPS))
def test_run_all_quick_prints_every_figure(
    group: str, tmp_path: Path, pg_url: str, redis_url: str
) -> None:
    keys, sections, figures = GROUPS[group]
    script = REPO_ROOT / "benchmarks" / "run_all.py"
    proc = _run(
        [str(script), "--quick", "--only", keys, "--out", str(tmp_path)],
        REPO_ROOT,
        pg_url,
        redis_url,
        800,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]

    # printed as it went: the machine, then each section with its tables
    assert "machine: CPU:" in proc.stdout
    for title in sections:
        assert title in proc.stdout, f"{title!r} not printed"
    for figure in figures:
        assert figure in proc.stdout, f"no {figure!r} figures printed"

    page = (tmp_path / "benchmarks.md").read_text()
    assert page.startswith("# Benchmarks")
    assert "quick (smoke) run" in page and "## Machine" in page
    for title in sections:
        assert title in page, f"{title!r} missing from the page"
    # run_all writes "## <key>: FAILED" for a benchmark that raised (the word alone
    # also appears in the EXPLAIN plans of queries over the FAILED state)
    failed = re.findall(r"^## (\S+): FAILED$", page, re.MULTILINE)
    assert not failed, f"benchmarks that failed: {failed}"

    data = json.loads((tmp_path / "img" / "bench-data.json").read_text())["sections"]
    assert set(keys.split(",")) <= set(data)
    CHECKS[group](data, proc.stdout, page)


def _overhead(data: dict[str, Any], stdout: str, page: str) -> None:
    assert "## Targets of issue 6 at a glance" in page
    # both outcome paths ran: the default one through the worker's outcome writer (its
    # statements counted), and write-through in the pool processes
    counts = data["overhead"]["counts"]
    assert counts["LeasedTask, PostgreSQL"]["outcomes"]["statements"] > 0
    assert counts["LeasedTask, PostgreSQL, write-through"]["outcomes"]["statements"] == 0
    # the claims ran in the worker's lease agent (its batched statements counted), on
    # both outcome paths
    assert counts["LeasedTask, PostgreSQL"]["claims"]["statements"] > 0
    assert counts["LeasedTask, PostgreSQL, write-through"]["claims"]["statements"] > 0
    rounds = {(r["variant"], r["pool"]) for r in data["overhead"]["rounds"]}
    assert {("LeasedTask, PostgreSQL, write-through", p) for p in ("prefork", "threads")} <= rounds


def _store(data: dict[str, Any], stdout: str, page: str) -> None:
    assert data["reaper"]["plans"] >= 4
    assert data["reaper"]["seq_scans"] == 0


def _flow(data: dict[str, Any], stdout: str, page: str) -> None:
    # the correctness checks the benchmarks make hold even at tiny N
    for dedup in data["contention"]["dedup"]:
        assert dedup["rows"] == dedup["keys"] == dedup["executions"] == dedup["messages"]
    assert data["contention"]["claims"]["double_claims"] == 0


def _capacity(data: dict[str, Any], stdout: str, page: str) -> None:
    # every task of the capacity backlog ran, and the store's database did work for it
    # (claims and outcomes are batched: fewer commits than tasks while it drains)
    for drained in data["capacity"]["rounds"]:
        assert drained["rate"] > 0
        if drained["variant"].startswith("LeasedTask"):
            assert drained["commits_per_task"] > 0 and drained["wal_per_task"] > 0
    # the held delays (bench_held.py): its table, held and plain side by side, and the
    # held sweep's plans, which read the partial index of the held rows
    lines = stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(HELD_HEADER))
    held_rows = list(itertools.takewhile(lambda line: line.startswith("| "), lines[at + 2 :]))
    assert [r.split(" | ")[0] for r in held_rows] == [
        "| held (lease_hold_eta_after 6)",  # a quick run's threshold, below its lead
        "| None (plain)",
    ]
    # held: nothing reached the broker or a worker before the first ETA
    assert held_rows[0].split(" | ")[3:5] == ["0", "0"], held_rows[0]
    assert "Index Scan using lease_tasks_held_eta" in stdout
    assert "USING INDEX lease_tasks_held_eta" in stdout


CHECKS: dict[str, Callable[[dict[str, Any], str, str], None]] = {
    "overhead": _overhead,
    "store": _store,
    "flow": _flow,
    "capacity": _capacity,
}


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.timeout(600)
def test_the_main_process_benchmark_prints_its_table(pg_url: str, redis_url: str) -> None:
    proc = _run(
        ["bench_main_process.py", "--quick"], REPO_ROOT / "benchmarks", pg_url, redis_url, 500
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| variant | execute /s | vs plain |")
    assert [r.split(" | ")[0] for r in rows[1:]] == [
        "| plain Celery",
        "| LeasedTask, PostgreSQL",
    ]


@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_the_store_lifecycle_benchmark_prints_its_table(pg_url: str, redis_url: str) -> None:
    proc = _run(
        ["bench_store_lifecycle.py", "--quick"], REPO_ROOT / "benchmarks", pg_url, redis_url, 200
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert rows[0] == "| form | lifecycles/s | client CPU ms | PostgreSQL CPU ms | WAL bytes |"
    # 2 rounds of 100 to warm up, 2 measured, then 20 one by one: every row finished
    assert "PostgreSQL, 420 rows" in proc.stdout
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[1].replace(",", "")) > 0  # lifecycles/s
        assert float(cells[4].replace(",", "")) > 0  # WAL bytes written


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def _tables(stdout: str) -> list[list[list[str]]]:
    """Every markdown table printed, as rows of cells (header first, rule dropped)."""
    tables: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in [*stdout.splitlines(), ""]:
        if line.startswith("|"):
            if not line.startswith("|---"):
                current.append(_cells(line))
        elif current:
            tables.append(current)
            current = []
    return tables


def _number(cell: str) -> float:
    value = float(cell.replace(",", "").removesuffix(" ms"))
    assert math.isfinite(value), cell
    return value


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.timeout(900)
def test_the_cpu_table_benchmark_prints_every_process_for_every_variant(
    pg_url: str, redis_url: str
) -> None:
    proc = _run(
        ["bench_cpu_table.py", "--quick", "--broker", "redis", "--store", "both"],
        REPO_ROOT / "benchmarks",
        pg_url,
        redis_url,
        800,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    main, detail, delay, sleep = _tables(proc.stdout)

    assert main[0] == [
        "broker, pool",
        "plain tasks/s",
        "leased tasks/s",
        "ratio",
        "CPU ms per task plain → leased (main / pool / PostgreSQL / broker)",
        "added",
    ]
    # one broker keeps the smoke short; both pools and both stores are covered
    combos = [f"Redis, {p}" for p in ("prefork 2", "threads 8")]
    assert [r[0] for r in main[1:]] == [
        label for c in combos for label in (c, f"{c}, SQLite store")
    ]
    for row in main[1:]:
        assert _number(row[1]) > 0 and _number(row[2]) > 0 and _number(row[3]) > 0
        plain, leased = row[4].split(" → ")
        for split in (plain, leased):
            parts = [_number(x) for x in split.split(" / ")]  # the broker's too: found
            assert len(parts) == 4 and min(parts) >= 0
        _number(row[5])
        if "SQLite" not in row[0]:
            # the leased PostgreSQL store's backends were found and read
            assert _number(leased.split(" / ")[2]) >= 0

    assert detail[0][:3] == ["broker, pool", "variant", "tasks/s"]
    assert detail[0][-1] == "WAL bytes / task"
    variants = {r[1] for r in detail[1:]}
    assert variants == {"plain Celery", "LeasedTask, PostgreSQL", "LeasedTask, SQLite"}
    assert len(detail) == 1 + 2 * 3
    for row in detail[1:]:
        assert _number(row[2]) > 0
        for cell in row[3:]:
            _number(cell)

    assert delay[0][:4] == ["broker", "plain calls/s", "leased calls/s", "ratio"]
    assert [r[0] for r in delay[1:]] == [
        "Redis",
        "Redis, SQLite store",
    ]
    for row in delay[1:]:
        assert _number(row[3]) > 0
        for pair in (row[4], row[6], row[7]):
            for x in pair.split(" → "):
                _number(x)
    assert _number(delay[1][5]) >= 0  # PostgreSQL CPU per call, PostgreSQL store

    assert sleep[0][:4] == ["broker, pool", "plain tasks/s", "leased tasks/s", "ratio"]
    assert len(sleep) == 1 + 2 * 2
    for row in sleep[1:]:
        assert _number(row[3]) > 0


@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_the_wal_breakdown_prints_what_a_lifecycle_writes(pg_url: str, redis_url: str) -> None:
    proc = _run(["wal_breakdown.py", "--quick"], REPO_ROOT / "benchmarks", pg_url, redis_url, 200)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert re.search(r"WAL per lifecycle: [\d,]+ bytes \(40 lifecycles", proc.stdout), output
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| resource manager | record | relation |")
    relations = {row.split(" | ")[2] for row in rows[1:]}
    # a lifecycle writes its row, its audit rows and their indexes; rows without a dedup
    # key add nothing to the dedup index, and no (name, state) index is left to write
    assert {"tasks", "transitions", "tasks_pkey", "transitions_task"} <= relations
    assert not relations & {"tasks_dedup_key", "tasks_name_state"}


@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_the_submission_benchmark_prints_its_table(pg_url: str, redis_url: str) -> None:
    proc = _run(["bench_submit.py", "--quick"], REPO_ROOT / "benchmarks", pg_url, redis_url, 250)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| broker | threads | variant | .delay() /s | vs plain |")
    # plain and leased, one thread and eight, on each broker: the leased rows carry the
    # PostgreSQL figure, and every call wrote its row (the script checks the count)
    measured = [r for r in rows if r.startswith(("| redis", "| rabbitmq"))]
    assert [tuple(c.strip() for c in r.strip("|").split("|")[:3]) for r in measured] == [
        (broker, threads, variant)
        for broker in ("redis", "rabbitmq")
        for threads in ("1", "8")
        for variant in ("plain Celery", "LeasedTask, PostgreSQL")
    ]
    for row in measured:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[3].replace(",", "")) > 0  # calls per second
        assert float(cells[5]) > 0  # client CPU per call
    assert "where a .delay() spends its time" in proc.stdout


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.timeout(600)
def test_the_beat_failover_benchmark_prints_its_figures(pg_url: str, redis_url: str) -> None:
    proc = _run(
        ["bench_beat_failover.py", "--seconds", "20"],
        REPO_ROOT / "benchmarks",
        pg_url,
        redis_url,
        500,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    (figures,) = [t for t in _tables(proc.stdout) if t[0][0] == "slots"]
    assert figures[0] == [
        "slots",
        "ran once",
        "ran twice",
        "covered by a beat",
        "missed while a beat was up",
        "while no beat was up",
        "of which ran (catch-up)",
        "written, never run",
        "entry's missed counter",
    ]
    (row,) = figures[1:]
    values = [int(_number(cell)) for cell in row]
    slots, once, twice, covered, _, uncovered, uncovered_ran, never_run, _ = values
    assert slots >= 12 and covered + uncovered == slots and uncovered_ran <= uncovered
    # counted by the task itself: whatever the beats went through, no slot ran twice
    # and every slot written ran (how many were missed depends on the machine's load)
    assert twice == 0 and never_run == 0 and once <= slots
    assert re.search(r"\d+ kills, \d+ starts", proc.stdout), proc.stdout[-2000:]


@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_the_held_sweep_benchmark_prints_its_table(pg_url: str, redis_url: str) -> None:
    proc = _run(
        ["bench_held_sweep.py", "--quick"], REPO_ROOT / "benchmarks", pg_url, redis_url, 240
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    (figures,) = [t for t in _tables(proc.stdout) if t[0][0] == "broker"]
    assert figures[0] == [
        "broker",
        "held rows due",
        "published /s, idle process",
        "process CPU ms / row, idle",
        "published /s, beside a busy thread",
        "busy vs idle",
    ]
    assert [row[0] for row in figures[1:]] == ["redis", "rabbitmq"]
    for row in figures[1:]:
        assert _number(row[1]) == 200  # every held row was published (or the run fails)
        assert _number(row[2]) > 0 and _number(row[4]) > 0


@pytest.mark.postgres
@pytest.mark.timeout(120)
def test_the_limits_benchmark_prints_claims_and_outcomes_apart(pg_url: str, redis_url: str) -> None:
    proc = _run(
        ["bench_limits.py", "--quick", "--only", "parts"],
        REPO_ROOT / "benchmarks",
        pg_url,
        redis_url,
        100,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    parts, shared = _tables(proc.stdout)
    assert parts[0][:3] == ["variant", "how", "part"]
    assert [row[:3] for row in parts[1:]] == [
        ["unlimited", "one by one", "claim"],
        ["unlimited", "one by one", "outcome"],
        ["unlimited", "batches of 50", "claim"],
        ["unlimited", "batches of 50", "outcome"],
        ["concurrency_limit=100000", "one by one", "claim"],
        ["concurrency_limit=100000", "one by one", "outcome"],
    ]
    for row in parts[1:]:
        assert _number(row[3]) == 100 and _number(row[4]) > 0 and _number(row[5]) >= 0
    # six processes claiming and freeing one key: no row ever waits, so no free asks
    # for a grant
    assert shared[0] == [
        "variant",
        "N",
        "client CPU ms / task",
        "PostgreSQL CPU ms / task",
        "both",
        "grants asked per free",
    ]
    assert [row[0] for row in shared[1:]] == ["concurrency_limit=1000", "concurrency_limit=6"]
    for row in shared[1:]:
        assert _number(row[1]) == 120 and _number(row[2]) > 0 and _number(row[5]) == 0


@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_the_limits_benchmark_prints_its_tables(pg_url: str, redis_url: str) -> None:
    proc = _run(["bench_limits.py", "--quick"], REPO_ROOT / "benchmarks", pg_url, redis_url, 240)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    cost, scale, flows = _tables(proc.stdout)
    assert cost[0][:2] == ["variant", "N"]
    assert [row[0] for row in cost[1:]] == [
        "unlimited",
        "concurrency_limit=1000",
        "global_rate_limit=1000000/s",
        "both",
    ]
    for row in cost[1:]:
        assert _number(row[1]) == 100 and all(_number(x) > 0 for x in row[2:5])
    assert [row[0] for row in scale[1:]] == [
        "claim of a full key (marked waiting)",
        "outcome that frees a slot + its grant",
        "backstop sweep over every key, none free",
    ]
    assert [row[0] for row in flows[1:]] == [
        "unlimited",
        "concurrency_limit=6",
        "concurrency_limit=1000",
    ]
    assert flows[0][4:] == ["workers' CPU ms / task", "PostgreSQL CPU ms / task", "published again"]
    for row in flows[1:]:
        assert _number(row[2]) > 0 and _number(row[4]) > 0
        assert _number(row[5]) >= 0 and _number(row[6]) >= 0
    # the limit of 2 made runs wait: their end -> next claim figures were measured
    assert re.search(r"over \d+ claims: p50 [\d.]+ ms, p95 [\d.]+ ms", proc.stdout)
    # the rate limit's starts per second were measured from the claims
    assert re.search(
        r"global_rate_limit='20/s', 20 tasks submitted at once: [\d.]+ starts/s", proc.stdout
    )
    assert re.search(r"Most starts within any 50 ms \(one interval\): \d+", proc.stdout)
    # the claim counts a key's slots and a grant reads its waiting rows by index
    assert "0 sequential scans" in proc.stdout
    assert "Index Only Scan using lease_tasks_slot_running" in proc.stdout
    assert "Index Scan using lease_tasks_slot_queue" in proc.stdout
