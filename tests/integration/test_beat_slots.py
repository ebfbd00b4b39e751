"""Beat with slots, decided in-process by ``LeaseScheduler`` on a real store and broker.

Each test moves the entry's row back in time (as a downtime of every beat would leave
it), then lets a scheduler decide the due slots once, and reads what it wrote: the
slots' rows (their dedup keys) and the entry's counters. Real beat processes run in
``tests/crash/test_beat_slots.py``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from celery.bin.base import CLIContext
from celery.schedules import BaseSchedule, schedstate
from click.testing import CliRunner
from sqlalchemy import select, update

from celery_lease import ConfigurationError, State, admin
from celery_lease.beat import LeaseScheduler, slot_key
from celery_lease.cli import lease as lease_cli
from celery_lease.metrics import registry
from celery_lease.store import Store
from celery_lease.store.schema import db_now

from ..helpers import WorkerProject

MISSED = "celery_lease_beat_slots_missed_total"
SKIPPED = "celery_lease_beat_slots_skipped_total"

SOURCE = """
import json
import os
from datetime import timedelta

from celery_lease import LeasedTask

@app.task(base=LeasedTask, bind=True, name="b.tick")
def tick(self):
    return self.request.id

app.conf.beat_schedule = {
    "every": {
        "task": "b.tick",
        "schedule": timedelta(seconds=1),
        "options": json.loads(os.environ.get("BEAT_OPTIONS", "{}")),
    },
}
"""


class Broken(BaseSchedule):
    """A schedule that cannot compute its next time."""

    def remaining_estimate(self, last_run_at: datetime) -> timedelta:
        raise ValueError("no next time")

    def is_due(self, last_run_at: datetime) -> schedstate:
        return schedstate(False, 60.0)


class Beat:
    """A project's app, its store and an in-process ``LeaseScheduler`` of it."""

    def __init__(self, project: WorkerProject, store: Store, tmp_path: Path) -> None:
        self.app = project.load().app
        self.store = store
        self.tmp_path = tmp_path
        self.made: list[LeaseScheduler] = []

    def scheduler(self, name: str = "a") -> LeaseScheduler:
        s = LeaseScheduler(app=self.app, schedule_filename=str(self.tmp_path / f"{name}.db"))
        self.made.append(s)
        return s

    def go_back(self, seconds: float, entry: str = "every") -> datetime:
        """Set the entry's decided slots back ``seconds`` (no beat ran since); returns
        the new ``last_slot``."""
        s = self.store.t.schedules
        with self.store.engine.begin() as conn:
            now = conn.execute(select(db_now())).scalar_one()
            back = now - timedelta(seconds=seconds)
            conn.execute(update(s).where(s.c.name == entry).values(last_slot=back))
        return back

    def decide(self, scheduler: LeaseScheduler, entry: str = "every") -> None:
        scheduler.apply_entry(scheduler.schedule[entry], producer=scheduler.producer)

    def row(self, entry: str = "every") -> Any:
        return next(r for r in self.store.schedules() if r.name == entry)

    def slot_tasks(self, since: datetime, until: datetime) -> dict[str, str]:
        """Dedup key -> task id of the entry's slots in ``(since, until]``."""
        out: dict[str, str] = {}
        s = since.replace(microsecond=0) + timedelta(seconds=1)
        while s <= until:
            task_id = self.store.task_for_key(slot_key("every", s))
            if task_id is not None:
                out[slot_key("every", s)] = task_id
            s += timedelta(seconds=1)
        return out


@pytest.fixture
def beat(
    celery_project: Callable[..., WorkerProject],
    lease_config: Callable[..., Any],
    store: Store,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[..., Beat]]:
    made: list[Beat] = []

    def make(**options: Any) -> Beat:
        monkeypatch.setenv("BEAT_OPTIONS", json.dumps(options))
        project = celery_project(SOURCE, config=lease_config())
        b = Beat(project, store, tmp_path)
        made.append(b)
        return b

    yield make
    for b in made:
        for s in b.made:
            s.close()


def _late_slots(b: Beat, back: datetime, row: Any) -> int:
    """How many slots the decision found due: those in ``(back, row.last_slot]``."""
    return round(row.last_slot.timestamp()) - math.floor(back.timestamp())


@pytest.mark.parametrize(
    ("options", "runs"),
    [
        pytest.param({"lease_catchup": "skip"}, 1, id="skip"),
        pytest.param({}, 2, id="latest-default"),
        pytest.param({"lease_catchup": "all", "lease_catchup_max": 5}, 6, id="all-max-5"),
        pytest.param(
            {"lease_catchup": "all", "lease_catchup_window": 3.0}, 3, id="all-within-window"
        ),
    ],
)
def test_missed_slots_follow_the_catch_up_policy_and_are_counted(
    beat: Callable[..., Beat], options: dict[str, Any], runs: int
) -> None:
    b = beat(**options)
    scheduler = b.scheduler()
    back = b.go_back(30)

    b.decide(scheduler)

    row = b.row()
    due = _late_slots(b, back, row)
    assert due >= 30
    tasks = b.slot_tasks(back, row.last_slot)
    # the latest slot is on time (less than a second old): it always runs; the late
    # ones run by the policy, the most recent first chosen
    assert len(tasks) == runs
    assert slot_key("every", row.last_slot) in tasks
    assert row.last_task_id == tasks[slot_key("every", row.last_slot)]
    assert row.missed == due - runs and row.skipped == 0
    scraped = registry(b.app)
    assert scraped.get_sample_value(MISSED, {"entry": "every"}) == row.missed
    assert row.last_reason is not None and "missed" in row.last_reason
    latest_slots = [row.last_slot - timedelta(seconds=i) for i in range(runs)]
    assert set(tasks) == {slot_key("every", s) for s in latest_slots}
    for task_id in tasks.values():
        assert b.store.get(task_id) is not None


