"""Beat with slots, with real ``celery beat`` processes (crash-point matrix row 29).

Every beat runs ``celery_lease.beat:LeaseScheduler``; an entry of a leased task every
second is sent in slots whose dedup keys name the slot. The task counts itself in the
counting stub (one effect per run, its payload the task id), so "each slot ran once"
is read from what ran, not from what was sent.

The faults: beats SIGKILLed (at the crash point between a slot's rows and their
publish, or at random), every beat down, a beat's database unreachable (a TCP proxy
that black-holes its PostgreSQL traffic, as row 13), a beat's clock minutes off or
stepped while it runs (the LD_PRELOAD shim of row 19), and bad entries at start.
"""

from __future__ import annotations

import itertools
import json
import re
import signal
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from celery_lease import State
from celery_lease.beat import slot_key

from ..helpers import BeatProcess, WorkerProcess, wait_until
from .faults import proxy_to_postgres
from .support import TASKS, LeasedProject, LeaseEnv, Stopwatch, released, report
from .test_bad_days import DATABASE_URL_ENV
from .test_clock_skew import SKEW, clock_skew_shim  # noqa: F401  (the shim's fixture)

SOURCE = (
    TASKS
    + '''

import json
from datetime import timedelta

from celery.schedules import BaseSchedule, schedstate

OPTIONS = json.loads(os.environ.get("BEAT_OPTIONS", "{}"))


@app.task(base=LeasedTask, bind=True, shared=False, name="t.tick")
def tick(self):
    """One run of a slot: counted by the stub, with this task's id."""
    external.call("tick", payload=self.request.id)
    return self.request.id


@app.task(base=LeasedTask, bind=True, shared=False, name="t.held_tick")
def held_tick(self, gate):
    """A run that waits at ``gate`` while the test holds it."""
    external.call("held", payload=self.request.id)
    hold(gate)
    return self.request.id


class Broken(BaseSchedule):
    """A schedule that cannot compute its next time."""

    def remaining_estimate(self, last_run_at):
        raise ValueError("no next time")

    def is_due(self, last_run_at):
        return schedstate(False, 60.0)


ENTRIES = {
    "every": {"task": "t.tick", "schedule": timedelta(seconds=1), "options": OPTIONS},
    "broken": {"task": "t.tick", "schedule": Broken()},
    "held": {
        "task": "t.held_tick",
        "schedule": timedelta(seconds=1),
        "args": ("slow",),
        "options": {"lease_overlap": "skip"},
    },
}
app.conf.beat_schedule = {name: ENTRIES[name] for name in os.environ["BEAT_ENTRIES"].split(",")}
'''
)

SETTINGS = {"beat_scheduler": "celery_lease.beat:LeaseScheduler"}
EVERY = {"BEAT_ENTRIES": "every"}


def slot_rows(p: LeasedProject, entry: str = "every", task: str = "t.tick") -> dict[datetime, str]:
    """Slot time -> task id of every slot of the entry written so far."""
    out: dict[datetime, str] = {}
    for record in p.store.list_tasks(name=task, limit=100_000):
        prefix = f"beat:{entry}@"
        assert record.dedup_key is not None and record.dedup_key.startswith(prefix)
        slot = datetime.fromisoformat(record.dedup_key.removeprefix(prefix))
        assert slot_key(entry, slot) == record.dedup_key
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
    p = lease_env.project(broker_url=broker_url, source=SOURCE, settings=SETTINGS, env=EVERY)
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
    p = lease_env.project(broker_url=broker_url, source=SOURCE, settings=SETTINGS, env=EVERY)
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


#: Seconds with no beat running (slots every second).
DOWN = 6.0


def test_after_every_beat_was_down_the_missed_slots_are_skipped_and_counted(
    lease_env: LeaseEnv,
) -> None:
    p = lease_env.project(
        source=SOURCE,
        settings=SETTINGS,
        env={**EVERY, "BEAT_OPTIONS": json.dumps({"lease_catchup": "skip"})},
    )
    p.worker("a")
    first = p.project.beat("first")
    wait_until(lambda: len(slot_rows(p)) >= 2, timeout=60, message="2 slots written")
    first.kill_group(signal.SIGKILL)  # every beat down
    first.wait_group_gone()
    down_since = max(slot_rows(p))
    wait_until(
        lambda: (p.store.now() - down_since).total_seconds() > DOWN,
        timeout=60,
        message=f"{DOWN:g} s of slots with no beat",
    )

    second = p.project.beat("second")
    wait_until(lambda: max(slot_rows(p)) > down_since + timedelta(seconds=DOWN + 1), timeout=60)
    second.stop()

    slots = check_each_slot_ran_once(p, lease_env)
    (row,) = [r for r in p.store.schedules() if r.name == "every"]
    times = sorted(slots)
    gaps = [(a, b) for a, b in itertools.pairwise(times) if (b - a).total_seconds() > 1]
    # one gap, the downtime: none of its slots ran ("skip"), each counted as missed
    assert len(gaps) == 1 and gaps[0][0] == down_since
    assert row.missed == round((gaps[0][1] - gaps[0][0]).total_seconds()) - 1 >= DOWN - 1
    assert row.last_reason is not None and "lease_catchup='skip'" in row.last_reason


