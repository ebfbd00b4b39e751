"""Concurrency limits in the store, on SQLite and PostgreSQL: a slot is taken in the
claim's transaction under its key's lock and freed by the state change that ends the
run (the fenced outcome, a retry, the reaper's expiry), once; a claim that finds no slot
leaves its row PENDING and waiting, never re-published as lost; a free grants the
oldest waiting row; a late outcome of a lost lease frees nothing; concurrent claims
never take more slots than the limit.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
import pytest
from celery import Celery
from sqlalchemy import func, select, update

from celery_lease.check import check
from celery_lease.reaper import Reaper
from celery_lease.states import State
from celery_lease.store import Claim, NewTask, Outcome, Refusal, Slot, Store
from celery_lease.store.schema import after

from ..conftest import _libpq_url
from ..helpers import wait_until

S = State
NAME = "tests.report"


def new_task(**overrides: Any) -> NewTask:
    values: dict[str, Any] = {
        "id": uuid.uuid4().hex,
        "name": NAME,
        "args": "[1]",
        "kwargs": "{}",
        "options": "{}",
        "lease_ttl": 30.0,
        "max_recoveries": 5,
        "message": None,
    }
    values.update(overrides)
    return NewTask(**values)


def submit(store: Store, n: int = 1) -> list[str]:
    """``n`` rows, submitted in this order a second apart by database time (rows made
    within one millisecond on SQLite would otherwise tie, and ties go by id)."""
    ids = []
    for _ in range(n):
        task_id, created = store.submit(new_task())
        assert created
        ids.append(task_id)
    store.mark_published(ids)
    t = store.t.tasks
    with store.engine.begin() as conn:
        for i, task_id in enumerate(ids):
            conn.execute(
                update(t)
                .where(t.c.id == task_id)
                .values(created_at=after(t.c.created_at, float(i - n)))
            )
    return ids


def register(store: Store) -> str:
    worker_id = uuid.uuid4().hex
    store.register_worker(worker_id, f"w-{worker_id[:6]}@host", "host", os.getpid())
    return worker_id


def running_under(store: Store, key: str) -> int:
    t = store.t.tasks
    with store.engine.connect() as conn:
        return int(
            conn.execute(
                select(func.count()).where(
                    t.c.name == NAME, t.c.slot_key == key, t.c.state == S.RUNNING.value
                )
            ).scalar_one()
        )


class Freed:
    """Records the (name, key) pairs each commit freed or marked a row waiting under
    (the runtime's hook, without a broker: the test grants them itself)."""

    def __init__(self, store: Store) -> None:
        self.pairs: list[tuple[str, str]] = []
        store.on_slots_freed = self

    def __call__(self, pairs: Sequence[tuple[str, str]]) -> None:
        self.pairs += pairs


def test_a_full_key_makes_a_claim_wait_and_a_free_grants_the_oldest_waiting_row(store):
    freed = Freed(store)
    owner = register(store)
    slot = Slot(NAME, "tenant=42", 2)
    a, b, c, d = submit(store, 4)
    first = store.claim(a, owner, "w", slot=slot)
    second = store.claim(b, owner, "w", slot=slot)
    assert isinstance(first, Claim) and isinstance(second, Claim)
    third = store.claim(c, owner, "w", slot=slot)
    fourth = store.claim(d, owner, "w", slot=slot)
    assert isinstance(third, Refusal) and third.waiting and third.state is S.PENDING
    assert isinstance(fourth, Refusal) and fourth.waiting
    # each waiting mark, once committed, asks for a grant of its key (a slot freed
    # between its count and its commit is given then): none is free
    assert freed.pairs == [(NAME, "tenant=42")] * 2
    assert store.grant(freed.pairs) == []
    freed.pairs.clear()
    record = store.get(c)
    assert record is not None and record.state is S.PENDING
    assert record.reason == "waiting for a slot of tests.report[tenant=42] (limit 2)"
    assert [w.id for w in store.waiting_rows()] == [c, d]
    (usage,) = store.slot_usage()
    assert (usage.key, usage.limit, usage.running, usage.granted, usage.waiting) == (
        "tenant=42",
        2,
        2,
        0,
        2,
    )
    # a waiting row is not a lost message: the reaper does not publish it again
    assert c not in {p.id for p in store.take_unpublished()}

    assert store.finish(first.lease, S.SUCCEEDED, actor="task", reason="done")
    assert freed.pairs == [(NAME, "tenant=42")]
    granted = store.grant(freed.pairs)
    assert [p.id for p in granted] == [c]  # submission order: the oldest waiting row
    assert store.grant(freed.pairs) == []  # the slot is kept for c: nothing more to give
    # a fresh claim of the last row finds every slot taken (one RUNNING, one granted)
    again = store.claim(d, owner, "w", slot=slot)
    assert isinstance(again, Refusal) and again.waiting
    got = store.claim(c, owner, "w", slot=slot)
    assert isinstance(got, Claim)
    assert running_under(store, "tenant=42") == 2


def test_keys_are_independent_and_a_task_without_a_slot_is_not_counted(store):
    owner = register(store)
    a, b, c = submit(store, 3)
    assert isinstance(store.claim(a, owner, "w", slot=Slot(NAME, "k=1", 1)), Claim)
    assert isinstance(store.claim(b, owner, "w", slot=Slot(NAME, "k=2", 1)), Claim)
    # an unlimited claim of the same task name never touches the slots
    assert isinstance(store.claim(c, owner, "w"), Claim)
    assert (running_under(store, "k=1"), running_under(store, "k=2")) == (1, 1)


def one_slot_taken(store: Store) -> tuple[Freed, str, Slot, Claim, str]:
    """A limit of 1, taken by a row's claim, and a second row submitted: (the hook's
    record, the owner, the slot, the first row's claim, the second row's id)."""
    freed = Freed(store)
    owner = register(store)
    slot = Slot(NAME, "", 1)
    a, b = submit(store, 2)
    first = store.claim(a, owner, "w", slot=slot)
    assert isinstance(first, Claim)
    return freed, owner, slot, first, b


def test_retry_and_expiry_free_the_slot_only_when_the_row_leaves_running(store):
    freed, owner, slot, first, b = one_slot_taken(store)
    a = first.lease.task_id
    assert isinstance(store.claim(b, owner, "w", slot=slot), Refusal)
    assert freed.pairs == [(NAME, "")]  # the waiting mark's own grant (nothing free)
    assert store.grant(freed.pairs) == []
    freed.pairs.clear()
    # a retry ends the run: the slot is freed in the retry's transaction
    assert store.schedule_retry(first.lease, 0.0, actor="task", reason="retry", error=None)
    assert freed.pairs == [(NAME, "")]
    assert [p.id for p in store.grant(freed.pairs)] == [b]
    second = store.claim(b, owner, "w", slot=slot)
    assert isinstance(second, Claim)
    # the retried row's own delivery now finds no slot: it waits behind b's run
    again = store.claim(a, owner, "w", slot=slot)
    assert isinstance(again, Refusal) and again.waiting
    # b's worker is lost: only the reaper's decision frees the slot, not time
    freed.pairs.clear()
    store.stop_worker(owner, "gone")
    assert freed.pairs == []
    assert store.grant([(NAME, "")]) == []
    (expiry,) = store.expire(actor="reaper", reason="lease expired", task_ids=[b])
    assert expiry.to_state is S.RETRY_WAIT
    assert freed.pairs == [(NAME, "")]
    assert [p.id for p in store.grant(freed.pairs)] == [a]


def test_a_late_outcome_of_a_lost_lease_frees_nothing_twice(store):
    freed = Freed(store)
    owner = register(store)
    slot = Slot(NAME, "t", 1)
    a, b, c = submit(store, 3)
    first = store.claim(a, owner, "w", slot=slot)
    assert isinstance(first, Claim)
    store.expire(actor="reaper", reason="frozen", task_ids=[a], only_expired=False)
    assert [p.id for p in store.take_due_retries(actor="reaper")] == [a]
    second = store.claim(b, owner, "w", slot=slot)
    assert isinstance(second, Claim)
    freed.pairs.clear()
    # the frozen attempt thaws and reports: fenced off, and no slot is freed
    assert not store.finish(first.lease, S.SUCCEEDED, actor="task", reason="late")
    assert store.finish_many([], actor="task") == []
    assert freed.pairs == []
    waits = store.claim(c, owner, "w", slot=slot)
    assert isinstance(waits, Refusal) and waits.waiting
    assert running_under(store, "t") == 1


def test_a_cancelled_waiting_row_frees_and_takes_nothing(store):
    owner = register(store)
    slot = Slot(NAME, "t", 1)
    a, b, c = submit(store, 3)
    first = store.claim(a, owner, "w", slot=slot)
    assert isinstance(first, Claim)
    for task_id in (b, c):
        assert isinstance(store.claim(task_id, owner, "w", slot=slot), Refusal)
    store.operator_move(b, S.CANCELLED, actor="ops", reason="not needed")
    assert store.grant([(NAME, "t")]) == []  # the slot is still a's
    assert store.finish(first.lease, S.SUCCEEDED, actor="task", reason="done")
    assert [p.id for p in store.grant([(NAME, "t")])] == [c]
    (usage,) = store.slot_usage()
    assert (usage.running, usage.granted, usage.waiting) == (0, 1, 0)


def test_the_reaper_grants_free_slots_of_waiting_rows_when_no_worker_did(store):
    owner = register(store)
    slot = Slot(NAME, "t", 1)
    a, b = submit(store, 2)
    first = store.claim(a, owner, "w", slot=slot)
    assert isinstance(first, Claim)
    assert isinstance(store.claim(b, owner, "w", slot=slot), Refusal)
    assert store.take_waiting() == []  # no slot free
    assert store.finish(first.lease, S.SUCCEEDED, actor="task", reason="done")  # no hook
    assert [p.id for p in store.take_waiting()] == [b]
    assert store.take_waiting() == []


def test_lease_check_reports_a_row_left_waiting_while_its_key_has_a_free_slot(store):
    def reported(grace: float) -> list[str]:
        found = check(store, grace=grace)
        return [v.task_id for v in found if v.kind == "waiting_with_free_slot"]

    owner = register(store)
    slot = Slot(NAME, "t", 1)
    a, b = submit(store, 2)
    first = store.claim(a, owner, "w", slot=slot)
    assert isinstance(first, Claim)
    assert isinstance(store.claim(b, owner, "w", slot=slot), Refusal)
    assert reported(0.0) == []  # waiting, and rightly: the slot is a's
    assert store.finish(first.lease, S.SUCCEEDED, actor="task", reason="done")  # no hook
    # the slot is free and no grant followed: past the grace, the checker says so
    assert reported(0.0) == [b]
    assert reported(3600.0) == []  # a's run ended within the grace: a grant may be on its way
    assert [p.id for p in store.take_waiting()] == [b]
    assert reported(0.0) == []  # granted


def test_lease_check_leaves_the_waiting_rows_of_a_paused_task_alone(store):
    """What the store's model found: grants leave a paused task's waiting rows (the
    pause holds them), so a free slot of their key is no missed grant."""
    owner = register(store)
    slot = Slot(NAME, "t", 1)
    a, b = submit(store, 2)
    first = store.claim(a, owner, "w", slot=slot)
    assert isinstance(first, Claim)
    assert isinstance(store.claim(b, owner, "w", slot=slot), Refusal)
    assert store.pause("task", NAME, actor="ops", reason="deploy")
    assert store.finish(first.lease, S.SUCCEEDED, actor="task", reason="done")
    assert store.take_waiting() == []  # paused: held
    found = check(store, grace=0.0)
    assert [v.task_id for v in found if v.kind == "waiting_with_free_slot"] == []
    assert store.resume("task", NAME, actor="ops", reason="deployed")
    found = check(store, grace=0.0)
    assert [v.task_id for v in found if v.kind == "waiting_with_free_slot"] == [b]
    assert [p.id for p in store.take_waiting()] == [b]


def overrun_one(store: Store) -> tuple[Claim, str, str]:
    """A limit of 1: row ``a`` claimed and moved to WAIT_MANUAL by an overrun (its
    owner alive, still running it), row ``b`` delivered and waiting; (a's claim, b, the
    owner)."""
    owner = register(store)
    slot = Slot(NAME, "t", 1)
    a, b = submit(store, 2)
    first = store.claim(a, owner, "w", slot=slot)
    assert isinstance(first, Claim)
    t = store.t.tasks
    with store.engine.begin() as conn:  # no progress for longer than its max_runtime
        conn.execute(
            update(t)
            .where(t.c.id == a)
            .values(max_runtime=1.0, progress_at=after(t.c.progress_at, -60.0))
        )
    assert store.overrun(actor="reaper") == [a]
    assert store.get(a).state is S.WAIT_MANUAL  # type: ignore[union-attr]
    return first, b, owner


def test_an_overrun_keeps_its_slot_while_its_run_goes_on_and_frees_it_with_its_outcome(store):
    freed = Freed(store)
    first, b, owner = overrun_one(store)
    # the overrun's run goes on in its live worker: the slot is still taken
    refused = store.claim(b, owner, "w", slot=Slot(NAME, "t", 1))
    assert isinstance(refused, Refusal) and refused.waiting
    assert store.take_waiting() == []
    # and the checker agrees: a row waiting for a slot that is taken is no violation
    assert [v for v in check(store, grace=0.0) if v.kind == "waiting_with_free_slot"] == []
    (usage,) = store.slot_usage()
    assert (usage.running, usage.waiting) == (1, 1)  # the overrun's run holds the slot
    # its outcome is accepted from WAIT_MANUAL, and that frees the slot
    assert store.finish(first.lease, S.SUCCEEDED, actor="task", reason="done late")
    assert (NAME, "t") in freed.pairs
    assert [p.id for p in store.grant([(NAME, "t")])] == [b]


def test_an_overrun_gives_its_slot_back_when_its_run_is_seen_to_end_or_its_owner_stops(store):
    first, b, owner = overrun_one(store)
    assert isinstance(store.claim(b, owner, "w", slot=Slot(NAME, "t", 1)), Refusal)
    # the pool child running it died: the worker's expiry of that attempt ends the hold
    store.expire(
        actor="w",
        reason="child lost",
        task_ids=[first.lease.task_id],
        owners=[owner],
        attempt=1,
        only_expired=False,
    )
    assert store.get(first.lease.task_id).state is S.WAIT_MANUAL  # type: ignore[union-attr]
    assert [p.id for p in store.take_waiting()] == [b]


def test_an_overrun_whose_owner_stopped_holds_no_slot(store):
    _, b, owner = overrun_one(store)
    assert isinstance(store.claim(b, owner, "w", slot=Slot(NAME, "t", 1)), Refusal)
    store.stop_worker(owner, "gone")
    assert [p.id for p in store.take_waiting()] == [b]


def test_a_lower_limit_from_new_code_applies_to_rows_already_waiting(store):
    owner = register(store)
    a, b, c = submit(store, 3)
    for task_id in (a, b):
        assert isinstance(store.claim(task_id, owner, "w", slot=Slot(NAME, "t", 3)), Claim)
    # new code says 1: the waiting row gets no slot until the running ones drop below it
    assert isinstance(store.claim(c, owner, "w", slot=Slot(NAME, "t", 1)), Refusal)
    assert store.take_waiting() == []
    (usage,) = store.slot_usage()
    assert usage.limit == 1


@pytest.mark.parametrize("limit", [2])
def test_claims_at_once_from_many_threads_never_take_more_slots_than_the_limit(store, limit):
    owner = register(store)
    ids = submit(store, 12)
    slot = Slot(NAME, "t", limit)
    barrier = threading.Barrier(len(ids))
    answers: dict[str, Claim | Refusal] = {}
    errors: list[BaseException] = []

    def claim(task_id: str) -> None:
        try:
            barrier.wait()
            answers[task_id] = store.claim(task_id, owner, "w", slot=slot)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=claim, args=(i,)) for i in ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    claimed = [i for i, a in answers.items() if isinstance(a, Claim)]
    assert len(claimed) == limit
    assert all(isinstance(a, Refusal) and a.waiting for i, a in answers.items() if i not in claimed)
    assert running_under(store, "t") == limit
    (usage,) = store.slot_usage()
    assert usage.waiting == len(ids) - limit


