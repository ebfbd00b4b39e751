"""Global rate limits in the store, on SQLite and PostgreSQL: a claim starts the task when
its key is idle (the last start's interval has ended) or when the start reserved for it
has come and no other start took its interval; any other claim is given the next free
start (the row's ETA, ``paced``), in the order the claims came, and the key's next free
start moves on past it; a paced row's claim at its ETA takes no other start. A late
row fills an idle interval and is paced again right after a start. Keys are paced
apart. A start far ahead is held in the store.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import pytest
from sqlalchemy import select, update

from celery_lease import ConfigurationError
from celery_lease.producer.slots import parse_rate
from celery_lease.states import State
from celery_lease.store import Claim, NewTask, Refusal, Slot, Store
from celery_lease.store.schema import after, db_now

from .test_concurrency_store import register

S = State
NAME = "tests.paced"


def submit(store: Store, n: int) -> list[str]:
    ids = []
    for _ in range(n):
        task_id, created = store.submit(
            NewTask(
                id=uuid.uuid4().hex,
                name=NAME,
                args="[]",
                kwargs="{}",
                options="{}",
                lease_ttl=30.0,
                max_recoveries=5,
            )
        )
        assert created
        ids.append(task_id)
    store.mark_published(ids)
    return ids


def row(store: Store, task_id: str) -> Any:
    t = store.t.tasks
    with store.engine.connect() as conn:
        return conn.execute(
            select(t.c.state, t.c.slot, t.c.slot_key, t.c.eta, t.c.held, t.c.reason).where(
                t.c.id == task_id
            )
        ).one()


def next_start(store: Store, key: str = "") -> datetime | None:
    c = store.t.concurrency
    with store.engine.connect() as conn:
        found: datetime | None = conn.execute(
            select(c.c.next_start_at).where(c.c.name == NAME, c.c.key == key)
        ).scalar_one()
        return found


def make_due(store: Store, task_id: str) -> None:
    """The row's ETA (its reserved start) has come, without waiting for it: every time
    of the task's keys (the rows' ETAs, the keys' next and last starts) moves back by
    as much, as if that time had passed."""
    t, c = store.t.tasks, store.t.concurrency
    with store.engine.begin() as conn:
        eta, now = conn.execute(select(t.c.eta, db_now()).where(t.c.id == task_id)).one()
        ago = -((eta - now).total_seconds() + 0.001)
        conn.execute(
            update(t).where(t.c.name == NAME, t.c.eta.is_not(None)).values(eta=after(t.c.eta, ago))
        )
        conn.execute(
            update(c)
            .where(c.c.name == NAME)
            .values(
                next_start_at=after(c.c.next_start_at, ago),
                last_start_at=after(c.c.last_start_at, ago),
            )
        )


def seconds(a: datetime, b: datetime) -> float:
    return (b - a).total_seconds()


def test_claims_before_the_next_start_are_given_the_following_starts_in_order(store):
    owner = register(store)
    slot = Slot(NAME, "", 0, interval=2.0)
    a, b, c, d = submit(store, 4)
    first = store.claim(a, owner, "w", slot=slot)
    assert isinstance(first, Claim)
    after_first = next_start(store)
    assert after_first is not None
    assert 1.9 <= seconds(store.now(), after_first) <= 2.0

    paced = [store.claim(task_id, owner, "w", slot=slot) for task_id in (b, c)]
    for refusal in paced:
        assert isinstance(refusal, Refusal) and refusal.paced and not refusal.held
        assert refusal.state is S.PENDING and not refusal.waiting
    rb, rc = row(store, b), row(store, c)
    assert (rb.state, rb.slot, rb.slot_key) == ("PENDING", "paced", "")
    # b has the start the first claim left next, c the one after it: one interval apart
    assert abs(seconds(after_first, rb.eta)) < 0.002
    assert abs(seconds(rb.eta, rc.eta) - 2.0) < 0.002
    assert rb.reason.startswith(f"paced by the global rate limit of {NAME} (one start every 2 s)")
    assert abs(seconds(rc.eta, next_start(store)) - 2.0) < 0.002  # d's would come next

    # a paced row's delivery before its start: refused as early (published again)
    early = store.claim(b, owner, "w", slot=slot)
    assert isinstance(early, Refusal) and early.early
    # at its start it runs, and takes no other start: c's stays reserved for c
    make_due(store, b)
    reserved_next = next_start(store)
    second = store.claim(b, owner, "w", slot=slot)
    assert isinstance(second, Claim) and second.lease.attempt == 1
    assert next_start(store) == reserved_next
    running = row(store, b)
    # a rate limit alone holds no slot: its run counts under no key, its end frees none
    assert (running.state, running.slot, running.slot_key) == ("RUNNING", None, None)
    # a fresh delivery is still paced, after every start given out
    late = store.claim(d, owner, "w", slot=slot)
    assert isinstance(late, Refusal) and late.paced
    assert abs(seconds(row(store, c).eta, row(store, d).eta) - 2.0) < 0.002

    make_due(store, c)
    assert isinstance(store.claim(c, owner, "w", slot=slot), Claim)
    # a duplicate delivery of a running row is a duplicate, not paced
    dup = store.claim(c, owner, "w", slot=slot)
    assert isinstance(dup, Refusal) and not dup.paced and dup.state is S.RUNNING


def test_keys_are_paced_apart_and_a_start_that_came_is_taken_at_once(store):
    owner = register(store)
    a, b, c = submit(store, 3)
    assert isinstance(store.claim(a, owner, "w", slot=Slot(NAME, "t=1", 0, 60.0)), Claim)
    # another key's first start is its own
    assert isinstance(store.claim(b, owner, "w", slot=Slot(NAME, "t=2", 0, 60.0)), Claim)
    # a key whose next start has come starts at once, and moves it on from now
    c_slot = Slot(NAME, "t=3", 0, 0.001)
    assert isinstance(store.claim(c, owner, "w", slot=c_slot), Claim)
    assert store.slot_usage() == []  # rate keys hold no slots


def held_paced(make_store: Any, hold: float) -> tuple[Store, str, Slot, str]:
    """A store holding ETAs further than ``hold`` seconds, a rate of one start every 5 s
    whose first start is taken: (store, owner, slot, the second row, paced and held)."""
    store = make_store(hold_eta_after=hold)
    owner = register(store)
    slot = Slot(NAME, "", 0, interval=5.0)
    a, b = submit(store, 2)
    assert isinstance(store.claim(a, owner, "w", slot=slot), Claim)
    refusal = store.claim(b, owner, "w", slot=slot)
    assert isinstance(refusal, Refusal) and refusal.paced and refusal.held
    return store, owner, slot, b


@pytest.mark.parametrize("hold", [1.0])
def test_a_start_further_than_lease_hold_eta_after_is_held_in_the_store(make_store, hold):
    store, owner, slot, b = held_paced(make_store, hold)
    assert row(store, b).held
    assert store.take_held() == []  # not due within a reaper interval
    make_due(store, b)
    assert [p.id for p in store.take_held()] == [b]
    assert isinstance(store.claim(b, owner, "w", slot=slot), Claim)


def test_a_rate_and_a_concurrency_limit_both_hold(store):
    owner = register(store)
    slot = Slot(NAME, "", 1, interval=0.001)
    a, b = submit(store, 2)
    first = store.claim(a, owner, "w", slot=slot)
    assert isinstance(first, Claim)
    # the start has come (a millisecond), the one slot has not: b waits for the slot
    set_key(store, next_start=1.0, last_start=1.0)
    waiting = store.claim(b, owner, "w", slot=slot)
    assert isinstance(waiting, Refusal) and waiting.waiting and not waiting.paced
    assert store.finish(first.lease, S.SUCCEEDED, actor="task", reason="done")
    assert [p.id for p in store.grant([(NAME, "")])] == [b]
    assert isinstance(store.claim(b, owner, "w", slot=slot), Claim)


@pytest.mark.parametrize(
    ("rate", "interval"),
    [("100/s", 0.01), ("10/m", 6.0), ("1000/h", 3.6), ("4", 0.25), (5, 0.2), ("0.5/s", 2.0)],
)
def test_a_rate_gives_the_seconds_between_two_starts(rate: Any, interval: float) -> None:
    assert parse_rate("task t", rate) == pytest.approx(interval)


@pytest.mark.parametrize("rate", ["0/s", "-1/m", "1/d", "x/s", "inf/s", "", None, True, [1]])
def test_a_bad_rate_is_a_configuration_error_naming_the_task(rate: Any) -> None:
    with pytest.raises(ConfigurationError, match="task t: global_rate_limit"):
        parse_rate("task t", rate)


def set_eta(store: Store, task_id: str, seconds_ago: float) -> None:
    t = store.t.tasks
    with store.engine.begin() as conn:
        conn.execute(update(t).where(t.c.id == task_id).values(eta=after(db_now(), -seconds_ago)))


def set_key(store: Store, **seconds_ago: float) -> None:
    """Move the key's ``next_start_at`` / ``last_start_at`` to so many seconds ago."""
    c = store.t.concurrency
    values = {f"{k}_at": after(db_now(), -v) for k, v in seconds_ago.items()}
    with store.engine.begin() as conn:
        conn.execute(update(c).where(c.c.name == NAME).values(**values))