def test_overlap_skip_skips_the_slots_while_the_previous_run_is_running(
    lease_env: LeaseEnv,
) -> None:
    p = lease_env.project(source=SOURCE, settings=SETTINGS, env={"BEAT_ENTRIES": "held"})
    p.worker("a", concurrency=2)
    gate = p.gates.hold("slow")
    with released(p.gates, gate):
        beat = p.project.beat()
        first = wait_until(lambda: slot_rows(p, "held", "t.held_tick") or None, timeout=60)
        (running,) = first.values()
        p.wait_state(running, State.RUNNING)

        def skipped() -> int:
            rows = [r for r in p.store.schedules() if r.name == "held"]
            return rows[0].skipped if rows else 0

        wait_until(lambda: skipped() >= 3, timeout=60, message="3 slots skipped")
        assert list(slot_rows(p, "held", "t.held_tick").values()) == [running]
    p.wait_state(running, State.SUCCEEDED, timeout=60)
    wait_until(lambda: len(slot_rows(p, "held", "t.held_tick")) >= 3, timeout=60)
    beat.stop()

    slots = slot_rows(p, "held", "t.held_tick")
    for task_id in slots.values():
        p.wait_state(task_id, State.SUCCEEDED, timeout=60)
    assert sorted(e.payload for e in lease_env.external.effects("held")) == sorted(slots.values())
    (row,) = [r for r in p.store.schedules() if r.name == "held"]
    times = sorted(slots)
    absent = round((times[-1] - times[0]).total_seconds()) + 1 - len(times)
    assert row.skipped >= 3 and absent == row.skipped and row.missed == 0
    assert row.last_reason is not None and f"previous run {running} is RUNNING" in row.last_reason


def test_two_beats_killed_and_restarted_in_turn_miss_no_slot_and_run_each_once(
    lease_env: LeaseEnv,
) -> None:
    p = lease_env.project(source=SOURCE, settings=SETTINGS, env=EVERY)
    p.worker("a", concurrency=2)
    beats = [p.project.beat("beat1"), p.project.beat("beat2")]
    for beat in beats:
        beat.wait_ready(timeout=60)
    for turn in range(6):  # one beat SIGKILLed and started again; the other stays up
        beat = beats[turn % 2]
        written = len(slot_rows(p))
        beat.kill_group(signal.SIGKILL)
        beat.wait_group_gone()
        wait_until(lambda n=written: len(slot_rows(p)) >= n + 2, timeout=60)
        beat.start()
        beat.wait_ready(timeout=60)
    for beat in beats:
        beat.stop()

    slots = check_each_slot_ran_once(p, lease_env)
    (row,) = [r for r in p.store.schedules() if r.name == "every"]
    assert len(slots) >= 12 and row.missed == 0 and row.skipped == 0  # always a beat up


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [pytest.param("amqp", "postgresql", id="amqp-postgresql", marks=pytest.mark.postgres)],
    indirect=True,
)
def test_a_beat_whose_clock_is_minutes_off_sends_each_slot_once_at_its_time(
    lease_env: LeaseEnv, broker_url: str, request: pytest.FixtureRequest
) -> None:
    # PostgreSQL only: on SQLite the database's time is the clock of the process
    # running the statement (see test_clock_skew.py)
    p = lease_env.project(broker_url=broker_url, source=SOURCE, settings=SETTINGS, env=EVERY)
    p.worker("a")
    shim = str(request.getfixturevalue("clock_skew_shim"))
    skewed = p.project.beat("skewed", env={"LD_PRELOAD": shim, "CLOCK_SKEW_SECONDS": str(SKEW)})
    wait_until(lambda: len(slot_rows(p)) >= 5, timeout=90, message="5 slots written")
    skewed.stop()

    slots = check_each_slot_ran_once(p, lease_env)
    (row,) = [r for r in p.store.schedules() if r.name == "every"]
    assert row.missed == 0 and row.skipped == 0
    for slot, task_id in slots.items():
        created = p.get(task_id).created_at
        # sent at its slot by the database's clock, not SKEW seconds away from it
        assert abs((created - slot).total_seconds()) < SKEW / 5


