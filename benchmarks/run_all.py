"""Run every benchmark and write ``docs/benchmarks.md`` (tables) and ``docs/img/bench-*.png``.

    python benchmarks/run_all.py            # full run (about 40 minutes on 2 cores)
    python benchmarks/run_all.py --quick    # tiny N: a smoke run (a few minutes)
    python benchmarks/run_all.py --only overhead,reaper --out /tmp/bench

Needs the services of the test suite (PostgreSQL, Redis, RabbitMQ; see ``_common.py``
for the environment variables) and, for plots, matplotlib (``pip install -e .[bench]``).
Exits non-zero if any benchmark failed; the page then says which and why.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    BENCH_DIR,
    REPO_ROOT,
    Context,
    Section,
    describe_machine,
    loadavg,
    make_context,
    median,
    table,
)

#: (key, module) in the order of the issue; ``steps`` belongs to the steps engineer.
BENCHMARKS: list[tuple[str, str]] = [
    ("overhead", "bench_overhead"),
    ("steps", "bench_steps"),
    ("heartbeat", "bench_heartbeat"),
    ("reaper", "bench_reaper"),
    ("recovery", "bench_recovery"),
    ("contention", "bench_contention"),
    ("bulk", "bench_bulk"),
    ("operations", "bench_operations"),
    ("backlog", "bench_backlog"),
    ("capacity", "bench_capacity"),
    ("held", "bench_held"),
]


def run_steps(ctx: Context) -> Section:
    """The steps benchmark (``bench_steps.py``, written with the steps feature).

    If it exposes ``run(ctx) -> Section`` like the others it is called in-process;
    otherwise it is run as ``python benchmarks/bench_steps.py [--quick]`` and what it
    prints is put on the page as it is.
    """
    section = Section("steps", "2. Steps: added latency and writes per step")
    path = BENCH_DIR / "bench_steps.py"
    if not path.exists():
        # TODO(steps): benchmarks/bench_steps.py is written by the steps engineer (issue 3)
        section.add(
            "*Not measured in this run: `benchmarks/bench_steps.py` does not exist yet "
            "(it comes with the steps feature, issue 3). `run_all.py` calls it as soon as "
            "it is there.*"
        )
        section.data = {"missing": True}
        return section
    module = importlib.import_module("bench_steps")
    runner = getattr(module, "run", None)
    if callable(runner):
        try:
            result = runner(ctx)
        except TypeError:
            result = None
        if isinstance(result, Section) or hasattr(result, "markdown"):
            return result  # type: ignore[no-any-return]
    argv = [sys.executable, str(path)] + (["--quick"] if ctx.quick else [])
    proc = subprocess.run(
        argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=3600, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"bench_steps.py exited with {proc.returncode}:\n{proc.stdout[-2000:]}\n"
            f"{proc.stderr[-4000:]}"
        )
    section.add("Output of `python benchmarks/bench_steps.py`:", "", proc.stdout.strip())
    section.data = {"stdout": proc.stdout}
    return section


def run_one(ctx: Context, key: str, module_name: str) -> Section:
    if key == "steps":
        return run_steps(ctx)
    module = importlib.import_module(module_name)
    section: Section = module.run(ctx)
    return section


# -- the summary against the targets ---------------------------------------------


def _ratio_rows(data: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rounds = data.get("rounds", [])
    groups: dict[tuple[str, str, str], dict[str, list[tuple[float, float]]]] = {}
    for r in rounds:
        g = groups.setdefault((r["task"], r["broker"], r["pool"]), {})
        g.setdefault(r["variant"], []).append((r["publish_rate"], r["exec_rate"]))
    rows = []
    targets = {"noop": 0.85, "sleep": 0.98}
    for (task, broker, pool), variants in sorted(groups.items()):
        if task not in targets:
            continue
        plain = variants.get("plain Celery")
        pg = variants.get("LeasedTask, PostgreSQL")
        if not plain or not pg:
            continue
        exe = median([x[1] for x in pg]) / median([x[1] for x in plain])
        pub = median([x[0] for x in pg]) / median([x[0] for x in plain])
        what = "no-op" if task == "noop" else "50 ms"
        rows.append(
            (
                f"execution, {what} task, PostgreSQL ({broker}, {pool})",
                f">= {targets[task]}x",
                f"{exe:.2f}x",
                "yes" if exe >= targets[task] else "**no**",
            )
        )
        if task == "noop":
            rows.append(
                (
                    f"publish rate, PostgreSQL ({broker}, {pool})",
                    ">= 0.7x",
                    f"{pub:.2f}x",
                    "yes" if pub >= 0.7 else "**no**",
                )
            )
    counts = data.get("counts", {})
    for name, c in counts.items():
        if "PostgreSQL" not in name:
            continue
        total = c["producer"]["round_trips"] + c["task"]["round_trips"]
        rows.append(
            (
                f"round trips per lifecycle ({name})",
                "<= 3",
                f"{total:.2f} ({c['producer']['statements'] + c['task']['statements']:.2f} "
                "statements)",
                "yes" if total <= 3.0 else "**no**",
            )
        )
    return rows


def summary(sections: dict[str, Section]) -> list[str]:
    rows: list[tuple[str, str, str, str]] = []
    s = sections.get("overhead")
    if s and s.data:
        rows += _ratio_rows(s.data)
    s = sections.get("heartbeat")
    if s and s.data.get("store"):
        per = [r["statements_per_renewal"] for r in s.data["store"] if r["store"] == "postgresql"]
        leases = [int(r["leases"]) for r in s.data["store"] if r["store"] == "postgresql"]
        ok = bool(per) and max(per) <= 1.0
        rows.append(
            (
                f"heartbeat statements per renewal, {min(leases)}-{max(leases):,} leases (PG)",
                "1, whatever the leases",
                f"{min(per):.2f}-{max(per):.2f}",
                "yes" if ok else "**no**",
            )
        )
    s = sections.get("reaper")
    if s and s.data:
        d = s.data
        rows.append(
            (
                f"one full sweep of {d['rows']:,} rows",
                "bounded, no sequential scan",
                f"{d['sweep_s']:.2f} s",
                "see section 4",
            )
        )
        base, during = d["claim_baseline_ms"], d["claim_during_ms"]
        if base and during:
            rows.append(
                (
                    "claims during sweeps (p50, ms)",
                    "not blocked",
                    f"{median(during):.2f} vs {median(base):.2f} without",
                    "yes" if median(during) < 5 * median(base) + 5 else "**no**",
                )
            )
    s = sections.get("recovery")
    if s and s.data:
        outs = [o for o in s.data["outcomes"] if o["config"].startswith("celery-lease, defaults")]
        goals: dict[str, tuple[str, Callable[[dict[str, Any]], float | None], float]] = {
            "pool child SIGKILL": ("< 2 s", lambda o: o["latency"], 2.0),
            "worker SIGKILL, then restarted": (
                "< 3 s after ready",
                lambda o: o["from_ready"],
                3.0,
            ),
            "worker lost for good (another worker up)": (
                "<= 35 s (ttl + reaper interval)",
                lambda o: o["latency"],
                35.0,
            ),
        }
        for scenario, (goal, pick, limit) in goals.items():
            picked = [pick(o) for o in outs if o["scenario"] == scenario]
            vals = [v for v in picked if v is not None]
            if vals:
                m = median(vals)
                rows.append(
                    (
                        f"recovery, defaults: {scenario}",
                        goal,
                        f"{m:.2f} s",
                        "yes" if m < limit else "**no**",
                    )
                )
    s = sections.get("contention")
    if s and s.data:
        for d in s.data["dedup"]:
            ok = d["rows"] == d["keys"] == d["executions"] == d["messages"]
            rows.append(
                (
                    f"dedup, {d['store']}: rows / messages / executions",
                    f"exactly {d['keys']}",
                    f"{d['rows']} / {d['messages']} / {d['executions']}",
                    "yes" if ok else "**no**",
                )
            )
        c = s.data["claims"]
        rows.append(
            (
                "claim race: double claims",
                "0",
                str(c["double_claims"]),
                "yes" if c["double_claims"] == 0 else "**no**",
            )
        )
    if not rows:
        return []
    return [
        "## Targets of issue 6 at a glance",
        "",
        *table(["target", "goal", "measured", "met"], rows),
        "",
        "Where a target is missed, its section says what bounds it, with the measurements.",
        "",
    ]


# -- the page -----------------------------------------------------------------------------


def write_page(
    ctx: Context,
    sections: dict[str, Section],
    failures: dict[str, str],
    machine: dict[str, str],
    elapsed: float,
    extra: str,
    measured_at: str | None = None,
) -> Path:
    out = ctx.out_dir / "benchmarks.md"
    mode = "quick (smoke) run: tiny N, figures are not meaningful" if ctx.quick else "full run"
    lines = [
        "# Benchmarks",
        "",
        "<!-- generated by `python benchmarks/run_all.py`: edit the scripts, not this page -->",
        "",
        f"Measured {measured_at or time.strftime('%Y-%m-%d %H:%M %Z')}, {mode}, in "
        f"{elapsed / 60:.0f} minutes. Reproduce every table and plot with one command "
        "(PostgreSQL, Redis and RabbitMQ running as for the tests; matplotlib for the "
        "plots: `pip install -e .[bench]`):",
        "",
        "```",
        "python benchmarks/run_all.py           # full run, writes docs/benchmarks.md",
        "python benchmarks/run_all.py --quick   # smoke run with tiny N",
        "```",
        "",
        "The machine is shared (other test runs were going on): every ratio compares "
        "variants measured side by side in the same run, alternating, and figures are "
        "medians of repeated rounds. Load averages are printed with each section.",
        "",
        "## Machine",
        "",
        *table(["", ""], list(machine.items())),
        "",
    ]
    if extra:
        lines += [extra, ""]
    lines += summary(sections)
    findings = BENCH_DIR / "findings.md"
    if findings.exists():
        lines += [findings.read_text().strip(), ""]
    for key, _ in BENCHMARKS:
        if key in sections:
            lines.append(sections[key].markdown())
            lines.append(f"*({sections[key].seconds:.0f} s)*\n")
        elif key in failures:
            lines += [f"## {key}: FAILED", "", "```", failures[key][-3000:], "```", ""]
    out.write_text("\n".join(lines).rstrip() + "\n")
    return out


def rewrite_page(out_dir: Path, note: str) -> int:
    """Write the page again from the saved figures (after editing ``findings.md``)."""
    saved = json.loads((out_dir / "img" / "bench-data.json").read_text())
    ctx = Context(quick=saved["quick"], out_dir=out_dir, img_dir=out_dir / "img", work_dir=out_dir)
    sections = {}
    for key, page in saved["pages"].items():
        section = Section(key, page["title"], list(page["lines"]))
        section.images = [out_dir / "img" / name for name in page["images"]]
        section.data = saved["sections"][key]
        section.seconds = page["seconds"]
        sections[key] = section
    page_path = write_page(
        ctx,
        sections,
        saved.get("failures", {}),
        saved["machine"],
        saved["elapsed"],
        note or saved.get("note", ""),
        saved.get("measured_at"),
    )
    print(f"wrote {page_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny N: a smoke run")
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "docs", help="where benchmarks.md goes"
    )
    parser.add_argument(
        "--only", default="", help="comma-separated keys: " + ",".join(k for k, _ in BENCHMARKS)
    )
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--note", default="", help="a paragraph put under the machine table")
    parser.add_argument(
        "--page-only",
        action="store_true",
        help="rewrite benchmarks.md from the last run's img/bench-data.json (no measuring)",
    )
    args = parser.parse_args(argv)
    if args.page_only:
        return rewrite_page(args.out, args.note)
    only = {k.strip() for k in args.only.split(",") if k.strip()}
    ctx = make_context(args.quick, args.out, plots=not args.no_plots)
    machine = describe_machine()
    print("machine: " + "; ".join(f"{k}: {v}" for k, v in machine.items()), flush=True)
    started = time.time()
    sections: dict[str, Section] = {}
    failures: dict[str, str] = {}
    try:
        for key, module in BENCHMARKS:
            if only and key not in only:
                continue
            ctx.log(f"=== {key}")
            t0 = time.time()
            try:
                section = run_one(ctx, key, module)
            except Exception:
                failures[key] = traceback.format_exc()
                print(failures[key], file=sys.stderr, flush=True)
                continue
            section.seconds = section.seconds or time.time() - t0
            sections[key] = section
            print(section.markdown(), flush=True)
    finally:
        shutil.rmtree(ctx.work_dir, ignore_errors=True)
    machine["load average at the end"] = loadavg()
    page = write_page(ctx, sections, failures, machine, time.time() - started, args.note)
    saved = {
        "machine": machine,
        "quick": ctx.quick,
        "elapsed": time.time() - started,
        "measured_at": time.strftime("%Y-%m-%d %H:%M %Z", time.localtime(started)),
        "note": args.note,
        "failures": failures,
        "sections": {k: s.data for k, s in sections.items()},
        "pages": {
            k: {
                "title": s.title,
                "lines": s.lines,
                "images": [p.name for p in s.images],
                "seconds": s.seconds,
            }
            for k, s in sections.items()
        },
    }
    (ctx.out_dir / "img" / "bench-data.json").write_text(json.dumps(saved, default=str))
    print(f"wrote {page}", flush=True)
    if failures:
        print(f"FAILED: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
