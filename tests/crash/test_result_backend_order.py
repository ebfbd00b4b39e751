"""The result backend never goes back in a task's history, after a lost node.

The survivor's reaper writes the lease's TIMEOUT from a background thread, then
publishes the re-run, whose worker writes STARTED and SUCCESS: every write to the
task's Redis result key, recorded in order, must follow the row's audit history (see
``tests/integration/test_result_backend_order.py`` for an operator's retry).
"""

from __future__ import annotations

import signal
from typing import Any

import pytest

from celery_lease import State

from ..integration.test_result_backend_order import SHOWN, BackendWrites, follows
from .support import LeaseEnv, released


@pytest.mark.parametrize(
    ("broker_url", "backend"), [pytest.param("redis", "sqlite", id="redis-sqlite")], indirect=True
)
def test_the_result_backend_never_goes_back_after_a_lost_node(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    settings: dict[str, Any] = {"result_backend": broker_url, "task_track_started": True}
    p = lease_env.project(broker_url=broker_url, settings=settings)  # lease_ttl 1 s
    workers = [p.worker("a"), p.worker("b")]
    writes = BackendWrites(broker_url)
    gate = p.gates.hold("gate")
    try:
        with released(p.gates, gate):
            task_id = p.submit("t.work", "k", gate)
            running = p.wait_state(task_id, State.RUNNING)
            victim = {p.incarnation(w): w for w in workers}[str(running.owner)]
            victim.kill_group(signal.SIGKILL)
            victim.wait_group_gone()
        p.wait_state(task_id, State.SUCCEEDED)
        writes.wait_final([task_id])
    finally:
        writes.close()

    seen = writes.states[task_id]
    history = [SHOWN[r.to_state] for r in p.store.history(task_id)]
    assert "TIMEOUT" in seen and seen[-1:] == ["SUCCESS"], seen
    assert follows(seen, history), (seen, history)
