"""Issue 14, health figures: per task name over a window (run-time percentiles next to
``max_runtime`` and ``lease_ttl``, failure and cancel rates, backlog), zombies, the
counters (purged, re-published, duplicates dropped), in ``stats()``, ``lease stats``
and Prometheus, with the alert rules checked against what the collector exports."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from pathlib import Path

import pytest
from celery.bin.base import CLIContext
from click.testing import CliRunner
from sqlalchemy import text, update

from celery_lease import State
from celery_lease.cli import lease
from celery_lease.health import state_counts
from celery_lease.metrics import registry

from ..crash.support import LeaseEnv
from ..helpers import wait_until
from .test_cli_support import Ops, ops_fixture  # noqa: F401  (the ops fixture)

RULES = Path(__file__).resolve().parents[2] / "examples" / "prometheus" / "celery-lease-rules.yml"


def timed(ops: Ops, name: str, seconds: float, to: State = State.SUCCEEDED) -> str:
    """A finished run of ``name`` whose recorded duration is ``seconds``."""
    task_id = ops.finished(to, name)
    t = ops.store.t.tasks
    with ops.store.engine.begin() as conn:
        row = conn.execute(t.select().where(t.c.id == task_id)).one()
        conn.execute(
            update(t)
            .where(t.c.id == task_id)
            .values(started_at=row.finished_at - timedelta(seconds=seconds))
        )
    return task_id


def populate(ops: Ops) -> dict[str, str]:
    for s in range(1, 11):
        timed(ops, "ops.add", float(s))
    timed(ops, "ops.add", 0.5, State.FAILED)
    cancelled = ops.submit("ops.add")
    ops.store.request_cancel(cancelled, actor="op", reason="not needed")
    t = ops.store.t.tasks
    with ops.store.engine.begin() as conn:
        conn.execute(update(t).where(t.c.name == "ops.add").values(max_runtime=20.0))
    backlog = [ops.submit("ops.slow", (1,)) for _ in range(2)]
    zombie = ops.submit("ops.add")
    worker = ops.register_worker("lost@ops-test")
    ops.claim(zombie, worker)
    ops.store.stop_worker(worker[0], "SIGKILL")
    return {"zombie": zombie, "backlog": backlog[0]}


def test_stats_per_task_name(ops: Ops) -> None:
    populate(ops)
    ops.store.add_counts({"republished": 3, "duplicates_dropped": 2})
    snap = ops.admin.stats(window=3600)
    by_name = {t.name: t for t in snap.tasks}
    add = by_name["ops.add"]
    assert (add.finished, add.succeeded, add.failed, add.cancelled) == (12, 10, 1, 1)
    assert add.failure_rate == pytest.approx(1 / 12) and add.cancel_rate == pytest.approx(1 / 12)
    # 11 runs: 0.5 s and 1..10 s (the cancelled task never ran)
    assert add.runs == 11
    assert add.run_p50 == pytest.approx(5.0, abs=0.01)
    assert add.run_max == pytest.approx(10.0, abs=0.01)
    assert add.run_p99 == pytest.approx(9.9, abs=0.02)
    assert add.max_runtime == 20.0 and add.lease_ttl == ops.store.config.ttl
    assert add.p99_of_max_runtime == pytest.approx(9.9 / 20, abs=0.01)
    assert add.pending == 0 and add.oldest_pending_age is None
    slow = by_name["ops.slow"]
    assert slow.pending == 2 and slow.oldest_pending_age is not None
    assert slow.finished == 0 and slow.failure_rate is None and slow.run_p50 is None
    assert snap.zombies == snap.expired_unreaped == 1
    assert (snap.republished, snap.duplicates_dropped, snap.purged) == (3, 2, 0)
    assert snap.counts[State.SUCCEEDED] == 10 and snap.counts[State.PENDING] == 2
    assert not snap.counts_estimated
    assert snap.run_p95 is not None and snap.run_p50 == pytest.approx(add.run_p50)
    as_json = json.loads(json.dumps(snap.as_dict()))
    assert {t["name"] for t in as_json["tasks"]} == {"ops.add", "ops.slow"}
    # outside the window nothing counts
    assert ops.admin.stats(window=0.001).finished == 0


def test_finished_counts_past_the_cap_are_estimates(ops: Ops) -> None:
    for _ in range(4):
        ops.finished(State.SUCCEEDED)
    ops.finished(State.FAILED)
    exact, estimated = state_counts(ops.store, cap=10)
    assert not estimated and exact[State.SUCCEEDED] == 4 and exact[State.FAILED] == 1
    if ops.store.is_pg:
        t = ops.store.t.tasks
        with ops.store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            c.execute(text(f'ANALYZE "{t.schema}"."{t.name}"' if t.schema else f"ANALYZE {t.name}"))
    counts, estimated = state_counts(ops.store, cap=2)
    assert estimated
    assert counts[State.SUCCEEDED] >= 2  # an estimate, never below what was counted
    assert counts[State.FAILED] == 1  # under the cap: exact


def scrape(ops: Ops, window: float = 3600) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    body = generate_latest(registry(ops.app, ops.store, window=window)).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def test_prometheus_exports_the_health_figures(ops: Ops) -> None:
    populate(ops)
    ops.store.add_counts({"republished": 3, "duplicates_dropped": 2, "purged": 7})
    got = scrape(ops)

    def v(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted(labels.items())))]

    assert v("celery_lease_task_runtime_seconds", task="ops.add", quantile="0.5") == (
        pytest.approx(5.0, abs=0.01)
    )
    assert v("celery_lease_task_max_runtime_seconds", task="ops.add") == 20.0
    assert v("celery_lease_task_lease_ttl_seconds", task="ops.add") == ops.store.config.ttl
    assert v("celery_lease_task_finished", task="ops.add", state="FAILED") == 1
    assert v("celery_lease_task_failure_ratio", task="ops.add") == pytest.approx(1 / 12)
    assert v("celery_lease_task_cancel_ratio", task="ops.add") == pytest.approx(1 / 12)
    assert v("celery_lease_task_pending", task="ops.slow") == 2
    assert v("celery_lease_task_oldest_pending_age_seconds", task="ops.slow") > 0
    assert v("celery_lease_expired_unreaped") == 1
    assert v("celery_lease_republished_total") == 3
    assert v("celery_lease_duplicates_dropped_total") == 2
    assert v("celery_lease_purged_total") == 7
    assert v("celery_lease_counts_estimated") == 0
    # the window: nothing finished in the last millisecond
    assert not any(k[0] == "celery_lease_task_finished" for k in scrape(ops, window=0.001))


def test_every_metric_an_alert_rule_names_is_exported(ops: Ops) -> None:
    populate(ops)
    ops.register_worker("alive@ops-test")
    exported = {name for name, _ in scrape(ops)}
    rules = RULES.read_text()
    exprs = re.findall(r"^\s+expr: (.+)$", rules, flags=re.M)
    assert len(exprs) == len(re.findall(r"^\s+- alert: ", rules, flags=re.M)) >= 10
    for expr in exprs:
        for metric in re.findall(r"\bcelery_lease_[a-z_]+", expr):
            assert metric in exported, (metric, expr)


def test_lease_stats_prints_the_figures_per_task(ops: Ops) -> None:
    populate(ops)
    result = CliRunner().invoke(
        lease, ["stats"], obj=CLIContext(app=ops.app, no_color=True, workdir=None, quiet=True)
    )
    assert result.exit_code == 0, result.output
    out = result.output
    for label in ("run time p95", "re-published", "duplicates dropped", "purged"):
        assert label in out
    header = next(line for line in out.splitlines() if line.startswith("TASK"))
    assert "P99" in header and "MAX_RUNTIME" in header and "OLDEST" in header
    add = next(line for line in out.splitlines() if line.startswith("ops.add "))
    assert add.split()[1:4] == ["12", "8.3%", "8.3%"]
    assert "20.0s" in add
    as_json = CliRunner().invoke(
        lease,
        ["stats", "--json"],
        obj=CLIContext(app=ops.app, no_color=True, workdir=None, quiet=True),
    )
    assert json.loads(as_json.output)["tasks"][0]["name"] == "ops.add"


# -- duplicates, counted by real workers -------------------------------------------------


def test_a_worker_counts_the_duplicates_it_drops(lease_env: LeaseEnv) -> None:
    p = lease_env.project()
    p.worker()
    task_id = p.submit("t.add", 2, 3)
    p.wait_state(task_id, State.SUCCEEDED)
    assert p.store.counters()["duplicates_dropped"] == 0
    app = p.module.app
    for _ in range(2):  # the same message again: a duplicate delivery
        app.send_task("t.add", args=(2, 3), task_id=task_id, queue=p.project.queue)
    wait_until(
        lambda: p.store.counters()["duplicates_dropped"] == 2,
        timeout=30,
        message="2 duplicates counted",
    )
    assert p.external.count("add") == 1
    assert p.get(task_id).state is State.SUCCEEDED