def last_start(store: Store) -> datetime | None:
    c = store.t.concurrency
    with store.engine.connect() as conn:
        found: datetime | None = conn.execute(
            select(c.c.last_start_at).where(c.c.name == NAME)
        ).scalar_one()
        return found


def test_a_late_row_fills_an_idle_interval_and_is_paced_again_right_after_a_start(store):
    # deliveries that ran late (a backlog, a stopped worker) take their start when the
    # key has been idle for an interval; right after a start they are given a new one:
    # late starts taken together would be a burst the rate forbids
    owner = register(store)
    slot = Slot(NAME, "", 0, interval=2.0)
    a, b, c, d = submit(store, 4)
    assert isinstance(store.claim(a, owner, "w", slot=slot), Claim)
    started = last_start(store)
    assert started is not None and abs(seconds(started, store.now())) < 0.5
    for task_id in (b, c, d):
        assert isinstance(store.claim(task_id, owner, "w", slot=slot), Refusal)
    line_end = next_start(store)  # d's start + an interval: the end of the line

    # b's start passed long ago, and a started just now: b is paced again, at the end
    set_eta(store, b, 30.0)
    again = store.claim(b, owner, "w", slot=slot)
    assert isinstance(again, Refusal) and again.paced
    assert abs(seconds(line_end, row(store, b).eta)) < 0.002
    assert abs(seconds(row(store, b).eta, next_start(store)) - 2.0) < 0.002

    # the key idle for more than an interval: c, long late, starts at once, and the
    # starts given out after it keep their times (it filled an idle interval); the
    # start it records is the end of the last one's interval (the beat goes on)
    set_key(store, last_start=2.5)
    set_eta(store, c, 30.0)
    line_end = next_start(store)
    late = store.claim(c, owner, "w", slot=slot)
    assert isinstance(late, Claim) and late.lease.attempt == 1
    assert next_start(store) == line_end
    recorded = last_start(store)
    assert recorded is not None and abs(seconds(recorded, store.now()) - 0.5) < 0.1

    # d, late too, right after c's start: paced again
    set_eta(store, d, 30.0)
    assert isinstance(store.claim(d, owner, "w", slot=slot), Refusal)
    assert row(store, d).slot == "paced" and abs(seconds(line_end, row(store, d).eta)) < 0.002

    # a fresh delivery in an idle key starts too, ahead of the starts given out
    # (late or not, its delivery is here: the interval is not left empty)
    set_key(store, last_start=2.5)
    line_end = next_start(store)
    (e,) = submit(store, 1)
    assert isinstance(store.claim(e, owner, "w", slot=slot), Claim)
    assert next_start(store) == line_end

    # with no start ahead of it either (the key idle for long), a late row starts; it
    # records the start an interval ago (the most a start may count back), so one
    # more may start at once, and the next is paced an interval on: never more than
    # k + 1 starts in k intervals
    set_key(store, next_start=10.0, last_start=10.0)
    set_eta(store, d, 5.0)
    assert isinstance(store.claim(d, owner, "w", slot=slot), Claim)
    recorded = last_start(store)
    assert recorded is not None and abs(seconds(recorded, store.now()) - 2.0) < 0.1
    f, g = submit(store, 2)
    assert isinstance(store.claim(f, owner, "w", slot=slot), Claim)
    fresh = store.claim(g, owner, "w", slot=slot)
    assert isinstance(fresh, Refusal) and fresh.paced
    ahead = next_start(store)
    assert ahead is not None and 3.9 <= seconds(store.now(), ahead) <= 4.0  # g's, then


