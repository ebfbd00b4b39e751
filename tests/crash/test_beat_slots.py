"""Beat with slots, with real ``celery beat`` processes (crash-point matrix row 29).

Every beat runs ``celery_lease.beat:LeaseScheduler``; an entry of a leased task every
second is sent in slots whose dedup keys name the slot. The task counts itself in the
counting stub (one effect per run, its payload the task id), so "each slot ran once"
is read from what ran, not from what was sent.
"""

from __future__ import annotations

from datetime import datetime

import pytest

from celery_lease import State
from celery_lease.beat import slot_key

from ..helpers import wait_until
from .support import TASKS, LeasedProject, LeaseEnv

SOURCE = (
    TASKS
    + '''

from datetime import timedelta


@app.task(base=LeasedTask, bind=True, shared=False, name="t.tick")
def tick(self):
    """One run of a slot: counted by the stub, with this task's id."""
    external.call("tick", payload=self.request.id)
    return self.request.id


app.conf.beat_schedule = {"every": {"task": "t.tick", "schedule": timedelta(seconds=1)}}
'''
)

SETTINGS = {"beat_scheduler": "celery_lease.beat:LeaseScheduler"}


def slot_rows(p: LeasedProject) -> dict[datetime, str]:
    """Slot time -> task id of every slot of the entry written so far."""
    out: dict[datetime, str] = {}
    for record in p.store.list_tasks(name="t.tick", limit=100_000):
        assert record.dedup_key is not None and record.dedup_key.startswith("beat:every@")
        slot = datetime.fromisoformat(record.dedup_key.removeprefix("beat:every@"))
        assert slot_key("every", slot) == record.dedup_key
        out[slot] = record.id
    return out


def check_each_slot_ran_once(p: LeasedProject, lease_env: LeaseEnv) -> dict[datetime, str]:
    """Every slot written ran exactly once, and every slot between the first and the
    last either ran or is counted as missed."""
    slots = slot_rows(p)
    for task_id in slots.values():
        p.wait_state(task_id, State.SUCCEEDED, timeout=60)
    ran = [e.payload for e in lease_env.external.effects("tick")]
    assert sorted(ran) == sorted(slots.values())  # each slot's task ran once, no other
    times = sorted(slots)
    absent = round((times[-1] - times[0]).total_seconds()) + 1 - len(times)
    (row,) = [r for r in p.store.schedules() if r.name == "every"]
    assert absent == row.missed + row.skipped, (times, row)
    return slots


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [
        pytest.param("redis", "sqlite", id="redis-sqlite"),
        pytest.param("amqp", "postgresql", id="amqp-postgresql", marks=pytest.mark.postgres),
    ],
    indirect=True,
)
def test_two_beats_at_once_run_each_slot_once(lease_env: LeaseEnv, broker_url: str) -> None:
    p = lease_env.project(broker_url=broker_url, source=SOURCE, settings=SETTINGS)
    p.worker("a", concurrency=2)
    beats = [p.project.beat("beat1"), p.project.beat("beat2")]
    for beat in beats:
        beat.wait_ready(timeout=60)
    wait_until(
        lambda: len(p.store.beats(seen_within=3600)) == 2, timeout=60, message="both beats seen"
    )

    wait_until(lambda: len(slot_rows(p)) >= 8, timeout=90, message="8 slots written")
    for beat in beats:
        beat.stop()

    slots = check_each_slot_ran_once(p, lease_env)
    assert len(slots) >= 8
    (row,) = [r for r in p.store.schedules() if r.name == "every"]
    # a beat was up all along: no slot missed
    assert row.last_task_id in slots.values() and row.missed == 0 and row.skipped == 0
    actors = {r.updated_by for r in p.store.schedules()}
    assert actors and all(a is not None and a.startswith("beat:") for a in actors)


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [
        pytest.param("redis", "sqlite", id="redis-sqlite"),
        pytest.param("amqp", "postgresql", id="amqp-postgresql", marks=pytest.mark.postgres),
    ],
    indirect=True,
)
def test_beat_killed_between_a_slots_row_and_its_publish_the_reaper_publishes_it(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = lease_env.project(broker_url=broker_url, source=SOURCE, settings=SETTINGS)
    p.worker("a")  # its embedded reaper publishes rows never published
    doomed = p.project.beat("doomed", env={"CELERY_LEASE_CRASH_AT": "beat_slot_rows"})

    wait_until(lambda: doomed.returncode is not None, timeout=60, message="beat died")
    assert doomed.returncode == 137  # the crash point: rows committed, nothing sent
    (slot_task,) = slot_rows(p).values()
    record = p.wait_state(slot_task, State.SUCCEEDED, timeout=60)
    assert record.attempt == 1
    assert [e.payload for e in lease_env.external.effects("tick")] == [slot_task]

    # a beat started again goes on from the slot decided, not from its own start
    survivor = p.project.beat("survivor")
    survivor.wait_ready(timeout=60)
    wait_until(lambda: len(slot_rows(p)) >= 4, timeout=60, message="3 more slots")
    survivor.stop()
    slots = check_each_slot_ran_once(p, lease_env)
    assert slot_task in slots.values()
    assert survivor.returncode is not None and survivor.returncode <= 0
    assert "Traceback" not in survivor.log_text()
