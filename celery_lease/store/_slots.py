"""Concurrency limits: the slots of a limited task (globally, or per concurrency key),
counted and taken under one lock per (task name, key), and given to waiting rows.

A slot is not a row of its own: the slots in use are the task's RUNNING rows under
that key, plus the PENDING rows a freed slot was granted to and that are not claimed
yet, plus the rows an overrun moved to WAIT_MANUAL while their live owner still runs
them (``overrun``). So a slot is freed by the very state change that ends a run (the
fenced outcome, a retry, the reaper's expiry, a claim given back, an overrun's run
seen to end), in its transaction, exactly once; a cancelled waiting or granted row
stops counting by being cancelled; only an overrun's owner dying frees a slot by the
clock (its heartbeat past the TTL), and the reaper's backstop then grants it.

Taking one is serialized per (name, key) by the row of the ``concurrency`` table:

* a claim (:meth:`~celery_lease.store._claim.Claims.claim` with a :class:`Slot`) locks
  it (an upsert that also records the limit its code gives), then moves the row
  ``PENDING -> RUNNING`` in one compare-and-set whose ``WHERE`` counts the slots in use
  below the limit; if only the count stops it, the row is marked ``slot='waiting'``
  with the reason, in the same transaction, and the delivery is acked without running;
* a grant (:meth:`Slots.grant`: the worker whose commit freed slots, at once; the
  reaper's :meth:`Slots.take_waiting` as the backstop) locks it, counts, and marks the
  oldest waiting rows ``slot='granted'``, reserved for publishing.

Both add to the key's ``changes`` under the lock, one per slot taken or given at
least; a claim's waiting mark, made in its transaction, adds :data:`MARK`. On
PostgreSQL a claim tries first to do it all in one statement (lock, count, move, audit
row): its count reads the statement's snapshot, taken before it waited for the lock,
so it counts each change its lock returns beyond its snapshot's (less its own) as one
slot taken that the snapshot missed; when that makes the key full, or the row is not
due, the transaction above decides.

A free does not take the lock: it commits first, then grants. A grant asks first,
outside a transaction, whether the key has a row waiting: a key with none, the usual
case while a limit does not bind, costs that one read instead of the grant's
transaction. A claim that counted the freed slot as used (before the free's commit)
and marked its row waiting may commit that mark after the free's read: so a claim
that marks a row waiting also grants once its mark is committed (the same hook a free
runs). One of the two always sees the other: if the free's read (after the free's
commit) misses the mark, the mark was committed after that read, so the claim's grant,
after its mark, counts the slot free. A row waiting is never in the broker and never
polled: it is published when it is granted a slot. On SQLite every write transaction
is serialized (``BEGIN IMMEDIATE``), which decides the same way.

On PostgreSQL the outcome of a run that says it holds a slot (the worker's) does that
read in its own statement instead, and takes the key's lock there (see
:meth:`Slots._free_pg`): when no waiting mark of the key committed between its
snapshot and its lock (its ``changes`` moved by less than :data:`MARK`) and no row
waits, it asks for no grant at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Integer,
    String,
    and_,
    bindparam,
    delete,
    func,
    literal_column,
    not_,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.sql.dml import Insert, ReturningUpdate

from ..states import State
from ._base import StoreBase, state_is
from ._types import Publishable, Slot, SlotUsage, Waiting
from .schema import after, db_now, seconds_between

#: A key's row unused for this long, and used by no row, is deleted (seconds).
KEY_IDLE_FOR = 3600.0

#: What a waiting mark adds to its key's ``changes`` (a take or a slot given adds one):
#: a count no number of takes reaches while a statement waits for the key's lock, so a
#: free can tell a mark from takes by the difference alone (see :meth:`Slots._free_pg`);
#: 2**43 marks fit before the column (a BigInteger) would overflow.
MARK = 2**20

#: ``tasks.slot`` of a PENDING row whose delivery found no slot: acked, not in the broker.
WAITING = "waiting"
#: ``tasks.slot`` of a PENDING row a freed slot is kept for: published, not yet claimed.
GRANTED = "granted"


#: ``tasks.slot`` of a row an overrun moved to WAIT_MANUAL (``max_runtime``) while its
#: owner kept running it: it holds its slot while that owner is alive, until its
#: outcome (accepted) or a person moves it, or its run is seen to end without one.
OVERRUN = "overrun"
#: ``tasks.slot`` of a PENDING row paced by its task's ``global_rate_limit``: a start of
#: its key was reserved for it, at its ETA, where it is published (or held) for it.
PACED = "paced"


def paced_reason(slot: Slot, start: datetime) -> str:
    """The reason a paced row shows."""
    every = f"{slot.interval:g}" if slot.interval is not None else "?"
    return (
        f"paced by the global rate limit of {slot.label()} (one start every {every} s): "
        f"starts at {start.isoformat()}"
    )


def waiting_reason(slot: Slot) -> str:
    """The reason a waiting row shows (``lease show``, the Django admin)."""
    return f"waiting for a slot of {slot.label()} (limit {slot.limit})"


def _running(t: Any) -> list[ColumnElement[bool]]:
    # written as the partial index's own words, so that both databases use it
    return [t.c.slot_key.is_not(None), t.c.state == literal_column("'RUNNING'")]


def _queued(t: Any, slot: str) -> list[ColumnElement[bool]]:
    return [
        t.c.slot.is_not(None),
        t.c.slot == literal_column(f"'{slot}'"),
        state_is(t, State.PENDING),
    ]


def holders(t: Any, w: Any, name: Any, key: Any, exclude: Any = None) -> ColumnElement[int]:
    """The slots in use under (``name``, ``key``): RUNNING rows, rows granted one (not
    ``exclude``, the row asking: a row granted a slot takes its own), and rows moved to
    WAIT_MANUAL by an overrun while their owner, alive, may still be running them
    (``t``: the tasks table or an alias of it; ``w``: the workers table)."""
    running = select(func.count()).where(t.c.name == name, t.c.slot_key == key, *_running(t))
    granted = select(func.count()).where(
        t.c.name == name, t.c.slot_key == key, *_queued(t, GRANTED)
    )
    if exclude is not None:
        granted = granted.where(t.c.id != exclude)
    w = w.alias("slot_owner")  # never correlated to a workers table of the outer query
    overrun = select(func.count()).where(
        t.c.name == name,
        t.c.slot_key == key,
        t.c.slot.is_not(None),
        t.c.slot == literal_column(f"'{OVERRUN}'"),
        state_is(t, State.WAIT_MANUAL),
        select(w.c.id)
        .where(
            w.c.id == t.c.owner,
            w.c.stopped_at.is_(None),
            after(w.c.heartbeat_at, t.c.lease_ttl) >= db_now(),
        )
        .exists(),
    )
    return running.scalar_subquery() + granted.scalar_subquery() + overrun.scalar_subquery()


class Slots(StoreBase):
    """Locks and grants of concurrency slots; what operators read of them."""

    def _lock_slot_statement(self) -> Insert:
        c = self.t.concurrency
        stmt = self._insert(c).values(
            name=bindparam("b_slot_name", type_=String),
            key=bindparam("b_slot_key", type_=String),
            max_slots=bindparam("b_limit", type_=Integer),
            updated_at=db_now(),
            changes=1,
        )
        # the lock: the key's row written, with the limit the caller's code gives, the
        # key marked used, and one more take (a claim in one statement that sees the
        # count move between its snapshot and its lock leaves the decision to this)
        return stmt.on_conflict_do_update(
            index_elements=[c.c.name, c.c.key],
            set_={
                "max_slots": stmt.excluded.max_slots,
                "updated_at": db_now(),
                "changes": c.c.changes + 1,
            },
        )

    def lock_slot(self, conn: Connection, slot: Slot) -> None:
        """Take (name, key)'s lock in the caller's transaction, recording the limit the
        caller's code gives (rows already waiting follow it)."""
        conn.execute(
            self._prepared("slot-lock", self._lock_slot_statement),
            {"b_slot_name": slot.name, "b_slot_key": slot.key, "b_limit": slot.limit},
        )

    def _free_pg(self, stmt: ReturningUpdate[Any], frm: State, to: State) -> Any:
        """PostgreSQL: the move ``stmt`` of a row that holds a slot, its audit row, and
        whether its free needs a grant, in one statement (a row per row moved, with
        ``settled`` and ``waiting``).

        A free's grant must read the waiting rows after the free's commit: a claim that
        counted the slot as used may mark a row waiting meanwhile (see the module's
        notes). This statement reads them in its own snapshot instead, and takes the
        key's lock (``FOR UPDATE``, which returns the key's newest row after any wait):
        if the key's ``changes`` there exceed its snapshot's by less than :data:`MARK`
        (``settled``), no waiting mark of the key committed between the snapshot and
        the lock (takes and grants may have: they add no waiting row), and none can
        until this commits, so a row marked waiting after it is marked by a claim that
        counts this free. So a free that is ``settled`` and sees no row ``waiting``
        needs no grant; any other is granted after its commit, as before."""
        t, c = self.t.tasks, self.t.concurrency
        moved, audit = self._move_ctes(stmt, frm, to)
        of_key = (c.c.name == moved.c.name, c.c.key == moved.c.slot_key)
        locked = select(c.c.changes).where(*of_key).with_for_update(of=c).cte("slot_lock")
        seen = select(c.c.changes).where(*of_key).scalar_subquery()
        waiting = (
            select(t.c.id)
            .where(t.c.name == moved.c.name, t.c.slot_key == moved.c.slot_key)
            .where(*_queued(t, WAITING))
            .exists()
        )
        return (
            select(
                moved,
                (select(locked.c.changes).scalar_subquery() - seen < MARK).label("settled"),
                waiting.label("waiting"),
            )
            .add_cte(locked)
            .add_cte(audit)
        )

    def mark_waiting(self, conn: Connection, task_id: str, slot: Slot) -> bool:
        """The PENDING row ``task_id`` found no slot: it waits (its delivery is acked);
        whether it was still PENDING. Once the mark is committed, the key is granted
        (:attr:`on_slots_freed`): a slot freed after this claim counted, whose grant
        read before the mark was committed, is given to it then."""
        t, c = self.t.tasks, self.t.concurrency
        done = conn.execute(
            update(t)
            .where(t.c.id == task_id, state_is(t, State.PENDING))
            .values(
                slot=WAITING,
                slot_key=slot.key,
                reason=waiting_reason(slot),
                updated_at=db_now(),
            )
        ).rowcount
        if done:
            # the caller holds the key's lock (see lock_slot)
            conn.execute(
                update(c)
                .where(c.c.name == slot.name, c.c.key == slot.key)
                .values(changes=c.c.changes + MARK)
            )
            self._note_grant_due(slot.name, slot.key)
        return bool(done)

    def grant(self, pairs: Sequence[tuple[str, str]]) -> list[Publishable]:
        """Give the free slots of these (name, key) pairs to their oldest waiting rows:
        those rows are marked granted and reserved for publishing now (returned; if
        they are never published, the reaper's grace sweep publishes them). A key with
        no row waiting (:meth:`_has_waiting`) costs no transaction."""
        out: list[Publishable] = []
        for name, key in pairs:
            if not self._has_waiting(name, key):
                continue

            def op(conn: Connection, _: bool, name: str = name, key: str = key) -> list[Any]:
                return self._grant(conn, name, key)

            out += self._tx(op)
        return out

    def _has_waiting(self, name: str, key: str) -> bool:
        """Whether (name, key) has rows waiting: the grant's first question, one read
        (on PostgreSQL in autocommit). A mark it cannot see yet (committed after it)
        is granted by the claim that made it (:meth:`mark_waiting`)."""
        params = {"b_slot_name": name, "b_slot_key": key}
        found = self._prepared("slot-waiting", self._has_waiting_statement)

        def op(conn: Connection, _: bool = False) -> bool:
            return bool(conn.execute(found, params).scalar())

        if not self.is_pg:
            return self._read(op)
        return self._tx(op, single=True)

    def _has_waiting_statement(self) -> Any:
        t = self.t.tasks
        return select(
            select(t.c.id)
            .where(
                t.c.name == bindparam("b_slot_name", type_=String),
                t.c.slot_key == bindparam("b_slot_key", type_=String),
                *_queued(t, WAITING),
            )
            .exists()
        )

    def _grant(self, conn: Connection, name: str, key: str) -> list[Publishable]:
        t, c = self.t.tasks, self.t.concurrency
        q = select(c.c.max_slots).where(c.c.name == name, c.c.key == key)
        if self.is_pg:
            q = q.with_for_update()
        limit = conn.execute(q).scalar()
        if limit is None:
            return []
        used = holders(t, self.t.workers, name, key)
        free = int(limit) - int(conn.execute(select(used)).scalar_one())
        if free <= 0:
            return []
        waiting = (
            select(t.c.id)
            .where(t.c.name == name, t.c.slot_key == key, *_queued(t, WAITING))
            .where(self._not_paused())
            .order_by(t.c.created_at, t.c.id)
            .limit(free)
        )
        ids = self._take_ids(conn, waiting)
        if not ids:
            return []
        rows = conn.execute(
            update(t)
            .where(t.c.id.in_(ids), state_is(t, State.PENDING), t.c.slot == WAITING)
            .values(
                slot=GRANTED,
                published_at=None,
                updated_at=db_now(),
                held=False,
                reason=f"granted a slot of {Slot(name, key, int(limit)).label()}: published",
            )
            .returning(t.c.id, *self._publishable_columns())
        ).all()
        # one change per slot given: a claim in one statement counts each change it did
        # not see as at most one slot taken (see Claims._claim_slot_pg)
        conn.execute(
            update(c)
            .where(c.c.name == name, c.c.key == key)
            .values(served_at=db_now(), changes=c.c.changes + len(rows))
        )
        return self._publishable(rows)

    def _not_paused(self) -> ColumnElement[bool]:
        t, p = self.t.tasks, self.t.pauses
        paused: Any = select(p.c.target).where(p.c.kind == "task")
        return t.c.name.not_in(paused)

    def take_waiting(self, *, limit: int | None = None) -> list[Publishable]:
        """The reaper's backstop: grant the free slots of the keys that have rows
        waiting (a grant that never ran: its worker died after its commit, or a granted
        row was cancelled), least recently served keys first, so keys take turns; at
        most ``limit`` keys (a batch)."""
        t, c = self.t.tasks, self.t.concurrency
        batch = limit or self.config.reaper_batch_size
        has_waiting = (
            select(t.c.id)
            .where(t.c.name == c.c.name, t.c.slot_key == c.c.key, *_queued(t, WAITING))
            .exists()
        )
        # only the keys with a slot free: with none free (the usual case while rows
        # wait), the backstop is this one read, whatever the number of keys waiting
        peer = t.alias("peer")
        q = (
            select(c.c.name, c.c.key)
            .where(has_waiting, holders(peer, self.t.workers, c.c.name, c.c.key) < c.c.max_slots)
            .order_by(c.c.served_at.is_not(None), c.c.served_at, c.c.name, c.c.key)
            .limit(batch)
        )
        pairs = [(str(r.name), str(r.key)) for r in self._read(lambda conn: conn.execute(q).all())]
        return self.grant(pairs)

    def purge_idle_keys(self, *, limit: int | None = None) -> int:
        """Delete one batch of ``concurrency`` rows that nothing uses: no claim of the
        key for :data:`KEY_IDLE_FOR` seconds (every claim marks it used), no row of the
        key RUNNING, waiting, granted, paced or overrun, and its next start (a rate
        limit) past. Nothing is lost with them: the next claim of the key records its
        code's limit again, and a next start that has passed means "now". Keys of one
        tenant each would otherwise add a row per tenant ever seen. How many were
        deleted.

        Candidates are read, then locked (PostgreSQL: ``FOR UPDATE SKIP LOCKED``; a
        claim, a grant or a pacing of the key takes the same lock), then checked again
        and deleted in a statement of its own, which on PostgreSQL sees everything
        committed before the locks were taken: a claim that marked a row waiting just
        before is seen (the key is kept), one that comes after recreates the row with
        its upsert. A key a concurrent claim holds locked is skipped."""
        t, c = self.t.tasks, self.t.concurrency
        batch = limit or self.config.retention_batch_size

        def used(name: Any, key: Any) -> ColumnElement[bool]:
            running = select(t.c.id).where(t.c.name == name, t.c.slot_key == key, *_running(t))
            marked = select(t.c.id).where(
                t.c.name == name,
                t.c.slot_key == key,
                t.c.slot.is_not(None),
                t.c.state.in_([State.PENDING.value, State.WAIT_MANUAL.value]),
            )
            return or_(running.exists(), marked.exists())

        idle = and_(
            c.c.updated_at < after(db_now(), -KEY_IDLE_FOR),
            or_(c.c.next_start_at.is_(None), c.c.next_start_at < db_now()),
            not_(used(c.c.name, c.c.key)),
        )
        found = select(c.c.name, c.c.key).where(idle).limit(batch)
        # a read first: a store with no idle key (the usual case) opens no transaction
        keys = [(str(r.name), str(r.key)) for r in self._read(lambda conn: conn.execute(found))]
        if not keys:
            return 0

        def op(conn: Connection, _: bool) -> int:
            mine = keys
            if self.is_pg:
                # only the keys locked here: a DELETE that waited for a claim's lock would
                # judge the key by a snapshot older than that claim's waiting mark
                lock = select(c.c.name, c.c.key).where(tuple_(c.c.name, c.c.key).in_(keys))
                rows = conn.execute(lock.with_for_update(skip_locked=True)).all()
                mine = [(str(r.name), str(r.key)) for r in rows]
                if not mine:
                    return 0
            # locked: checked again in a statement of its own, then deleted
            stmt = delete(c).where(tuple_(c.c.name, c.c.key).in_(mine), idle)
            return int(conn.execute(stmt).rowcount)

        return int(self._tx(op))

    def slot_usage(self, *, name: str | None = None, limit: int = 1000) -> list[SlotUsage]:
        """Each limited task and key seen: its limit, slots in use, rows waiting, and
        the submission time of the oldest waiting row (``lease stats``, the metrics)."""
        t, c = self.t.tasks, self.t.concurrency

        def count(*where: Any) -> Any:
            return (
                select(func.count())
                .where(t.c.name == c.c.name, t.c.slot_key == c.c.key, *where)
                .scalar_subquery()
            )

        oldest = (
            select(func.min(t.c.created_at))
            .where(t.c.name == c.c.name, t.c.slot_key == c.c.key, *_queued(t, WAITING))
            .scalar_subquery()
        )
        q = select(
            c.c.name,
            c.c.key,
            c.c.max_slots,
            # the runs holding a slot: RUNNING rows, and overruns still running
            (
                holders(t.alias("holder"), self.t.workers, c.c.name, c.c.key)
                - count(*_queued(t, GRANTED))
            ).label("running"),
            count(*_queued(t, GRANTED)).label("granted"),
            count(*_queued(t, WAITING)).label("waiting"),
            oldest.label("oldest"),
            seconds_between(db_now(), oldest).label("age"),
        )
        q = q.where(c.c.max_slots > 0)  # not the keys of a rate limit alone
        if name is not None:
            q = q.where(c.c.name == name)
        q = q.order_by(c.c.name, c.c.key).limit(limit)
        rows = self._read(lambda conn: conn.execute(q).all())
        out = []
        for r in rows:
            oldest_at: datetime | None = r.oldest
            out.append(
                SlotUsage(
                    str(r.name),
                    str(r.key),
                    int(r.max_slots),
                    int(r.running),
                    int(r.granted),
                    int(r.waiting),
                    oldest_at,
                    float(r.age) if r.age is not None else None,
                )
            )
        return out

    def waiting_rows(self, *, name: str | None = None, limit: int = 100) -> list[Waiting]:
        """The rows waiting for a slot, oldest first per task and key (``lease list
        --waiting``)."""
        t = self.t.tasks
        q = select(t.c.id, t.c.name, t.c.slot_key, t.c.created_at, t.c.reason).where(
            *_queued(t, WAITING)
        )
        if name is not None:
            q = q.where(t.c.name == name)
        q = q.order_by(t.c.name, t.c.slot_key, t.c.created_at, t.c.id).limit(limit)
        rows = self._read(lambda conn: conn.execute(q).all())
        return [
            Waiting(str(r.id), str(r.name), str(r.slot_key), r.created_at, r.reason) for r in rows
        ]


__all__ = [
    "GRANTED",
    "OVERRUN",
    "PACED",
    "WAITING",
    "Slots",
    "holders",
    "paced_reason",
    "waiting_reason",
]