def test_an_on_time_start_whose_interval_a_late_row_filled_is_paced_again(store):
    # a late row started in the interval before b's reserved start: b's delivery, on
    # time, would make two starts within an interval, so b is given a new start
    owner = register(store)
    slot = Slot(NAME, "", 0, interval=2.0)
    a, b, c = submit(store, 3)
    assert isinstance(store.claim(a, owner, "w", slot=slot), Claim)
    for task_id in (b, c):
        assert isinstance(store.claim(task_id, owner, "w", slot=slot), Refusal)
    set_key(store, last_start=3.0)  # the key idle
    set_eta(store, c, 30.0)
    assert isinstance(store.claim(c, owner, "w", slot=slot), Claim)  # c fills it late
    # c's start 1.5 s ago (its interval not over), and b's reserved start came 1.0 s
    # ago, after c's: b is on time, but its interval had c's start: given a new one
    set_key(store, last_start=1.5)
    set_eta(store, b, 1.0)
    line_end = next_start(store)
    refused = store.claim(b, owner, "w", slot=slot)
    assert isinstance(refused, Refusal) and refused.paced
    assert abs(seconds(line_end, row(store, b).eta)) < 0.002
    # on time with the last start an interval before its own: it runs, and the start
    # it records is its reserved one, not the moment its delivery came
    set_key(store, last_start=4.0)
    set_eta(store, b, 1.7)
    assert isinstance(store.claim(b, owner, "w", slot=slot), Claim)
    recorded = last_start(store)
    assert recorded is not None and abs(seconds(recorded, store.now()) - 1.7) < 0.1


def test_a_row_an_operator_retries_is_not_left_held_by_an_earlier_pacing(make_store):
    # what the model test found: a paced row held in the store (its start far ahead)
    # whose message came at its start anyway (a second copy, before the held sweep ran)
    # ran with its held mark; failed, then retried by an operator (PENDING, no ETA), it
    # stayed held, and if the operator's process died before publishing it, neither the
    # held sweep (it takes held rows by their ETA) nor the grace sweep (it leaves held
    # rows to the held sweep) would ever publish it
    store, owner, slot, b = held_paced(make_store, 1.0)
    make_due(store, b)
    run = store.claim(b, owner, "w", slot=slot)
    assert isinstance(run, Claim)
    assert store.finish(run.lease, S.FAILED, actor="task", reason="failed")
    assert store.operator_move(b, S.PENDING, actor="op", reason="retried") is S.FAILED
    # the operator's process died before it published the row: after the grace, the
    # reaper publishes it
    t = store.t.tasks
    with store.engine.begin() as conn:
        conn.execute(update(t).where(t.c.id == b).values(updated_at=after(db_now(), -60.0)))
    assert [p.id for p in store.take_unpublished()] == [b]
