"""The standalone reaper the docs offer, ``celery -A proj lease reap --loop``
(operators-guide.md, prometheus.md, settings.md): with no embedded reaper in any
worker and no beat, it alone recovers the task of a worker SIGKILLed mid-run, and it
keeps sweeping (its first sweep, before the kill, found nothing)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from celery_lease import State

from ..helpers import wait_until
from .faults import reaper_loop
from .support import RECOVERED, LeaseEnv, released

pytestmark = [pytest.mark.crash, pytest.mark.timeout(180)]


def sweeps(log: Path) -> list[dict[str, int]]:
    """The reports the loop printed so far, one per sweep."""
    lines = log.read_text().splitlines() if log.exists() else []
    return [json.loads(line) for line in lines if line.startswith("{")]


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [
        pytest.param("redis", "sqlite", id="redis-sqlite"),
        pytest.param("redis", "postgresql", id="redis-postgresql", marks=pytest.mark.postgres),
    ],
    indirect=True,
)
def test_reap_loop_recovers_a_killed_workers_task_with_no_other_reaper(
    lease_env: LeaseEnv, broker_url: str, tmp_path: Path
) -> None:
    p = lease_env.project(broker_url=broker_url, embedded_reaper=False)
    log = tmp_path / "reaper.log"
    victim = p.worker("victim", pool="threads")
    gate = p.gates.hold("gate")
    with released(p.gates, gate), reaper_loop(p.project, log) as reaper:
        task_id = p.submit("t.work", "k", gate)
        p.wait_state(task_id, State.RUNNING)
        # the loop swept while the owner was alive: a single sweep would end here
        first = wait_until(lambda: sweeps(log), timeout=60, message="the loop's first sweep")
        assert first[0]["expired"] == 0
        victim.kill_group(signal.SIGKILL)
        victim.wait_group_gone()
        p.gates.release(gate)
        rescuer = p.worker("rescuer", pool="threads")
        record = p.wait_state(task_id, State.SUCCEEDED, timeout=60)
        assert reaper.poll() is None, log.read_text()
    assert sum(s["expired"] for s in sweeps(log)) == 1
    assert record.attempt == 2 and record.recoveries == 1
    assert record.result == {"key": "k", "node": rescuer.nodename}
    assert p.trail(task_id) == RECOVERED
    expiry = p.store.history(task_id)[2]
    # the CLI's actor, not a worker's embedded reaper ("reaper:<node>")
    assert expiry.actor.startswith("admin:"), expiry
    assert expiry.reason == "lease expired: owner's heartbeat older than the TTL"
