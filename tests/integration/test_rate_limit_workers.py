"""Global rate limits with real workers, on Redis and RabbitMQ: two prefork workers of two
processes each run a task limited to 4 starts a second, and a task limited to 2 starts a
second per tenant; from the audit trail (database time) the k-th start of a key never
comes before k intervals after its first, every task ran once, and none waited for a
sweep: a delivery before its turn was given the next free start and published for it.
"""

from __future__ import annotations

from celery_lease import State

from ..crash.support import LeaseEnv, pg_only

S = State

SOURCE = """
from celery_lease import LeasedTask


@app.task(base=LeasedTask, shared=False, name="r.paced", global_rate_limit="4/s")
def paced(i):
    return i


@app.task(
    base=LeasedTask,
    shared=False,
    name="r.tenant",
    global_rate_limit="2/s",
    concurrency_key="tenant",
)
def per_tenant(i, tenant):
    return i
"""


def starts(p: object, task_ids: list[str]) -> list[float]:
    """The database time of every claim of these tasks, in order."""
    out = []
    for task_id in task_ids:
        out += [r.at.timestamp() for r in p.store.history(task_id) if r.to_state is S.RUNNING]  # type: ignore[attr-defined]
    return sorted(out)


def before_their_turn(times: list[float], interval: float) -> list[int]:
    """Which of these starts (in order) came before its turn: the k-th start of a key
    is given a start ``k`` intervals after the first, and may take it late (its message
    delivered a moment after), never early. (A little slack for SQLite's clock, read
    per statement.)"""
    return [k for k, at in enumerate(times) if at - times[0] < k * interval - 0.003]


@pg_only()
def test_starts_are_spaced_by_the_rate_across_workers_and_each_task_runs_once(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    # no reaper: a paced delivery is published again by the pool process that paced it
    p = lease_env.project(broker_url=broker_url, source=SOURCE, embedded_reaper=False, ttl=10.0)
    workers = [p.worker(name, concurrency=2, ready=False) for name in ("w1", "w2")]
    for worker in workers:
        worker.wait_ready(timeout=60, store=p.store)
    paced = [p.submit("r.paced", i) for i in range(8)]
    tenants = [p.submit("r.tenant", i, f"t{i % 2}") for i in range(6)]
    for task_id in paced + tenants:
        record = p.wait_state(task_id, S.SUCCEEDED, timeout=60)
        assert record.attempt == 1  # paced, not re-run: one claim, one run
    times = starts(p, paced)
    assert len(times) == 8
    assert before_their_turn(times, 0.25) == [], times  # 4 a second, across both workers
    for k in (0, 1):
        mine = starts(p, [t for i, t in enumerate(tenants) if i % 2 == k])
        assert len(mine) == 3 and before_their_turn(mine, 0.5) == [], mine
    # deliveries did come before their turn, and were paced
    assert any("paced by the global rate limit of r.paced" in w.log_text() for w in p.workers)
