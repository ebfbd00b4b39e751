"""Prometheus metrics scraped over HTTP, from an in-process server and from the real
``celery -A proj lease metrics --port N``, against a real database."""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import pytest
from celery.bin.base import CLIContext
from click.testing import CliRunner

from celery_lease import MissingDependencyError, State
from celery_lease import metrics as lease_metrics
from celery_lease.cli import lease
from celery_lease.store import Store

from ..helpers import WorkerProject, wait_until
from .test_cli_support import Ops, close_ops, free_port, make_ops, ops_fixture  # noqa: F401

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        assert response.status == 200
        text = response.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def served(
    celery_project: Callable[..., WorkerProject],
    make_store: Callable[..., Store],
    redis_url: str,
) -> Iterator[tuple[Ops, int]]:
    """The metrics server on a project whose ``lease_ttl`` is an hour: a worker's
    ``alive`` gauge compares its heartbeat with that setting, so with the suite's 1 s TTL
    a slow moment between registering a worker and scraping would report it dead. The
    zombie stays expired whatever the TTL: its incarnation is stopped."""
    ops = make_ops(celery_project, make_store(ttl=3600), settings={"result_backend": redis_url})
    server = lease_metrics.serve(ops.app, port=0, addr="127.0.0.1")
    yield ops, int(server.server_address[1])
    server.shutdown()
    server.server_close()
    close_ops(ops)


def zombie(ops: Ops) -> str:
    task_id = ops.submit()
    worker = ops.register_worker("lost@ops-test")
    ops.claim(task_id, worker)
    ops.store.stop_worker(worker[0], "SIGKILL")
    return task_id


def test_metrics_over_http(served: tuple[Ops, int]) -> None:
    ops, port = served
    done = [ops.finished(State.SUCCEEDED) for _ in range(2)]
    ops.wait_manual()
    ops.submit()  # pending
    zombie(ops)
    ops.running(nodename="busy@ops-test")

    first = scrape(port)

    assert value(first, "celery_lease_up") == 1
    assert value(first, "celery_lease_tasks", state="SUCCEEDED") == 2
    assert value(first, "celery_lease_tasks", state="WAIT_MANUAL") == 1
    assert value(first, "celery_lease_tasks", state="RUNNING") == 2
    assert value(first, "celery_lease_tasks", state="FAILED") == 0
    assert value(first, "celery_lease_expired_unreaped") == 1
    assert value(first, "celery_lease_oldest_pending_age_seconds") > 0
    assert value(first, "celery_lease_recoveries_total") == 1
    pair = {"from_state": "TIMEOUT", "to_state": "WAIT_MANUAL"}
    assert value(first, "celery_lease_transitions_total", **pair) == 1
    assert (
        value(first, "celery_lease_transitions_total", from_state="none", to_state="PENDING") == 6
    )
    busy = {"worker": "busy@ops-test", "hostname": "ops-host"}
    assert value(first, "celery_lease_worker_heartbeat_age_seconds", **busy) >= 0
    assert value(first, "celery_lease_worker_alive", worker="busy@ops-test") == 1
    assert value(first, "celery_lease_worker_running_tasks", worker="busy@ops-test") == 1
    # a stopped incarnation is gone from the per-worker gauges
    assert not any(labels and ("worker", "lost@ops-test") in labels for _, labels in first)

    ops.admin.reap()  # the zombie: RUNNING -> TIMEOUT -> RETRY_WAIT -> PENDING
    # their audit rows go too: not yet folded into the totals (they are younger than
    # lease_totals_settle), so the purge adds them to the totals as it deletes them
    assert ops.admin.purge(older_than=0) == 2
    second = scrape(port)

    assert value(second, "celery_lease_expired_unreaped") == 0
    assert value(second, "celery_lease_recoveries_total") == 2
    assert value(second, "celery_lease_tasks", state="SUCCEEDED") == 0
    for (name, labels), before in first.items():
        if name.endswith("_total"):  # counters never go down, purge or not
            assert second[(name, labels)] >= before, (name, labels)
    assert all(ops.store.get(t) is None for t in done)


def test_rows_not_yet_folded_are_counted_at_every_scrape(ops: Ops) -> None:
    totals = lease_metrics.TransitionTotals()
    ops.submit()
    assert totals.read(ops.store)[("none", "PENDING")] == 1
    ops.submit()
    assert totals.read(ops.store)[("none", "PENDING")] == 2  # recent rows: read afresh


def test_database_unreachable_is_up_0_not_a_failed_scrape(
    celery_project: Callable[..., WorkerProject],
) -> None:
    project = celery_project(
        "", settings={"lease_database_url": "postgresql://postgres@127.0.0.1:1/test"}
    )
    app = project.load().app
    server = lease_metrics.serve(app, port=0, addr="127.0.0.1")
    try:
        samples = scrape(int(server.server_address[1]))
    finally:
        server.shutdown()
        server.server_close()
    assert samples == {("celery_lease_up", ()): 0}


def test_lease_metrics_command_serves_a_scrape(ops: Ops) -> None:
    ops.wait_manual()
    port = free_port()
    argv = [sys.executable, "-m", "celery", "-A", ops.project.module, "lease", "metrics"]
    proc = subprocess.Popen(
        [*argv, "--port", str(port), "--addr", "127.0.0.1"],
        cwd=ops.project.directory,
        env=ops.project.process_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:

        def answered() -> Samples | None:
            assert proc.poll() is None, proc.communicate()
            try:
                return scrape(port)
            except (urllib.error.URLError, ConnectionError):
                return None

        samples = wait_until(answered, timeout=60, interval=0.2, message="no metrics served")
        assert value(samples, "celery_lease_up") == 1
        assert value(samples, "celery_lease_tasks", state="WAIT_MANUAL") == 1
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert f"serving celery-lease metrics on http://127.0.0.1:{port}/metrics" in err.decode()


def test_without_prometheus_client_the_error_names_the_extra(
    ops: Ops, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed

    with pytest.raises(MissingDependencyError) as info:
        lease_metrics.registry(ops.app)
    assert info.value.extra == "prometheus"
    assert isinstance(info.value, ImportError)
    assert "pip install 'celery-lease[prometheus]'" in str(info.value)

    obj = CLIContext(app=ops.app, no_color=True, workdir=None)
    result = CliRunner().invoke(lease, ["metrics", "--port", "0"], obj=obj)
    assert result.exit_code == 2
    assert result.stderr.strip() == f"Error: {info.value}"