# -- the database unreachable at a slot --------------------------------------------------

#: How long the beat's database black-holes (database seconds): a dozen slots, more
#: than the beat's "on time" (``celery_lease.beat.ON_TIME``).
OUTAGE = 12.0
#: The bound of the beat's store calls while the database black-holes.
DB_TIMEOUT = 2.0


def gaps_in(times: list[datetime]) -> list[tuple[datetime, datetime]]:
    """The pairs of consecutive slots run more than a second apart."""
    return [(a, b) for a, b in itertools.pairwise(times) if (b - a).total_seconds() > 1]


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [pytest.param("redis", "postgresql", id="redis-postgresql", marks=pytest.mark.postgres)],
    indirect=True,
)
@pytest.mark.parametrize("catchup", ["latest", "all"])
def test_database_unreachable_at_slots_they_run_once_when_it_is_back_by_the_policy(
    lease_env: LeaseEnv, broker_url: str, catchup: str
) -> None:
    options = {"lease_catchup": "all", "lease_catchup_max": 100} if catchup == "all" else {}
    p = lease_env.project(
        broker_url=broker_url,
        source=SOURCE,
        settings={**SETTINGS, "lease_db_timeout": DB_TIMEOUT},
        env={**EVERY, "BEAT_OPTIONS": json.dumps(options)},
    )
    p.worker("a", concurrency=2)  # straight to the database: it runs what is sent
    with proxy_to_postgres() as proxy:
        beat = p.project.beat(
            "cut-off", env={DATABASE_URL_ENV: proxy.url(p.store.config.database_url)}
        )
        wait_until(lambda: len(slot_rows(p)) >= 3, timeout=90, message="3 slots written")

        proxy.blackhole()
        cut_at = p.store.now()  # a decision begun after this has no answer
        clock = Stopwatch()
        p.wait_log(beat, r"beat entry 'every': its slots could not be decided", timeout=60)
        wait_until(
            lambda: (p.store.now() - cut_at).total_seconds() > OUTAGE,
            timeout=60,
            message=f"{OUTAGE:g} s of slots with the beat's database unreachable",
        )
        # nothing decided while the database was unreachable (a decision in flight at
        # the cut decided slots up to its own time, before it)
        assert max(slot_rows(p)) <= cut_at
        before_resume = p.store.now()
        proxy.resume()
        wait_until(
            lambda: max(slot_rows(p)) > before_resume + timedelta(seconds=3),
            timeout=60,
            message="slots written after the database came back",
        )
        report(f"row 29: database black-holed {OUTAGE:g} s -> slots again", clock.lap())
        beat.stop()

    slots = check_each_slot_ran_once(p, lease_env)
    (row,) = [r for r in p.store.schedules() if r.name == "every"]
    assert row.skipped == 0
    # every slot of the outage that ran was written once the database was back
    outage = {s: t for s, t in slots.items() if s > cut_at}
    for task_id in outage.values():
        assert p.get(task_id).created_at >= before_resume
    times = sorted(slots)
    gaps = gaps_in(times)
    if catchup == "all":
        # each slot of the outage ran, once, when the database came back: none missed
        assert gaps == [] and row.missed == 0, (gaps, row)
        assert len([s for s in outage if s <= before_resume]) >= OUTAGE - 1
    else:
        # "latest": of the slots of the outage, the most recent missed one ran with the
        # slot on time; the others are counted as missed, with the policy in the reason
        assert row.last_reason is not None and "lease_catchup='latest'" in row.last_reason
        found = re.search(r"slot\(s\) up to (\S+) missed", row.last_reason)
        assert found is not None, row.last_reason
        on_time = datetime.fromisoformat(found.group(1))
        ((last_before, caught_up),) = gaps
        assert last_before <= cut_at and caught_up == on_time - timedelta(seconds=1)
        assert on_time in slots and on_time > before_resume - timedelta(seconds=1)
        assert row.missed == round((caught_up - last_before).total_seconds()) - 1
        assert row.missed >= OUTAGE - 3


# -- a clock step on the beat's host ---------------------------------------------------

#: The clock steps of the test: back two minutes, then four forward (two ahead).
STEPS = (-120, 120)
#: A line the beat logs several times a second (the reaper's entry, every 0.2 s).
SENT_LINE = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+: INFO/MainProcess\] Scheduler: Sending due",
    re.MULTILINE,
)


