"""An outcome lost while its worker lives: the worker gives the lease back.

A worker's heartbeat keeps every lease it owns, so a RUNNING row whose outcome was
acknowledged and then lost (an asynchronous replica promoted without the last commits,
``scripts/failover_window.py``; a backup restored) would stay RUNNING for as long as
the worker lives. The worker's reconciliation (``celery_lease.worker.main.reconcile``)
compares the rows it owns with the tasks it has in hand and gives back the lease of a
row it no longer runs.

The loss is injected the way the replica lost it: a leased task finishes on a live
worker (SUCCEEDED in the store), then its row, its steps and its audit trail are
written back to what they were while it ran (RUNNING, same owner, same attempt and
token, ``finished_at`` NULL, the later audit rows gone), with direct statements.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from sqlalchemy import delete, func, insert, select, update

from celery_lease import State
from celery_lease.store import Store

from ..helpers import wait_until
from .support import CLEAN_RUN, GIVEN_BACK, TASKS, LeasedProject, LeaseEnv, released

pytestmark = pytest.mark.crash

SOURCE = (
    TASKS
    + '''

@app.task(base=LeasedTask, bind=True, shared=False, name="t.charge_held")
def charge_held(self, key, gate=None):
    """A non-idempotent step whose call waits at the gate."""
    external.call(f"start:{key}")

    def charge():
        external.call(f"charge:{key}")
        hold(gate)
        return "paid"

    return self.step("charge", charge)
'''
)

#: A lost outcome given back, and the task run again: the trail of any lease given back
#: and retried (``GIVEN_BACK``).
RUN_AGAIN = GIVEN_BACK


@dataclasses.dataclass(frozen=True)
class Replica:
    """A task as an asynchronous replica had it: its row, its steps, its last audit row."""

    task: dict[str, Any]
    steps: list[dict[str, Any]]
    last_audit: int


def replicate(store: Store, task_id: str) -> Replica:
    """What the replica receives of ``task_id`` now."""
    t, s, tr = store.t.tasks, store.t.steps, store.t.transitions
    with store.engine.begin() as conn:
        row = conn.execute(select(t).where(t.c.id == task_id)).one()._asdict()
        steps = [r._asdict() for r in conn.execute(select(s).where(s.c.task_id == task_id))]
        last = conn.execute(select(func.max(tr.c.id)).where(tr.c.task_id == task_id)).scalar_one()
    return Replica(row, steps, int(last))


def promote(store: Store, replica: Replica) -> None:
    """Write ``replica`` back: what the task looks like on the promoted replica."""
    t, s, tr = store.t.tasks, store.t.steps, store.t.transitions
    task_id = replica.task["id"]
    values = {k: v for k, v in replica.task.items() if k != "id"}
    with store.engine.begin() as conn:
        conn.execute(update(t).where(t.c.id == task_id).values(**values))
        conn.execute(delete(s).where(s.c.task_id == task_id))
        if replica.steps:
            conn.execute(insert(s), replica.steps)
        conn.execute(delete(tr).where(tr.c.task_id == task_id, tr.c.id > replica.last_audit))


def lose_outcome(p: LeasedProject, task_id: str, gate: str, running: str) -> Replica:
    """Let ``task_id`` (held at ``gate`` once the stub counted ``running``) finish, then
    lose its outcome: the row goes back to what it was while the task ran."""
    p.wait_count(running, 1)
    replica = replicate(p.store, task_id)
    assert replica.task["state"] == State.RUNNING.value
    p.gates.release(gate)
    p.wait_state(task_id, State.SUCCEEDED)
    promote(p.store, replica)
    rec = p.get(task_id)
    assert (rec.state, rec.attempt, rec.finished_at) == (State.RUNNING, 1, None), rec
    return replica


@pytest.mark.parametrize(
    ("broker_url", "backend", "pool"),
    [
        pytest.param(
            "amqp",
            "postgresql",
            "prefork",
            id="amqp-postgresql-prefork",
            marks=pytest.mark.postgres,
        ),
        pytest.param("redis", "sqlite", "threads", id="redis-sqlite-threads"),
    ],
    indirect=["broker_url", "backend"],
)
def test_a_lost_outcome_is_given_back_by_its_live_worker(
    lease_env: LeaseEnv, broker_url: str, pool: str
) -> None:
    """An idempotent task whose outcome was lost runs again once; a task whose
    non-idempotent step was in flight in the state that came back goes to a person; a
    task held at a gate through every one of those rounds is never touched. Prefork
    (outcomes through the writer, claims ahead by the agent) and threads (outcomes
    written through by the main process's threads)."""
    p = lease_env.project(broker_url=broker_url, source=SOURCE)
    worker = p.worker("node", pool=pool, concurrency=3)
    incarnation = p.incarnation(worker)
    long_gate, work_gate, charge_gate = (p.gates.hold(g) for g in ("long", "work", "charge"))
    with released(p.gates, long_gate, work_gate, charge_gate):
        long_id = p.submit("t.work", "long", long_gate)
        work_id = p.submit("t.work", "work", work_gate)
        charge_id = p.submit("t.charge_held", "charge", charge_gate)

        # the idempotent task: given back (two rounds of reconciliation), then run again
        lose_outcome(p, work_id, work_gate, "start:work")
        rec = wait_until(
            lambda: (r := p.get(work_id)).state is State.SUCCEEDED and r.attempt == 2 and r,
            timeout=30,
            message="the task whose outcome was lost run again",
        )
        assert (rec.recoveries, rec.owner) == (1, incarnation), rec
        assert p.trail(work_id) == RUN_AGAIN
        timeout = next(r for r in p.store.history(work_id) if r.to_state is State.TIMEOUT)
        assert "owned by worker node" in timeout.reason and "not running there" in timeout.reason
        assert timeout.attempt == 1
        assert (p.external.count("start:work"), p.external.count("done:work")) == (2, 2)

        # the non-idempotent step in flight in the lost state: a person decides (two more
        # rounds, all after the first task's: the long task has been owned past its TTL
        # through at least four)
        lose_outcome(p, charge_id, charge_gate, "charge:charge")
        rec = p.wait_state(charge_id, State.WAIT_MANUAL, timeout=30)
        assert rec.reason is not None and "outcome of step 'charge' unknown" in rec.reason
        assert "not running there" in rec.reason
        assert (rec.attempt, rec.recoveries) == (1, 1), rec
        assert (p.external.count("start:charge"), p.external.count("charge:charge")) == (1, 1)

        # the task running all along was never touched
        rec = p.get(long_id)
        assert (rec.state, rec.attempt, rec.recoveries) == (State.RUNNING, 1, 0), rec
        assert p.trail(long_id) == CLEAN_RUN[:2]
    rec = p.wait_state(long_id, State.SUCCEEDED)
    assert (rec.attempt, rec.recoveries) == (1, 0)
    assert p.trail(long_id) == CLEAN_RUN
    assert p.external.count("start:long") == 1
    # nothing else was given back, nor the re-run
    assert p.get(work_id).attempt == 2
    assert p.get(charge_id).state is State.WAIT_MANUAL
    assert worker.is_alive()