def test_outcomes_and_retries_written_in_batches_free_their_slots(store):
    freed = Freed(store)
    owner = register(store)
    a, b, c, d = submit(store, 4)
    claims = []
    for task_id, key in ((a, "k=1"), (b, "k=2"), (c, "k=3")):
        got = store.claim(task_id, owner, "w", slot=Slot(NAME, key, 1))
        assert isinstance(got, Claim)
        claims.append(got)
    unlimited = store.claim(d, owner, "w")
    assert isinstance(unlimited, Claim)
    done = store.finish_many(
        [
            Outcome(claims[0].lease, S.SUCCEEDED, "done", None, None),
            Outcome(unlimited.lease, S.SUCCEEDED, "done", None, None),
        ],
        actor="writer",
    )
    assert done == [True, True]
    assert freed.pairs == [(NAME, "k=1")]
    retried = store.retry_many(
        [
            Outcome(claims[1].lease, S.RETRY_WAIT, "again", None, None, 0.0, None),
            Outcome(claims[2].lease, S.RETRY_WAIT, "again", None, None, 0.0, None),
        ],
        actor="writer",
    )
    assert retried == [True, True]
    assert sorted(freed.pairs) == [(NAME, "k=1"), (NAME, "k=2"), (NAME, "k=3")]


def test_a_task_without_a_limit_pays_no_statement_for_limits(store):
    from sqlalchemy import event

    owner = register(store)
    (task_id,) = submit(store)
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    event.listen(store.engine, "before_cursor_execute", record)
    try:
        got = store.claim(task_id, owner, "w")
        assert isinstance(got, Claim)
        assert store.finish(got.lease, S.SUCCEEDED, actor="task", reason="done")
    finally:
        event.remove(store.engine, "before_cursor_execute", record)
    assert not any("concurrency" in s for s in seen)
    if store.is_pg:
        assert len(seen) == 2  # the claim and the outcome: one statement each, as before