def set_clock(path: Path, offset: int) -> None:
    """Set the shimmed process's clock ``offset`` seconds off (read within 0.1 s)."""
    spare = path.with_suffix(".new")
    spare.write_text(f"{offset}\n")
    spare.replace(path)  # whole: the shim never reads half a number


def beat_clock_offset(beat: BeatProcess, p: LeasedProject) -> float | None:
    """How far the beat's clock is from the database's, by the latest line it logged
    (its log's timestamps are its own clock's, to the second)."""
    stamps = SENT_LINE.findall(beat.log_text())
    if not stamps:
        return None
    local = datetime.strptime(stamps[-1], "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc)
    return (local - p.store.now()).total_seconds()


def reaps_run(worker: WorkerProcess) -> int:
    """How many ``celery_lease.reap`` tasks (sent only by beat) the worker ran."""
    return len(re.findall(r"Task celery_lease\.reap\[[^]]+\] succeeded", worker.log_text()))


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [pytest.param("redis", "postgresql", id="redis-postgresql", marks=pytest.mark.postgres)],
    indirect=True,
)
def test_a_beat_whose_clock_steps_back_and_forward_sends_each_slot_once_and_none_early(
    lease_env: LeaseEnv, broker_url: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    # PostgreSQL only, as the 300 s test above
    shim = str(request.getfixturevalue("clock_skew_shim"))
    p = lease_env.project(broker_url=broker_url, source=SOURCE, settings=SETTINGS, env=EVERY)
    worker = p.worker("a")
    clock_file = tmp_path / "beat-clock"
    set_clock(clock_file, 0)
    beat = p.project.beat("stepped", env={"LD_PRELOAD": shim, "CLOCK_SKEW_FILE": str(clock_file)})
    wait_until(lambda: len(slot_rows(p)) >= 3, timeout=90, message="3 slots written")
    for step in STEPS:
        reaps = reaps_run(worker)
        set_clock(clock_file, step)
        written = len(slot_rows(p))
        # a beat timed by its wall clock sleeps through the slots a step back jumps over
        # (Celery's heap holds wall-clock times): here they keep coming, one a second
        wait_until(
            lambda n=written: len(slot_rows(p)) >= n + 5,
            timeout=60,
            message=f"5 slots written after the beat's clock stepped to {step:+d} s",
        )
        offset = beat_clock_offset(beat, p)
        assert offset is not None and abs(offset - step) < 30, (step, offset)
        # the reaper's entry (every 0.2 s) still runs: its expiry is counted from the
        # database's time, not from the beat's clock (2 minutes behind, Celery's own
        # count sends messages that have expired when they arrive)
        wait_until(
            lambda n=reaps: reaps_run(worker) >= n + 20,
            timeout=60,
            message=f"20 runs of celery_lease.reap sent by the beat at {step:+d} s",
        )
    beat.stop()

    slots = check_each_slot_ran_once(p, lease_env)
    (row,) = [r for r in p.store.schedules() if r.name == "every"]
    assert row.missed == 0 and row.skipped == 0  # no gap: each slot ran, once
    for slot, task_id in slots.items():
        # decided by the database's clock: never written before its slot
        assert p.get(task_id).created_at >= slot


# -- bad entries at start --------------------------------------------------------------


@pytest.mark.parametrize(
    ("entries", "options", "named"),
    [
        pytest.param("every", {"lease_catchup": "sometimes"}, "lease_catchup", id="policy"),
        pytest.param("every", {"lease_catchup_window": -5}, "lease_catchup_window", id="window"),
        pytest.param(
            "every", {"lease_catchupp": "all"}, "unknown option 'lease_catchupp'", id="typo"
        ),
        pytest.param("every,broken", {}, "cannot compute its next time", id="schedule"),
    ],
)
def test_a_beat_with_a_bad_entry_exits_at_start_naming_it_and_writes_nothing(
    lease_env: LeaseEnv, entries: str, options: dict[str, object], named: str
) -> None:
    p = lease_env.project(
        source=SOURCE,
        settings=SETTINGS,
        env={"BEAT_ENTRIES": entries, "BEAT_OPTIONS": json.dumps(options)},
    )
    beat = p.project.beat("bad")
    wait_until(lambda: beat.returncode is not None, timeout=60, message="the beat exited")
    assert beat.returncode != 0
    entry = "broken" if "broken" in entries else "every"
    assert re.search(
        rf"ConfigurationError.*beat entry '{entry}'.*{re.escape(named)}", beat.log_text()
    )
    assert p.store.schedules() == [] and p.store.beats(seen_within=3600) == []
    assert p.store.list_tasks(limit=10) == []
