"""``leased(DatabaseScheduler)``: django-celery-beat's scheduler with leased entries sent
in slots, two of them at one slot on the Django project's PostgreSQL database.

Not in the ``db`` fixture's rolled-back transaction: the scheduler closes Django's
connection when it is not in autocommit (``close_old_connections``), as it does in a
beat process. Its rows are committed, and deleted at the end."""

from __future__ import annotations

import json
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
    first.apply_entry(first.schedule[ENTRY], producer=first.producer)
    (row,) = [r for r in store.schedules() if r.name == ENTRY]
    # the default policy "latest": the on-time slot and the latest missed one, once each
    expected = {row.last_slot - timedelta(seconds=1), row.last_slot}
    later = row.last_slot
    second.apply_entry(second.schedule[ENTRY], producer=second.producer)
    (row,) = [r for r in store.schedules() if r.name == ENTRY]
    if row.last_slot > later:
        # the second beat came in a later second: its own on-time slot (and the latest it
        # missed, if more than one second went by), never one the first beat decided
        expected |= {max(row.last_slot - timedelta(seconds=1), later + timedelta(seconds=1))}
        expected |= {row.last_slot}
    due = round(row.last_slot.timestamp()) - math.floor(back.timestamp())
    sent = {}
    slot = row.last_slot
    while slot > back:
        task_id = store.task_for_key(slot_key(ENTRY, slot))
        if task_id is not None:
            sent[slot] = task_id
        slot -= timedelta(seconds=1)
    assert sorted(sent) == sorted(expected)
    assert row.missed == due - len(expected) and row.last_task_id == sent[row.last_slot]
    for task_id in sent.values():
        record = store.get(task_id)
        assert record is not None and record.name == "proj.tasks.add"
        assert record.args == [2, 3]
    for scheduler in (first, second):
        scheduler.close()


def _go_back(store: Any, seconds: float) -> Any:
    """As if no beat had run for ``seconds``: the entry's decided slots set back."""
    s = store.t.schedules
    with store.engine.begin() as conn:
        back = conn.execute(select(db_now())).scalar_one() - timedelta(seconds=seconds)
        conn.execute(update(s).where(s.c.name == ENTRY).values(last_slot=back))
    return back


def test_per_entry_options_come_from_the_periodic_tasks_headers(lease: Any, schedules: Any) -> None:
    # a PeriodicTask has no field for options of one's own; its headers (JSON) reach
    # the entry's options, and the lease_* keys there are the entry's policies
    from django_celery_beat.models import IntervalSchedule, PeriodicTask
    from django_celery_beat.schedulers import DatabaseScheduler

    from .proj import tasks  # noqa: F401  (the leased task, as the beat process imports it)

    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(
        name=ENTRY,
        task="proj.tasks.add",
        interval=every,
        args="[2, 3]",
        headers=json.dumps({"lease_catchup": "all", "lease_catchup_max": 3, "team": "ops"}),
    )
    scheduler = leased(DatabaseScheduler)(app=lease.app)
    store = schedules
    back = _go_back(store, 10)
    scheduler.apply_entry(scheduler.schedule[ENTRY], producer=scheduler.producer)

    (row,) = [r for r in store.schedules() if r.name == ENTRY]
    due = round(row.last_slot.timestamp()) - math.floor(back.timestamp())
    sent = [
        row.last_slot - timedelta(seconds=i)
        for i in range(due)
        if store.task_for_key(slot_key(ENTRY, row.last_slot - timedelta(seconds=i)))
    ]
    # "all", at most 3: the three most recent missed slots and the one on time
    assert sorted(sent) == [row.last_slot - timedelta(seconds=i) for i in (3, 2, 1, 0)]
    assert row.missed == due - 4
    assert row.last_reason is not None and "lease_catchup='all'" in row.last_reason
    task_id = store.task_for_key(slot_key(ENTRY, row.last_slot))
    record = store.get(task_id)
    assert record is not None and record.message is not None
    # the policies stay out of the task's message; the entry's other headers go with it
    assert "lease_catchup" not in record.message and "ops" in record.message
    scheduler.close()


def test_a_bad_policy_in_a_periodic_tasks_headers_stops_the_scheduler_naming_it(
    lease: Any, schedules: Any
) -> None:
    from django_celery_beat.models import IntervalSchedule, PeriodicTask
    from django_celery_beat.schedulers import DatabaseScheduler

    from celery_lease import ConfigurationError

    from .proj import tasks  # noqa: F401

    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(
        name=ENTRY,
        task="proj.tasks.add",
        interval=every,
        args="[2, 3]",
        headers=json.dumps({"lease_catchup": "sometimes"}),
    )
    with pytest.raises(ConfigurationError, match=rf"beat entry '{ENTRY}'.*lease_catchup"):
        leased(DatabaseScheduler)(app=lease.app)
    assert schedules.schedules() == [] and schedules.beats(seen_within=3600) == []


def test_a_bad_entry_added_while_the_beat_runs_is_never_sent_until_it_is_fixed(
    lease: Any, schedules: Any
) -> None:
    from django_celery_beat.models import IntervalSchedule, PeriodicTask
    from django_celery_beat.schedulers import DatabaseScheduler

    from .proj import tasks  # noqa: F401

    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(name=ENTRY, task="proj.tasks.add", interval=every, args="[2, 3]")
    scheduler = leased(DatabaseScheduler)(app=lease.app)
    store = schedules
    bad = PeriodicTask.objects.create(
        name="later",
        task="proj.tasks.add",
        interval=every,
        args="[4, 5]",
        headers=json.dumps({"lease_overlap": "queue"}),
    )
    entry = scheduler.schedule["later"]
    # rejected, with its error logged: not sent in slots, nor as a plain entry
    assert not scheduler.is_due(entry).is_due
    scheduler.apply_entry(entry, producer=scheduler.producer)
    assert "later" not in {r.name for r in store.schedules()}
    assert [r for r in store.list_tasks(name="proj.tasks.add") if r.args == [4, 5]] == []

    bad.headers = json.dumps({"lease_overlap": "skip"})  # fixed: checked again
    bad.save()
    entry = scheduler.schedule["later"]
    assert scheduler.is_due(entry).is_due
    scheduler.apply_entry(entry, producer=scheduler.producer)
    assert "later" in {r.name for r in store.schedules()}
    scheduler.close()
