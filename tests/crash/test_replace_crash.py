"""``Task.replace()`` under a crash: the pool child running the replaced task dies
right after the replaced run's outcome and the replacement's rows were committed
together, before anything was published (crash point ``after_replace_recorded``).

The rows are the outbox: the replacement is published by the worker's fast path (a
row with the replaced id, PENDING) or by the reaper (the first task of a replacing
chain, a fresh id), and runs once; the replaced task does not run again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from celery_lease import State

from ..integration.test_replace_and_resend import PROJECT, RUN_TWICE, combo, results
from .support import LeaseEnv


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [combo("redis", "sqlite"), combo("amqp", "postgresql")],
    indirect=True,
)
def test_a_replaced_task_whose_worker_dies_after_the_replace_is_recorded_runs_its_replacement_once(
    lease_env: LeaseEnv, broker_url: str, tmp_path: Path
) -> None:
    p = lease_env.project(broker_url=broker_url, source=PROJECT, settings=results(tmp_path))
    replace_with = p.module.app.tasks["r.replace_with"]
    w = p.worker(env={"CELERY_LEASE_CRASH_AT": "after_replace_recorded"})

    by_task = replace_with.delay("task", 1)
    by_chain = replace_with.delay("chain", 10)

    def dead_children() -> Any:
        return w.wait_log(r"Process .* exited with .*exitcode 137", timeout=30)

    dead_children()
    assert by_task.get(timeout=60) == 2
    assert by_chain.get(timeout=60) == 22
    for result in (by_task, by_chain):
        record = p.wait_state(result.id, State.SUCCEEDED)
        assert p.trail(result.id) == RUN_TWICE
        assert record.attempt == 1
    # each pool child died after its replace was recorded: neither replaced task ran
    # again, and each replacement ran once
    assert lease_env.external.count("replaced") == 2
    assert sorted(e.payload or "" for e in lease_env.external.effects("add")) == ["1+1", "10+1"]
    assert lease_env.external.count("double") == 1