def test_two_schedulers_at_one_slot_write_it_once(beat: Callable[..., Beat]) -> None:
    b = beat()
    first, second = b.scheduler("a"), b.scheduler("b")
    back = b.go_back(1.5)

    b.decide(first)
    b.decide(second)  # finds the slots decided

    row = b.row()
    tasks = b.slot_tasks(back, row.last_slot)
    assert len(tasks) == _late_slots(b, back, row) - row.missed
    assert row.updated_by is not None
    again = b.row()
    b.decide(second)
    assert b.row().last_slot >= again.last_slot
    assert b.slot_tasks(back, again.last_slot) == tasks


def test_a_scheduler_closed_by_the_stop_signal_stops_the_beat_cleanly(
    beat: Callable[..., Beat],
) -> None:
    # Celery's SIGTERM handler closes the scheduler from inside whatever it was doing
    # (a slot's publish, say), then raises SystemExit, which an interrupted publish can
    # turn into another error on the way out: the next step of the scheduler raises
    # SystemExit, which Celery's beat loop takes as a clean stop (exit code 0), not an
    # error about its closed schedule file (exit code 1)
    b = beat()
    scheduler = b.scheduler()
    b.decide(scheduler)
    scheduler.close()
    with pytest.raises(SystemExit):
        scheduler.tick()


def test_overlap_skip_skips_a_slot_whose_previous_run_is_pending(
    beat: Callable[..., Beat],
) -> None:
    b = beat(lease_catchup="all", lease_overlap="skip")
    scheduler = b.scheduler()
    back = b.go_back(4)

    b.decide(scheduler)  # no worker: the first slot's run stays PENDING

    row = b.row()
    tasks = b.slot_tasks(back, row.last_slot)
    assert len(tasks) == 1
    (only,) = tasks.values()
    assert b.store.get(only).state is State.PENDING  # type: ignore[union-attr]
    assert row.skipped == _late_slots(b, back, row) - 1 and row.missed == 0
    assert row.last_reason is not None
    assert f"previous run {only} is PENDING (lease_overlap='skip')" in row.last_reason
    assert registry(b.app).get_sample_value(SKIPPED, {"entry": "every"}) == row.skipped


def test_overlap_buffer_one_keeps_one_slot_until_the_previous_run_finishes(
    beat: Callable[..., Beat],
) -> None:
    b = beat(lease_catchup="all", lease_overlap="buffer_one")
    scheduler = b.scheduler()
    back = b.go_back(4)

    b.decide(scheduler)

    row = b.row()
    first = row.last_task_id
    assert row.buffered_slot is not None and row.buffered_slot > row.last_run_slot
    assert row.skipped == _late_slots(b, back, row) - 2
    assert "buffer full" in (row.last_reason or "")
    assert len(b.slot_tasks(back, row.last_slot)) == 1

    admin(b.app).cancel(first, actor="test", reason="finish the previous run")
    b.decide(scheduler)  # the buffered slot goes now

    after = b.row()
    assert after.last_run_slot == row.buffered_slot and after.last_task_id != first
    # a slot due since then waits behind the one just sent (PENDING: no worker here)
    assert after.buffered_slot is None or after.buffered_slot > row.buffered_slot
    assert b.store.task_for_key(slot_key("every", row.buffered_slot)) == after.last_task_id


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"lease_catchup": "sometimes"}, "lease_catchup"),
        ({"lease_overlap": "never"}, "lease_overlap"),
        ({"lease_catchup_window": -5}, "lease_catchup_window"),
    ],
)
def test_a_bad_entry_stops_the_beat_at_start_and_nothing_is_written(
    beat: Callable[..., Beat], options: dict[str, Any], named: str
) -> None:
    b = beat(**options)
    with pytest.raises(ConfigurationError, match=rf"'every'.*{named}"):
        b.scheduler()
    assert b.store.schedules() == []
    assert b.store.beats(seen_within=3600) == []


def test_the_reaper_entry_is_sent_in_slots_and_listed(beat: Callable[..., Beat]) -> None:
    b = beat()
    b.scheduler()

    names = {r.name for r in b.store.schedules()}
    assert names == {"every", "celery-lease-reap"}
    (seen,) = b.store.beats(seen_within=3600)
    assert seen.pid > 0

    obj = CLIContext(app=b.app, no_color=True, workdir=None)
    out = CliRunner().invoke(lease_cli, ["schedules"], obj=obj, catch_exceptions=False)
    assert out.exit_code == 0, out.output
    assert "every" in out.output and "celery-lease-reap" in out.output
    assert seen.host in out.output


def test_a_schedule_that_cannot_compute_its_next_time_is_named(
    beat: Callable[..., Beat],
) -> None:
    b = beat()

    b.app.conf.beat_schedule = {"broken": {"task": "b.tick", "schedule": Broken()}}
    with pytest.raises(ConfigurationError, match=r"'broken'.*cannot compute its next time"):
        b.scheduler()
    assert b.store.schedules() == []
