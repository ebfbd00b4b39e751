"""Concurrency limits with real workers, on Redis and RabbitMQ: two prefork workers of
two processes each run a task limited to 2 at once and a task limited to 1 per tenant;
from the recorded start and end of every run (the task's own, and the audit trail's in
database time) the limit is never exceeded. No reaper runs: every waiting row is
started by the worker whose outcome freed a slot, not by a sweep. Bad options and
keys fail at submission and write nothing (and stop a worker at start-up).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_lease import ConfigurationError, InvalidSubmission, LeasedTask, State
from celery_lease.config import TUNING_ENV, from_mapping
from celery_lease.producer.slots import limit_of

from ..crash.support import TASKS, LeaseEnv, pg_only, released, report
from ..helpers import wait_until

S = State

SOURCE = """
import os
import time

from celery_lease import LeasedTask

LOG = os.environ["CONC_LOG"]


def record(event, key, i):
    with open(LOG, "a") as f:
        f.write(f"{event} {key} {i} {time.monotonic()!r}\\n")


@app.task(base=LeasedTask, shared=False, name="c.report", concurrency_limit=2)
def report(i, pause):
    record("start", "", i)
    time.sleep(pause)  # the work: long enough for runs to overlap
    record("end", "", i)
    return i


@app.task(base=LeasedTask, shared=False, name="c.tenant", concurrency_key="tenant")
def tenant_job(i, pause, tenant):
    record("start", tenant, i)
    time.sleep(pause)
    record("end", tenant, i)
    return i
"""


def peak(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at once (an end at the same instant as a start closes
    first)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    open_, most = 0, 0
    for _, step in events:
        open_ += step
        most = max(most, open_)
    return most


def runs_from_log(path: Path) -> dict[str, list[tuple[float, float]]]:
    """Each key's (start, end) of every run the tasks recorded."""
    starts: dict[tuple[str, str], float] = {}
    runs: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for line in path.read_text().splitlines():
        event, key, i, at = line.split(" ")
        if event == "start":
            starts[(key, i)] = float(at)
        else:
            runs[key].append((starts.pop((key, i)), float(at)))
    assert not starts, f"runs that never ended: {starts}"
    return runs


def running_intervals(p: Any, task_ids: list[str]) -> list[tuple[float, float]]:
    """Each task's RUNNING spans from its audit trail (database time)."""
    spans = []
    for task_id in task_ids:
        began = None
        for r in p.store.history(task_id):
            if r.to_state is S.RUNNING:
                began = r.at.timestamp()
            elif r.from_state is S.RUNNING and began is not None:
                spans.append((began, r.at.timestamp()))
                began = None
    return spans


