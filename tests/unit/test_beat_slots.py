"""Beat slots: the same scheduled times on every beat, and which due slots run."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from celery import Celery
from celery.schedules import crontab, schedule

from celery_lease.beat import SlotPolicy, Slots, plan, slot_key
from celery_lease.config import LeaseConfig
from celery_lease.exceptions import ConfigurationError

T0 = datetime(2026, 12, 2, 10, 0, 0, tzinfo=timezone.utc)


def policy(catchup: str = "latest", window: float = 3600.0, most: int = 10) -> SlotPolicy:
    return SlotPolicy(catchup, window, most, "allow")


def test_interval_slots_are_multiples_of_the_interval_since_the_epoch() -> None:
    slots = Slots("e", schedule(timedelta(seconds=7)))
    first = slots.after(T0)
    assert int(first.timestamp()) % 7 == 0 and first > T0
    assert slots.after(first) == first + timedelta(seconds=7)
    # whatever the time asked from, the same slots (no process start time in them)
    assert slots.after(first - timedelta(seconds=3)) == first


def test_interval_slots_between_counts_them_all_and_keeps_the_latest() -> None:
    slots = Slots("e", schedule(timedelta(seconds=1)))
    found, count = slots.between(T0, T0 + timedelta(seconds=100), keep=3)
    assert count == 100
    assert found == [T0 + timedelta(seconds=s) for s in (98, 99, 100)]


def test_crontab_slots_are_its_scheduled_times_in_its_timezone() -> None:
    app = Celery(set_as_current=False)
    app.conf.timezone = "Europe/Paris"
    sched = crontab(minute=0, hour=3, app=app)
    slots = Slots("e", sched)
    assert slots.after(T0) == datetime(2026, 12, 3, 2, 0, tzinfo=timezone.utc)
    found, count = slots.between(T0, T0 + timedelta(days=3), keep=5)
    assert count == 3 and found[0] == datetime(2026, 12, 3, 2, 0, tzinfo=timezone.utc)


def test_the_latest_on_time_slot_runs_and_late_ones_follow_the_policy() -> None:
    due = [T0 + timedelta(minutes=m) for m in range(5)]
    now = due[-1] + timedelta(seconds=1)  # the latest is on time
    assert plan(due, 5, now, policy("skip")).run == [due[-1]]
    assert plan(due, 5, now, policy("skip")).missed == 4
    assert plan(due, 5, now, policy("latest")).run == [due[-2], due[-1]]
    assert plan(due, 5, now, policy("latest")).missed == 3
    assert plan(due, 5, now, policy("all", most=2)).run == [due[-3], due[-2], due[-1]]
    assert plan(due, 5, now, policy("all", most=2)).missed == 2


def test_after_a_downtime_every_due_slot_is_late_and_the_window_bounds_catch_up() -> None:
    due = [T0 + timedelta(minutes=m) for m in range(3)]
    now = due[-1] + timedelta(minutes=30)
    assert plan(due, 3, now, policy("skip")).run == []
    assert plan(due, 3, now, policy("latest")).run == [due[-1]]
    assert plan(due, 3, now, policy("all")).run == due
    outside = plan(due, 3, now, policy("all", window=60))
    assert outside.run == [] and outside.missed == 3 and outside.last == due[-1]


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"lease_catchup": "sometimes"}, "lease_catchup"),
        ({"lease_overlap": "queue"}, "lease_overlap"),
        ({"lease_catchup_window": -1}, "lease_catchup_window"),
        ({"lease_catchup_max": 0}, "lease_catchup_max"),
    ],
)
def test_bad_policies_name_the_entry(options: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigurationError, match=f"'nightly'.*{named}|{named}.*'nightly'"):
        SlotPolicy.of("nightly", options, LeaseConfig(database_url="sqlite://"))


def test_an_entry_without_options_takes_the_settings() -> None:
    config = LeaseConfig(database_url="sqlite://", catchup="all", overlap="skip")
    got = SlotPolicy.of("e", None, config)
    assert (got.catchup, got.overlap, got.max) == ("all", "skip", 10)


def test_a_zero_interval_cannot_compute_its_next_time() -> None:
    with pytest.raises(ConfigurationError, match="'e'"):
        Slots("e", schedule(timedelta(0)))


def test_slot_keys_are_the_same_for_the_same_slot_and_bounded() -> None:
    assert slot_key("e", T0) == slot_key("e", T0.astimezone(timezone(timedelta(hours=2))))
    assert slot_key("e", T0) != slot_key("e", T0 + timedelta(seconds=1))
    assert len(slot_key("x" * 1000, T0)) <= 255


def test_leased_takes_a_scheduler_class_only_and_leases_it_once() -> None:
    from celery.beat import PersistentScheduler, Scheduler

    from celery_lease.beat import LeaseScheduler, leased

    made = leased(Scheduler)
    assert issubclass(made, Scheduler) and leased(made) is made
    assert leased(LeaseScheduler) is LeaseScheduler
    assert issubclass(LeaseScheduler, PersistentScheduler)
    with pytest.raises(ConfigurationError, match=r"celery\.beat\.Scheduler subclass"):
        leased(dict)  # type: ignore[type-var]


def test_per_entry_options_are_read_from_the_options_then_from_the_headers() -> None:
    from celery_lease.beat import lease_options

    options = {
        "queue": "q",
        "lease_catchup": "all",
        "headers": {"lease_catchup": "skip", "lease_overlap": "skip", "team": "ops"},
    }
    assert lease_options("e", options) == {"lease_catchup": "all", "lease_overlap": "skip"}
    assert lease_options("e", None) == {} and lease_options("e", {"headers": None}) == {}
    got = SlotPolicy.of("e", options, LeaseConfig(database_url="sqlite://"))
    assert (got.catchup, got.overlap) == ("all", "skip")


@pytest.mark.parametrize("where", ["options", "headers"])
def test_an_unknown_lease_option_names_the_entry(where: str) -> None:
    options: dict[str, object] = {"lease_catchupp": "all"}
    if where == "headers":
        options = {"headers": options}
    with pytest.raises(ConfigurationError, match=rf"'nightly'.*'lease_catchupp' in its {where}"):
        SlotPolicy.of("nightly", options, LeaseConfig(database_url="sqlite://"))
