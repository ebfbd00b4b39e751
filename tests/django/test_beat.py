"""``leased(DatabaseScheduler)``: django-celery-beat's scheduler with leased entries sent
in slots, two of them at one slot on the Django project's PostgreSQL database.

Not in the ``db`` fixture's rolled-back transaction: the scheduler closes Django's
connection when it is not in autocommit (``close_old_connections``), as it does in a
beat process. Its rows are committed, and deleted at the end."""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import delete, select, update

from celery_lease.beat import leased, slot_key
from celery_lease.store.schema import db_now

pytestmark = pytest.mark.postgres

ENTRY = "add-every-second"


@pytest.fixture
def schedules(lease: Any) -> Iterator[Any]:
    """The store with no beat rows, and no django-celery-beat rows, before and after."""
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    store = lease.store

    def clear() -> None:
        PeriodicTask.objects.all().delete()
        IntervalSchedule.objects.all().delete()
        with store.engine.begin() as conn:
            conn.execute(delete(store.t.schedules))
            conn.execute(delete(store.t.beats))

    clear()
    yield store
    clear()


def test_leased_database_scheduler_sends_each_slot_once(lease: Any, schedules: Any) -> None:
    from django_celery_beat.models import IntervalSchedule, PeriodicTask
    from django_celery_beat.schedulers import DatabaseScheduler

    from .proj import tasks  # the leased task, as the beat process imports it

    assert tasks.app is lease.app
    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(name=ENTRY, task="proj.tasks.add", interval=every, args="[2, 3]")
    scheduler_class = leased(DatabaseScheduler)
    assert leased(scheduler_class) is scheduler_class
    first, second = scheduler_class(app=lease.app), scheduler_class(app=lease.app)
    store = schedules
    assert {r.name for r in store.schedules()} >= {ENTRY, "celery-lease-reap"}

    s = store.t.schedules
    with store.engine.begin() as conn:  # as if no beat had run for 3 s
        back = conn.execute(select(db_now())).scalar_one() - timedelta(seconds=3)
        conn.execute(update(s).where(s.c.name == ENTRY).values(last_slot=back))
    for scheduler in (first, second):
        scheduler.apply_entry(scheduler.schedule[ENTRY], producer=scheduler.producer)

    (row,) = [r for r in store.schedules() if r.name == ENTRY]
    due = round(row.last_slot.timestamp()) - math.floor(back.timestamp())
    sent = {}
    slot = row.last_slot
    while slot > back:
        task_id = store.task_for_key(slot_key(ENTRY, slot))
        if task_id is not None:
            sent[slot] = task_id
        slot -= timedelta(seconds=1)
    # the default policy "latest": the on-time slot and the latest missed one, once each
    assert sorted(sent) == [row.last_slot - timedelta(seconds=1), row.last_slot]
    assert row.missed == due - 2 and row.last_task_id == sent[row.last_slot]
    for task_id in sent.values():
        record = store.get(task_id)
        assert record is not None and record.name == "proj.tasks.add"
        assert record.args == [2, 3]
    for scheduler in (first, second):
        scheduler.close()