@pg_only()
def test_limits_hold_across_workers_and_each_free_starts_a_waiting_row(
    lease_env: LeaseEnv, broker_url: str, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    log.touch()
    p = lease_env.project(
        broker_url=broker_url,
        source=SOURCE,
        env={"CONC_LOG": str(log)},
        # no reaper anywhere: a waiting row can only be started by the worker whose
        # outcome freed the slot (and a TTL long enough that a loaded machine's late
        # heartbeat does not fence a worker: recovering from that needs a reaper)
        embedded_reaper=False,
        ttl=10.0,
    )
    reports = [p.submit("c.report", i, 0.3) for i in range(8)]
    workers = [p.worker(name, concurrency=2, ready=False) for name in ("w1", "w2")]
    for worker in workers:  # started together, waited for together
        worker.wait_ready(timeout=60, store=p.store)
    for task_id in reports:
        record = p.wait_state(task_id, S.SUCCEEDED, timeout=60)
        assert record.attempt == 1  # a waiting row is not re-claimed: it waited, then ran
    # then the per-key limit, alone (two pool processes stay free for a granted row)
    tenants = [p.submit("c.tenant", i, 0.2, f"t{i % 2}") for i in range(6)]
    for task_id in tenants:
        assert p.wait_state(task_id, S.SUCCEEDED, timeout=60).attempt == 1
    runs = runs_from_log(log)
    assert len(runs[""]) == 8 and len(runs["t0"]) == 3 and len(runs["t1"]) == 3
    assert peak(runs[""]) <= 2
    assert peak(runs["t0"]) <= 1 and peak(runs["t1"]) <= 1
    assert peak(running_intervals(p, reports)) <= 2
    tenant_ids = {f"t{k}": [t for i, t in enumerate(tenants) if i % 2 == k] for k in (0, 1)}
    for ids in tenant_ids.values():
        assert peak(running_intervals(p, ids)) <= 1
    # four pool processes and a limit of two: deliveries did wait for a slot
    assert any("waiting for a slot of c.report" in (w.log_text() or "") for w in p.workers), (
        "no delivery of c.report ever waited"
    )
    # measured, never asserted: from a run's end (its outcome's commit) to the next
    # waiting row's claim, through the grant, the broker and a pool process
    spans = sorted(running_intervals(p, reports))
    gaps = [
        start - max(end for _, end in spans if end <= start)
        for start, _ in spans[2:]
        if any(end <= start for _, end in spans)
    ]
    if gaps:
        gaps.sort()
        report("slot freed -> next waiting row claimed, p50", gaps[len(gaps) // 2])
        report("slot freed -> next waiting row claimed, max", gaps[-1])
    usage = {(u.name, u.key): u for u in p.store.slot_usage()}
    assert usage[("c.report", "")].limit == 2
    assert all(u.running == u.granted == u.waiting == 0 for u in usage.values())


def publish_counts(p: Any, task_ids: list[str]) -> dict[str, int]:
    """How many times each row's message was published (the store's own count)."""
    from sqlalchemy import select

    t = p.store.t.tasks
    with p.store.engine.connect() as conn:
        rows = conn.execute(select(t.c.id, t.c.publish_count).where(t.c.id.in_(task_ids)))
        return {str(r.id): int(r.publish_count) for r in rows}


@pg_only()
def test_a_limit_of_the_pool_size_never_makes_a_delivery_wait(
    lease_env: LeaseEnv, redis_url: str, tmp_path: Path
) -> None:
    """The outcome that frees a slot is committed by the pool process before it takes
    its next delivery (written through, not batched): with a limit equal to the pool's
    size, no claim finds the key full, however long the worker's outcome writer holds
    its batches (one second here). Before, each pool process's next claim counted its
    own finished, unwritten run: the delivery was acked as waiting, then granted a slot
    and published again."""
    log = tmp_path / "runs.log"
    log.touch()
    p = lease_env.project(
        broker_url=redis_url,
        source=SOURCE,
        env={"CONC_LOG": str(log), TUNING_ENV: "outcome_flush_interval=1.0"},
        embedded_reaper=False,
        ttl=10.0,
    )
    reports = [p.submit("c.report", i, 0.0) for i in range(20)]
    p.worker("w1", concurrency=2)
    for task_id in reports:
        assert p.wait_state(task_id, S.SUCCEEDED, timeout=60).attempt == 1
    # each message published once, by its submission: no delivery waited for a slot
    # (a waiting row is published again when it is granted one)
    assert publish_counts(p, reports) == {task_id: 1 for task_id in reports}
    assert not any("waiting for a slot" in (w.log_text() or "") for w in p.workers)
    runs = runs_from_log(log)
    assert len(runs[""]) == 20 and peak(runs[""]) <= 2
    assert peak(running_intervals(p, reports)) <= 2


OVERRUN_SOURCE = (
    TASKS
    + """

@app.task(
    base=LeasedTask,
    bind=True,
    shared=False,
    name="t.limited_overrun",
    max_runtime=1.0,
    concurrency_limit=1,
)
def limited_overrun(self, key, gate=None):
    return body(self, key, gate)
"""
)


@pg_only()
def test_an_overrun_holds_its_slot_until_its_run_ends(lease_env: LeaseEnv, redis_url: str) -> None:
    # a limit of 1: the first run overruns max_runtime (WAIT_MANUAL, left running at its
    # gate); the second delivery waits for the slot, and runs only after the first ends
    p = lease_env.project(broker_url=redis_url, source=OVERRUN_SOURCE)
    p.worker(concurrency=2)
    gate = p.gates.hold("gate")
    with released(p.gates, gate):
        first = p.submit("t.limited_overrun", "a", gate)
        p.wait_state(first, S.WAIT_MANUAL, timeout=30)
        second = p.submit("t.limited_overrun", "b")
        wait_until(
            lambda: "waiting for a slot" in (p.get(second).reason or ""),  # type: ignore[union-attr]
            timeout=30,
            message="the second delivery never waited for the slot",
        )
        assert p.get(second).state is S.PENDING  # type: ignore[union-attr]
        assert lease_env.external.count("start:b") == 0
    # the first run ends: its outcome is accepted, which frees the slot for the second
    p.wait_state(first, S.SUCCEEDED, timeout=30)
    p.wait_state(second, S.SUCCEEDED, timeout=30)
    ended = [r.at for r in p.store.history(first) if r.to_state is S.SUCCEEDED]
    began = [r.at for r in p.store.history(second) if r.to_state is S.RUNNING]
    assert len(ended) == 1 and len(began) == 1 and began[0] >= ended[0]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"concurrency_limit": 0}, "concurrency_limit must be a positive whole number"),
        ({"concurrency_limit": -1}, "concurrency_limit"),
        ({"concurrency_limit": 1.5}, "concurrency_limit"),
        ({"concurrency_limit": True}, "concurrency_limit"),
        ({"concurrency_limit": "2"}, "concurrency_limit"),
        ({"concurrency_key": "tenant_id"}, "names no argument of the task"),
        ({"concurrency_key": 42}, "concurrency_key must be an argument's name or a callable"),
        ({"global_rate_limit": "0/s"}, "global_rate_limit must be a positive number"),
        ({"global_rate_limit": "5/d"}, "per 's', 'm' or 'h'"),
        ({"global_rate_limit": "fast"}, "global_rate_limit"),
        ({"global_rate_limit": "nan/s"}, "global_rate_limit"),
        ({"global_rate_limit": True}, "global_rate_limit must be text"),
        ({"global_rate_limit": "10/m", "concurrency_limit": 0}, "concurrency_limit"),
    ],
)
def test_bad_options_are_refused_at_submission_naming_the_task(
    options: dict[str, Any], match: str
) -> None:
    # binding keeps the error (a worker of the app refuses to start with it: exit 78,
    # tests/integration/test_durations.py); every submission path raises it
    app = Celery("bad", set_as_current=False)

    @app.task(base=LeasedTask, shared=False, name="bad.task", **options)
    def task(tenant: int, x: int = 0) -> None:
        pass

    app.finalize()
    with pytest.raises(ConfigurationError, match=rf"task bad\.task: .*{match}"):
        task.lease_options(from_mapping(app.conf))
    with pytest.raises(ConfigurationError, match=match):
        limit_of(task)  # what apply_async, submit_many and the outbox check first


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)  # checked before any write
def test_bad_keys_fail_at_submission_and_write_nothing(lease_env: LeaseEnv) -> None:
    p = lease_env.project(source=SOURCE, env={"CONC_LOG": "/dev/null"})
    app = p.module.app

    def boom(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        raise KeyError("region")

    bad_keys: list[Any] = [
        boom,
        lambda args, kwargs: 42,
        lambda args, kwargs: "",
        lambda args, kwargs: "x" * 256,
    ]
    for n, key in enumerate(bad_keys):

        def job(region: str) -> str:
            return region

        task = app.task(base=LeasedTask, shared=False, name=f"k.{n}", concurrency_key=key)(job)
        with pytest.raises(InvalidSubmission) as info:
            task.apply_async(("eu",))
        assert info.value.argument == "concurrency_key"
        assert f"task k.{n}: concurrency_key" in str(info.value)
    assert p.store.list_tasks() == []
    # a good key: the named argument, given by position or by name
    by_position = app.tasks["c.tenant"].apply_async((1, 0.1, "t9"))
    by_name = app.tasks["c.tenant"].apply_async((2, 0.1), {"tenant": "t9"})
    assert {r.id for r in p.store.list_tasks()} == {by_position.id, by_name.id}
