"""Global rate limits with real workers, on Redis and RabbitMQ: two prefork workers of two
processes each run a task limited to 4 starts a second, and a task limited to 2 starts a
second per tenant; from the audit trail (database time) the k-th start of a key never
comes before k intervals after its first, every task ran once, and none waited for a
sweep: a delivery before its turn was given the next free start and published for it.
A backlog (60 deliveries at once at 20 a second, so that paced deliveries run late
behind the ones still being paced) never bursts: any window of k intervals holds at
most k + 1 starts.
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


@app.task(base=LeasedTask, shared=False, name="r.backlog", global_rate_limit="20/s")
def backlog(i):
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


def bursts(times: list[float], interval: float) -> list[tuple[int, int]]:
    """The runs of starts that no design without bursts allows: ``m + 1`` starts (from
    the ``i``-th) within less than ``m - 1`` intervals, i.e. more than ``k + 1`` in a
    window of ``k`` intervals. (A little slack: a start's audit row and the start it
    records are two statements of its claim.)"""
    return [
        (i, m)
        for i in range(len(times))
        for m in range(2, len(times) - i)
        if times[i + m] - times[i] < (m - 1) * interval - 0.005
    ]


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


@pg_only()
def test_a_backlog_of_late_deliveries_starts_without_a_burst(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = lease_env.project(broker_url=broker_url, source=SOURCE, embedded_reaper=False, ttl=10.0)
    workers = [p.worker(name, concurrency=2, ready=False) for name in ("w1", "w2")]
    for worker in workers:
        worker.wait_ready(timeout=60, store=p.store)
    ids = [p.submit("r.backlog", i) for i in range(60)]
    for task_id in ids:
        record = p.wait_state(task_id, S.SUCCEEDED, timeout=120)
        assert record.attempt == 1  # paced (maybe more than once), run once
    times = starts(p, ids)
    assert len(times) == 60
    assert before_their_turn(times, 0.05) == [], times
    assert bursts(times, 0.05) == [], times


BY_NAME = """

@app.task(
    base=LeasedTask,
    shared=False,
    name="r.by_name",
    global_rate_limit="2/s",
    concurrency_key=lambda args, kwargs: kwargs["tenant"],
)
def by_name(i, tenant=None):
    return i
"""


@pg_only()
def test_a_message_whose_key_cannot_be_made_is_still_paced(lease_env: LeaseEnv) -> None:
    """A message sent by name without the key's argument (never checked at submission)
    counts under the key ``""`` and keeps its task's rate: adopted, run once each, a
    start per interval. Before, its slot lost the rate and the claim dropped it."""
    p = lease_env.project(source=SOURCE + BY_NAME, embedded_reaper=False, ttl=10.0)
    p.worker("w1", concurrency=2)
    app = p.module.app
    ids = [app.send_task("r.by_name", args=(i,)).id for i in range(3)]
    for task_id in ids:
        assert p.wait_state(task_id, S.SUCCEEDED, timeout=60).attempt == 1
    times = starts(p, ids)
    assert len(times) == 3 and before_their_turn(times, 0.5) == [], times
    assert "counted under the key ''" in p.workers[0].log_text()