def claim_in_process(config: Any, task_id: str, owner: str, barrier: Any, results: Any) -> None:
    """Child process: claim ``task_id`` under one slot once every child is ready."""
    store = Store(config)
    try:
        store.ping()
        barrier.wait(60)
        got = store.claim(task_id, owner, "w", slot=Slot(NAME, "t", 2))
        results.put((task_id, "claimed" if isinstance(got, Claim) else f"waiting={got.waiting}"))
    except BaseException as exc:
        results.put((task_id, f"error {exc!r}"))
        raise
    finally:
        store.dispose()


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_eight_processes_claiming_at_once_take_exactly_the_limit(store: Store) -> None:
    import multiprocessing

    owner = register(store)
    ids = submit(store, 8)
    # forked, so they start in milliseconds: each child makes a store and connections of
    # its own, never touches the parent's, and ends with os._exit (multiprocessing's)
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(len(ids)), ctx.Queue()
    procs = [
        ctx.Process(target=claim_in_process, args=(store.config, i, owner, barrier, results))
        for i in ids
    ]
    for proc in procs:
        proc.start()
    answers = dict(results.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(30)
    results.close()
    results.join_thread()
    assert all(proc.exitcode == 0 for proc in procs), answers
    assert sorted(answers.values()) == ["claimed"] * 2 + ["waiting=True"] * 6
    assert running_under(store, "t") == 2


def test_keys_nothing_uses_for_an_hour_are_deleted_and_come_back_at_their_next_claim(store):
    owner = register(store)
    c = store.t.concurrency
    idle, running, waiting, fresh = (Slot(NAME, k, 1) for k in ("idle", "run", "wait", "new"))
    paced = Slot(NAME, "paced", 0, 3600.0)
    a, b, d, e, f, g, h = submit(store, 7)
    done = store.claim(a, owner, "w", slot=idle)
    assert isinstance(done, Claim)
    assert store.finish(done.lease, S.SUCCEEDED, actor="task", reason="done")
    assert isinstance(store.claim(b, owner, "w", slot=running), Claim)
    assert isinstance(store.claim(d, owner, "w", slot=waiting), Claim)
    assert isinstance(store.claim(e, owner, "w", slot=waiting), Refusal)  # waits
    assert isinstance(store.claim(f, owner, "w", slot=paced), Claim)  # next start: in an hour
    assert isinstance(store.claim(g, owner, "w", slot=fresh), Claim)
    with store.engine.begin() as conn:  # every key but "new" last used two hours ago
        conn.execute(
            update(c).where(c.c.key != "new").values(updated_at=after(c.c.updated_at, -7200.0))
        )
    # the reaper's retention phase does it, in every sweep
    Reaper(Celery(set_as_current=False), actor="reaper:test", store=store).purge_expired()
    with store.engine.connect() as conn:
        keys = set(conn.execute(select(c.c.key)).scalars())
    assert keys == {"run", "wait", "paced", "new"}  # "idle" only: nothing of it is left
    assert store.purge_idle_keys() == 0
    # the key comes back with its next claim, its limit recorded again
    assert isinstance(store.claim(h, owner, "w", slot=idle), Claim)
    assert {(u.key, u.limit, u.running) for u in store.slot_usage() if u.key == "idle"} == {
        ("idle", 1, 1)
    }


def test_a_claim_marks_an_old_key_used(store):
    owner = register(store)
    c = store.t.concurrency
    a, b = submit(store, 2)
    first = store.claim(a, owner, "w", slot=Slot(NAME, "k", 2))
    assert isinstance(first, Claim)
    assert store.finish(first.lease, S.SUCCEEDED, actor="task", reason="done")
    with store.engine.begin() as conn:
        conn.execute(update(c).values(updated_at=after(c.c.updated_at, -7200.0)))
    second = store.claim(b, owner, "w", slot=Slot(NAME, "k", 2))
    assert isinstance(second, Claim)
    assert store.finish(second.lease, S.SUCCEEDED, actor="task", reason="done")
    assert store.purge_idle_keys() == 0  # nothing uses it, but a claim did just now


def _waiting_on_a_row_lock(store: Store) -> int:
    """Sessions that hold a lock on this store's tasks table and wait for another."""
    table = store.t.tasks.fullname
    with psycopg.connect(_libpq_url(store.config.database_url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(DISTINCT w.pid) FROM pg_locks w JOIN pg_locks h ON h.pid = w.pid "
            "WHERE NOT w.granted AND h.granted AND h.relation = %s::regclass",
            (table,),
        ).fetchone()
    return int(row[0]) if row else 0


def test_a_free_whose_read_missed_a_waiting_mark_is_granted_by_the_claim_that_made_it(store):
    """The race between a free and a claim of its key, made to happen: the claim counts
    the slot as used, the free commits and its grant reads before the claim's waiting
    mark is committed (so it finds no row waiting), then the mark commits. The claim's
    own grant, once its mark is committed, gives the row the slot."""
    if not store.is_pg:
        pytest.skip("SQLite serializes every write transaction: the two cannot overlap")
    freed, owner, slot, first, b = one_slot_taken(store)
    t = store.t.tasks
    # hold row b: the claim counts (the key full), then waits to mark b waiting
    holder = psycopg.connect(_libpq_url(store.config.database_url), connect_timeout=5)
    holder.execute(f"SELECT id FROM {t.fullname} WHERE id = %s FOR UPDATE", (b,))
    got: list[Any] = []
    claiming = threading.Thread(
        target=lambda: got.append(store.claim(b, owner, "w", slot=slot)), daemon=True
    )
    try:
        claiming.start()
        wait_until(lambda: _waiting_on_a_row_lock(store) >= 1, message="the claim waits on b")
        # the free commits, and its grant's read runs before the mark is committed
        assert store.finish(first.lease, S.SUCCEEDED, actor="task", reason="done")
        assert freed.pairs == [(NAME, "")]
        assert store.grant(freed.pairs) == []  # no row waiting, as far as it can see
        freed.pairs.clear()
    finally:
        holder.rollback()
        holder.close()
    claiming.join(30)
    assert not claiming.is_alive()
    (refused,) = got
    assert isinstance(refused, Refusal) and refused.waiting
    # the mark, committed, asked for its key's grant: the slot the free left is its
    assert freed.pairs == [(NAME, "")]
    assert [p.id for p in store.grant(freed.pairs)] == [b]
    assert isinstance(store.claim(b, owner, "w", slot=slot), Claim)


def test_a_claim_in_one_statement_counts_again_after_a_take_it_waited_for(store):
    """PostgreSQL claims a limited row in one statement, whose count of the slots in use
    reads a snapshot taken before it waits for the key's lock. Made to happen: claim A
    holds the key's lock and waits (its row held by another session); claim B, limit 1,
    takes its snapshot and waits for the lock; A commits its take. B's snapshot saw the
    key empty: the key's count of changes, moved since that snapshot, sends B to the
    transaction, which counts A's slot and makes B wait."""
    if not store.is_pg:
        pytest.skip("SQLite claims a limited row in a transaction that takes the lock first")
    freed = Freed(store)
    owner = register(store)
    slot = Slot(NAME, "", 1)
    earlier, a, b = submit(store, 3)
    # the key's row is there before either snapshot: its count of changes is compared
    done = store.claim(earlier, owner, "w", slot=slot)
    assert isinstance(done, Claim)
    assert store.finish(done.lease, S.SUCCEEDED, actor="task", reason="done")
    t = store.t.tasks
    holder = psycopg.connect(_libpq_url(store.config.database_url), connect_timeout=5)
    holder.execute(f"SELECT id FROM {t.fullname} WHERE id = %s FOR UPDATE", (a,))
    got: dict[str, Any] = {}

    def claim(task_id: str) -> None:
        got[task_id] = store.claim(task_id, owner, "w", slot=slot)

    claims = [threading.Thread(target=claim, args=(i,), daemon=True) for i in (a, b)]
    try:
        claims[0].start()
        wait_until(lambda: _waiting_on_a_row_lock(store) >= 1, message="A waits on its row")
        claims[1].start()
        wait_until(lambda: _waiting_on_a_row_lock(store) >= 2, message="B waits on A's lock")
    finally:
        holder.rollback()
        holder.close()
    for thread in claims:
        thread.join(30)
        assert not thread.is_alive()
    assert isinstance(got[a], Claim)
    assert isinstance(got[b], Refusal) and got[b].waiting
    assert running_under(store, "") == 1
    assert store.finish(got[a].lease, S.SUCCEEDED, actor="task", reason="done")
    assert [p.id for p in store.grant(freed.pairs)] == [b]


def _waiting_on(store: Store, table: Any) -> int:
    """Sessions waiting for a lock on ``table``."""
    with psycopg.connect(_libpq_url(store.config.database_url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(DISTINCT pid) FROM pg_locks "
            "WHERE NOT granted AND relation = %s::regclass",
            (table.fullname,),
        ).fetchone()
    return int(row[0]) if row else 0


def _granted(store: Store) -> int:
    t = store.t.tasks
    with store.engine.connect() as conn:
        return int(
            conn.execute(
                select(func.count()).where(t.c.name == NAME, t.c.slot == "granted")
            ).scalar_one()
        )


def test_a_claim_in_one_statement_counts_every_row_a_grant_it_waited_for_gave_a_slot(store):
    """A grant can give several slots at once; the claim in one statement counts the
    changes of its key committed while it waited for the lock, each as at most one
    slot, so a grant counts as many changes as the rows it gave slots to. Made to
    happen: limit 3, two rows waiting, two slots freed; the grant takes the key's lock
    and waits (another session holds the pauses table it reads); a claim takes its
    snapshot (one slot in use) and waits for the lock; the grant gives both slots and
    commits. The claim must find the key full."""
    if not store.is_pg:
        pytest.skip("SQLite claims a limited row in a transaction that takes the lock first")
    Freed(store)  # frees grant nothing by themselves: the test's grant does
    owner = register(store)
    slot = Slot(NAME, "", 3)
    x1, x2, x3, w1, w2, c = submit(store, 6)
    running = [store.claim(x, owner, "w", slot=slot) for x in (x1, x2, x3)]
    assert all(isinstance(r, Claim) for r in running)
    for w in (w1, w2):
        refused = store.claim(w, owner, "w", slot=slot)
        assert isinstance(refused, Refusal) and refused.waiting
    for done in running[:2]:
        assert isinstance(done, Claim)
        assert store.finish(done.lease, S.SUCCEEDED, actor="task", reason="done", holds_slot=True)
    assert running_under(store, "") == 1
    pauses = store.t.pauses
    holder = psycopg.connect(_libpq_url(store.config.database_url), connect_timeout=5)
    holder.execute(f"LOCK TABLE {pauses.fullname} IN ACCESS EXCLUSIVE MODE")
    got: dict[str, Any] = {}

    def grant() -> None:
        got["grant"] = store.grant([(NAME, "")])

    def claim() -> None:
        got["claim"] = store.claim(c, owner, "w", slot=slot)

    granting = threading.Thread(target=grant, daemon=True)
    claiming = threading.Thread(target=claim, daemon=True)
    try:
        granting.start()
        wait_until(lambda: _waiting_on(store, pauses) >= 1, message="the grant waits")
        claiming.start()
        # the claim, past its snapshot, and the grant both wait, each holding a lock
        wait_until(
            lambda: _waiting_on_a_row_lock(store) >= 2, message="the claim waits for the key's lock"
        )
    finally:
        holder.rollback()
        holder.close()
    for thread in (granting, claiming):
        thread.join(30)
        assert not thread.is_alive()
    assert sorted(p.id for p in got["grant"]) == sorted([w1, w2])
    assert isinstance(got["claim"], Refusal) and got["claim"].waiting, got["claim"]
    assert running_under(store, "") + _granted(store) == 3


def test_claims_in_one_statement_never_trust_a_key_row_purged_while_they_waited(store):
    """A key unused for an hour has its row deleted (``purge_idle_keys``), and the
    next claim makes it again, its count of changes starting over. A claim in one
    statement whose snapshot saw the old row, with its higher count, must not read the
    new row's count as fewer changes than none. Made to happen: the idle key's row is
    deleted by another session, which holds it while two claims, limit 1, take their
    snapshots (the old row, no slot in use) and wait for it; the delete commits. One
    claim runs, the other waits for the slot."""
    if not store.is_pg:
        pytest.skip("SQLite claims a limited row in a transaction that takes the lock first")
    Freed(store)
    owner = register(store)
    slot = Slot(NAME, "", 1)
    *earlier, a, b = submit(store, 5)
    for task_id in earlier:  # the key's count of changes is well above one
        done = store.claim(task_id, owner, "w", slot=slot)
        assert isinstance(done, Claim)
        assert store.finish(done.lease, S.SUCCEEDED, actor="task", reason="done")
    c = store.t.concurrency
    with store.engine.begin() as conn:  # unused for two hours: the purge may delete it
        conn.execute(update(c).values(updated_at=after(c.c.updated_at, -7200.0)))
    holder = psycopg.connect(_libpq_url(store.config.database_url), connect_timeout=5)
    holder.execute(f"DELETE FROM {c.fullname} WHERE name = %s AND key = ''", (NAME,))
    got: dict[str, Any] = {}

    def claim(task_id: str) -> None:
        got[task_id] = store.claim(task_id, owner, "w", slot=slot)

    claims = [threading.Thread(target=claim, args=(i,), daemon=True) for i in (a, b)]
    try:
        for thread in claims:
            thread.start()
        wait_until(lambda: _waiting_on_a_row_lock(store) >= 2, message="both wait for the key")
        holder.commit()
    finally:
        holder.close()
    for thread in claims:
        thread.join(30)
        assert not thread.is_alive()
    ran = [i for i in (a, b) if isinstance(got[i], Claim)]
    assert len(ran) == 1, got
    assert running_under(store, "") == 1
    other = got[b if ran == [a] else a]
    assert isinstance(other, Refusal) and other.waiting


def _free_while_it_waits(store: Store, run: Claim, meanwhile: Callable[[], None]) -> bool:
    """Write ``run``'s outcome (holding its slot) while another session holds its row:
    the free's statement takes its snapshot and waits; ``meanwhile`` runs then; the
    row is let go and the free commits. Whether the outcome was written."""
    t = store.t.tasks
    holder = psycopg.connect(_libpq_url(store.config.database_url), connect_timeout=5)
    holder.execute(f"SELECT id FROM {t.fullname} WHERE id = %s FOR UPDATE", (run.lease.task_id,))
    got: list[bool] = []

    def finish() -> None:
        got.append(
            store.finish(run.lease, S.SUCCEEDED, actor="task", reason="done", holds_slot=True)
        )

    freeing = threading.Thread(target=finish, daemon=True)
    try:
        freeing.start()
        wait_until(lambda: _waiting_on_a_row_lock(store) >= 1, message="the free waits")
        meanwhile()
    finally:
        holder.rollback()
        holder.close()
    freeing.join(30)
    assert not freeing.is_alive()
    return got == [True]


def test_a_free_that_reads_no_row_waiting_in_its_statement_is_granted_when_a_mark_came_first(
    store,
):
    """PostgreSQL writes the outcome of a run holding a slot with, in the same
    statement, its own read of the key's waiting rows, and asks for no grant when none
    waits. Made to happen: the free's statement takes its snapshot and waits (its row
    held by another session); a claim of the key, full, marks its row waiting and
    commits, and its own grant counts the slot still used; the free commits. Its
    snapshot saw no row waiting, but the key's count of changes moved between that
    snapshot and the free's lock, so the free asks for the grant, which gives the slot
    to the waiting row."""
    if not store.is_pg:
        pytest.skip("SQLite grants every free after its commit")
    freed, owner, slot, first, b = one_slot_taken(store)

    def claim_meanwhile() -> None:
        # the claim finds the key full (the free is not committed), marks b waiting, and
        # its grant, after its commit, still counts the slot as used
        refused = store.claim(b, owner, "w", slot=slot)
        assert isinstance(refused, Refusal) and refused.waiting
        assert freed.pairs == [(NAME, "")]
        assert store.grant(freed.pairs) == []
        freed.pairs.clear()

    assert _free_while_it_waits(store, first, claim_meanwhile)
    assert freed.pairs == [(NAME, "")]  # the free asked for its key's grant
    assert [p.id for p in store.grant(freed.pairs)] == [b]


def test_a_free_after_takes_alone_asks_for_no_grant(store):
    """Takes of the key committed between a free's snapshot and its lock add no
    waiting row: the free, seeing none waiting, asks for no grant (six processes
    claiming and freeing one key no longer read its waiting rows after each free).
    Made to happen: the free's statement takes its snapshot and waits (its row held by
    another session); a claim of the key takes a slot and commits; the free commits."""
    if not store.is_pg:
        pytest.skip("SQLite grants every free after its commit")
    freed = Freed(store)
    owner = register(store)
    slot = Slot(NAME, "", 3)
    a, b = submit(store, 2)
    first = store.claim(a, owner, "w", slot=slot)
    assert isinstance(first, Claim)

    def take_meanwhile() -> None:
        assert isinstance(store.claim(b, owner, "w", slot=slot), Claim)

    assert _free_while_it_waits(store, first, take_meanwhile)
    assert freed.pairs == []
    assert running_under(store, "") == 1


def test_a_free_that_no_row_waits_for_asks_for_no_grant(store):
    """The common case while a limit does not bind: the outcome of a run holding a slot,
    with no row waiting for its key, costs no grant (on PostgreSQL not even the
    grant's read); with a row waiting it asks for the grant."""
    freed = Freed(store)
    owner = register(store)
    slot = Slot(NAME, "", 2)
    a, b, c = submit(store, 3)
    first, second = (store.claim(i, owner, "w", slot=slot) for i in (a, b))
    assert isinstance(first, Claim) and isinstance(second, Claim)
    assert store.finish(first.lease, S.SUCCEEDED, actor="task", reason="done", holds_slot=True)
    assert freed.pairs == ([] if store.is_pg else [(NAME, "")])
    freed.pairs.clear()
    assert isinstance(store.claim(c, owner, "w", slot=slot), Claim)
    waiting = submit(store, 1)[0]
    assert isinstance(store.claim(waiting, owner, "w", slot=slot), Refusal)
    freed.pairs.clear()
    assert store.finish(second.lease, S.SUCCEEDED, actor="task", reason="done", holds_slot=True)
    assert freed.pairs == [(NAME, "")]
    assert [p.id for p in store.grant(freed.pairs)] == [waiting]
