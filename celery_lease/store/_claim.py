"""Execution's start and progress: the claim (PENDING -> RUNNING with the next attempt and
a fresh token, or the adoption of a message that has no row), claims in batches, and the
fenced writes of a running task (steps, progress, lease checks).

Claims in batches are the deliveries a worker took from the broker together, claimed in
one statement by its lease agent (see :mod:`celery_lease.worker.main.agent`). Only the
common case is batched: a PENDING row that is due, whose task retries by itself on a
lost lease (``on_timeout = 'retry'``) and has no ``max_runtime`` (a row claimed ahead
waits for a free pool process, and that wait must not count against a runtime limit). A
delivery the batch does not claim (no row, not due, a copy of a running task, a paused
or manual task, or a race) is claimed by its pool process exactly as without batching,
which adopts it, drops it or publishes it again. On PostgreSQL the batch is one ``UPDATE
... FROM unnest(...)`` with the audit rows inserted by a data-modifying CTE over the
updated rows; on SQLite one transaction.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Float,
    Integer,
    Row,
    String,
    and_,
    bindparam,
    case,
    column,
    func,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY

from ..states import STEP_DONE as DONE
from ..states import STEP_STARTED as STARTED
from ..states import State
from ._base import state_is
from ._slots import KEY_IDLE_FOR, PACED, Slots, holders, paced_reason, waiting_reason
from ._types import (
    Claim,
    FenceResult,
    Lease,
    NewTask,
    RecordedStep,
    Refusal,
    Slot,
    TransitionEvent,
)
from .schema import after, db_now, greatest

#: Note for rows whose arguments could not be stored: they cannot be re-published.
_NO_ARGS_NOTE = "arguments could not be stored as JSON: recovery needs a person"


#: Seconds by which a start reserved on time may follow the key's last start by less
#: than an interval: the rounding of a time plus an interval, minus it again (SQLite
#: keeps times as floats of seconds: about a microsecond; PostgreSQL's are exact).
_SLACK = 0.00001

#: What a delivery claimed ahead is: (task id, the fresh token of its claim).
Ask = tuple[str, str]


class Claims(Slots):
    """Claims, one or many, and the fenced writes of a running task."""

    # -- claims ----------------------------------------------------------------------------

    def claim(
        self,
        task_id: str,
        owner: str,
        actor: str,
        adopt: NewTask | Callable[[], NewTask] | None = None,
        revision: str | None = None,
        slot: Slot | None = None,
    ) -> Claim | Refusal:
        """Compare-and-set PENDING -> RUNNING (attempt += 1). A delivery without a row is
        adopted when ``adopt`` describes it (or builds it: only called when needed);
        anything else is refused.

        ``revision``: the one the delivered message carries (``None``: none). A row
        whose arguments were replaced (``on_conflict="replace"``) is claimed only by a
        message of its current revision; an older message is refused as stale.

        ``slot``: the task's concurrency limit and this delivery's key. The claim then
        takes the key's lock and its compare-and-set also counts the slots in use below
        the limit; a row that only the count stops waits for a slot (refused with
        ``waiting``; see :mod:`celery_lease.store._slots`). Without it the claim is
        exactly as for an unlimited task."""
        t = self.t.tasks
        token = uuid.uuid4().hex
        reason = f"claimed by {actor}"
        params: dict[str, Any] = {
            "b_task_id": task_id,
            "b_token": token,
            "b_owner": owner,
            "b_revision": revision,
        }

        def claimed(r: Row[Any], adopted: bool) -> Claim:
            return Claim(
                lease=Lease(task_id, int(r.attempt), token),
                retries=int(r.retries),
                recoveries=int(r.recoveries),
                resumed=adopted or int(r.attempt) > 1,
                cancel_requested=r.cancel_requested_at is not None,
            )

        if slot is not None:
            params.update({"b_slot_name": slot.name, "b_slot_key": slot.key, "b_limit": slot.limit})
            if slot.interval is not None:
                params["b_interval"] = slot.interval

        if slot is None:
            kind, spec = "claim", self._claim_spec
        elif slot.interval is None:
            kind, spec = "claim-slot", self._claim_slot_spec
        elif slot.limit > 0:
            kind, spec = "claim-slot-rate", self._claim_slot_rate_spec
        else:
            kind, spec = "claim-rate", self._claim_rate_spec

        def move(conn: Connection) -> list[Row[Any]]:
            return self._move_prepared(
                conn, kind, spec, params, State.PENDING, State.RUNNING, reason=reason, actor=actor
            )

        def waits(conn: Connection) -> Refusal | None:
            """Only the key's next start, or its slot count, stopped a claim that should
            have moved the row: it is paced, or it waits for a slot."""
            if slot is not None and slot.interval is not None:
                paced = self._pace(conn, task_id, slot, params["b_now"])
                if paced is not None:
                    return paced
            if slot is None or slot.limit <= 0 or not self.mark_waiting(conn, task_id, slot):
                return None
            return Refusal(task_id, State.PENDING, waiting_reason(slot), waiting=True)

        def fast(conn: Connection, _: bool) -> Claim | Refusal | None:
            # the claim, its audit row and, when it fails, the row's state: one statement
            # (a limited claim: with the key's lock; see _claim_slot_pg)
            if slot is None:
                stmt = self._prepared("claim-pg", self._claim_pg)
            else:
                stmt = self._prepared("claim-slot-pg", self._claim_slot_pg)
            row = conn.execute(stmt, {**params, "b_reason": reason, "b_actor": actor}).first()
            if row is None:
                return None  # no row: adopt it, or refuse, in a transaction
            if row.attempt is not None:
                self._record_event(
                    TransitionEvent(
                        task_id, row.name, State.PENDING, State.RUNNING, reason, actor, row.attempt
                    )
                )
                return claimed(row, False)
            if row.state == State.PENDING.value or row.token == token:
                # not due yet, or a claim that raced this one (the snapshot predates it),
                # or our own first try whose answer was lost, or (a limited claim) no slot
                # free or another take of the key since the snapshot: decided in a
                # transaction
                return None
            state = State(row.state)
            return Refusal(task_id, state, f"task is {state}")

        def op(conn: Connection, is_retry: bool) -> Claim | Refusal:
            reserved = None  # the start reserved for the row, if it was paced
            if slot is not None:
                self.lock_slot(conn, slot)
                if slot.interval is not None:
                    reserved, params["b_now"] = self._reserved(conn, task_id)
            rows = move(conn)
            started = bool(rows)  # moved here (not our own first try's answer, lost)
            adopted = False
            if not rows:
                due = self._claim_spec()[0][1]
                row = conn.execute(
                    select(t.c.state, t.c.token, ~due.self_group(), t.c.revision).where(
                        t.c.id == task_id
                    )
                ).first()
                if (
                    row is not None
                    and row.state == State.PENDING.value
                    and row.revision is not None
                    and row.revision != revision
                ):
                    return Refusal(
                        task_id,
                        State.PENDING,
                        "a stale message: the task's arguments were replaced by a later "
                        "submission with the same dedup key",
                    )
                if row is not None and row.state == State.PENDING.value and row[2]:
                    return Refusal(task_id, State.PENDING, "arrived before its ETA", early=True)
                if row is not None and row.state == State.PENDING.value:
                    # its ETA came between the claim and the read (a retry is delivered
                    # at its ETA, to the millisecond): claim it now
                    rows = move(conn)
                    started = bool(rows)
                    if not rows and (waiting := waits(conn)) is not None:
                        return waiting
                elif row is None and adopt is not None:
                    tomb = self.t.purged
                    if conn.execute(select(tomb.c.id).where(tomb.c.id == task_id)).first():
                        # a tombstone: its row was purged, a late message is refused
                        return Refusal(
                            task_id,
                            None,
                            "its row was purged after the task ended: a late message is "
                            "not adopted",
                        )
                    self._adopt(conn, adopt() if callable(adopt) else adopt)
                    adopted = True
                    rows = move(conn)  # an adopted row has no ETA: due at once
                    started = bool(rows)
                    if not rows and (waiting := waits(conn)) is not None:
                        return waiting
                elif row is not None and is_retry and row.token == token:
                    # the first try committed but its answer was lost
                    again = select(t.c.id, t.c.attempt, *self._claim_spec()[2]).where(
                        t.c.id == task_id
                    )
                    rows = list(conn.execute(again))
                if not rows:
                    state = State(row.state) if row is not None else None
                    why = "no row for this message" if row is None else f"task is {state}"
                    return Refusal(task_id, state, why)
            if started and slot is not None and slot.interval is not None:
                self._record_start(conn, slot, reserved)
            return claimed(rows[0], adopted)

        if not self.is_pg or (slot is not None and (slot.interval is not None or slot.limit <= 0)):
            return self._tx(op)
        return self._single_then(fast, op)

    def _claim_spec(
        self,
    ) -> tuple[list[ColumnElement[bool]], dict[str, Any], tuple[Any, ...]]:
        """Where, values and returning of a claim, with bind parameters ``b_task_id``,
        ``b_token`` and ``b_owner``."""
        t = self.t.tasks
        # a message that arrives before its ETA by database time (a worker whose clock
        # runs ahead) is not claimed: it is published again with the remaining delay
        due = or_(t.c.eta.is_(None), t.c.eta <= db_now())
        values = {
            "attempt": t.c.attempt + 1,
            "token": bindparam("b_token", type_=t.c.token.type),
            "owner": bindparam("b_owner", type_=t.c.owner.type),
            "started_at": db_now(),
            "progress_at": db_now(),
            "finished_at": None,
            "next_retry_at": None,
            # a replaced row's revision served its purpose: the claimed message was current
            "revision": None,
        }
        # a replaced row (on_conflict="replace") only by a message of its revision
        current = or_(
            t.c.revision.is_(None),
            t.c.revision == bindparam("b_revision", type_=t.c.revision.type),
        )
        where = [t.c.id == bindparam("b_task_id", type_=t.c.id.type), due, current]
        return where, values, (t.c.retries, t.c.recoveries, t.c.cancel_requested_at)

    def _claim_slot_spec(
        self, unseen: ColumnElement[int] | None = None
    ) -> tuple[list[ColumnElement[bool]], dict[str, Any], tuple[Any, ...]]:
        """The claim of a limited task (bind parameters ``b_slot_name``, ``b_slot_key``,
        ``b_limit`` besides the claim's): it moves the row only while the slots in use
        under the key are fewer than the limit, and records the key the row counts under.
        ``unseen``: at most how many slots were taken that the count cannot see."""
        t = self.t.tasks
        where, values, returning = self._claim_spec()
        name = bindparam("b_slot_name", type_=t.c.name.type)
        key = bindparam("b_slot_key", type_=t.c.slot_key.type)
        exclude = bindparam("b_task_id", type_=t.c.id.type)
        used = holders(t, self.t.workers, name, key, exclude=exclude)
        if unseen is not None:
            used = used + unseen
        where = [*where, used < bindparam("b_limit", type_=Integer)]
        values = {**values, "slot_key": key, "slot": None}
        return where, values, returning

    def _rate_spec(
        self, spec: tuple[list[ColumnElement[bool]], dict[str, Any], tuple[Any, ...]]
    ) -> tuple[list[ColumnElement[bool]], dict[str, Any], tuple[Any, ...]]:
        """``spec`` for a task with a ``global_rate_limit`` (bind parameter
        ``b_interval`` besides the slot's): the row moves only when it may start now
        (see :meth:`_may_start`)."""
        t = self.t.tasks
        where, values, returning = spec
        name = bindparam("b_slot_name", type_=t.c.name.type)
        key = bindparam("b_slot_key", type_=t.c.slot_key.type)
        return [*where, self._may_start(t, name, key)], values, returning

    def _may_start(self, t: Any, name: Any, key: Any) -> ColumnElement[bool]:
        """Whether a row of (``name``, ``key``) may start now (bind parameters
        ``b_interval`` and ``b_now``, the claim's time, read once under the key's lock:
        whether the key is idle only ever turns true as the clock moves on, so the
        claim's statements must agree on it, or a delivery could be found neither
        startable nor to pace). Each start owns one
        interval of the key's timeline, from the time it records
        (``concurrency.last_start_at``, see :meth:`_record_start`). A row starts:

        * **when the key is idle**: its last start's interval has ended. Any delivery
          does: a fresh one, or one paced earlier that comes late (a backlog of
          deliveries ahead of it, a worker stopped), so that an interval a late
          delivery left without a start is filled, not lost to the rate;
        * **on time for the start reserved for it** (paced: its ETA, which every
          claim's ``WHERE`` requires to have come, passed less than an interval ago)
          when no start took its interval: the key's last start is an interval before
          its own at least.

        Any other delivery is paced (again): given the key's next free start. So late
        deliveries that come together start one an interval, never in a burst, and
        since the times the starts record are an interval apart at least, and each
        start comes at most an interval after its own, any window of ``k``
        intervals holds at most ``k + 1`` starts. (A key whose last start is not known,
        written before schema version 15, is idle once its next start has come.)"""
        c = self.t.concurrency
        interval = bindparam("b_interval", type_=Float)
        now = bindparam("b_now", type_=t.c.eta.type)
        since = after(now, -interval)
        last = c.c.last_start_at
        mine = and_(c.c.name == name, c.c.key == key)
        busy = or_(
            last > since,
            and_(last.is_(None), c.c.next_start_at > now),
        )
        idle = ~select(c.c.name).where(mine, busy).exists()
        # (a little slack: SQLite's times are floats, and a start reserved an interval
        # after another is that one plus the interval)
        taken = select(c.c.name).where(mine, last > after(t.c.eta, _SLACK - interval)).exists()
        # on time by the statement's own time: it only ever turns false as the clock
        # moves on, and a start taken on time comes at most an interval after its own
        on_time = and_(t.c.slot == PACED, t.c.eta > after(db_now(), -interval), ~taken)
        return or_(idle, on_time)

    def _claim_slot_rate_spec(
        self,
    ) -> tuple[list[ColumnElement[bool]], dict[str, Any], tuple[Any, ...]]:
        """A task with a concurrency limit and a rate limit: both hold."""
        return self._rate_spec(self._claim_slot_spec())

    def _claim_rate_spec(
        self,
    ) -> tuple[list[ColumnElement[bool]], dict[str, Any], tuple[Any, ...]]:
        """A task with a rate limit only: it holds no slot (its RUNNING rows count
        under no key, so their ends free nothing), and a reservation is cleared."""
        where, values, returning = self._rate_spec(self._claim_spec())
        return where, {**values, "slot": None, "slot_key": None}, returning

    def _reserved(self, conn: Connection, task_id: str) -> tuple[datetime | None, datetime]:
        """The start reserved for ``task_id`` (its ETA) if it is paced, else ``None``,
        and the database's time: read under its key's lock, which every change of
        them takes. That time is the claim's "now" for the rate (see
        :meth:`_may_start`)."""
        t = self.t.tasks
        eta = select(t.c.eta).where(t.c.id == task_id, t.c.slot == PACED).scalar_subquery()
        reserved, now = conn.execute(select(eta, db_now())).one()
        return reserved, now

    def _record_start(self, conn: Connection, slot: Slot, reserved: datetime | None) -> None:
        """A claim started the task (under its key's lock); ``reserved``: the start
        reserved for it (the row's ETA, if it was paced). The key's last start becomes
        the time this start owns an interval from (see :meth:`_may_start`):

        * a reserved start taken on time, in an interval no other start took: the
          reserved time, so that the starts reserved after it keep their beat;
        * a start in an idle key: the end of the last start's interval when it came
          within an interval of it, else an interval ago. The beat goes on through
          deliveries that come a little late instead of drifting later by each delay
          (an interval left without a start is lost to the rate), and a start still
          comes at most an interval after the time it records, so any ``k``
          intervals hold at most ``k + 1`` starts.

        Its next start (the first not given out) is at least an interval after now; one
        further on stays as it is: the starts given out keep their times. "Now" is the
        database's time at this statement, after the claim's audit row: a key's first
        start and its next free start count from it, so no start comes before its turn
        by the time the statements of this claim took."""
        c = self.t.concurrency
        assert slot.interval is not None
        soonest = after(db_now(), slot.interval)
        last = c.c.last_start_at
        beat = greatest(
            func.coalesce(after(last, slot.interval), db_now()),
            after(db_now(), -slot.interval),
        )
        at: Any = beat
        if reserved is not None:
            eta = bindparam("b_reserved", reserved, type_=self.t.tasks.c.eta.type)
            on_time = and_(
                eta > after(db_now(), -slot.interval),
                or_(last.is_(None), last <= after(eta, _SLACK - slot.interval)),
            )
            at = case((on_time, eta), else_=beat)
        conn.execute(
            update(c)
            .where(c.c.name == slot.name, c.c.key == slot.key)
            .values(
                last_start_at=at,
                next_start_at=greatest(func.coalesce(c.c.next_start_at, soonest), soonest),
            )
        )

    def _pace(self, conn: Connection, task_id: str, slot: Slot, now: datetime) -> Refusal | None:
        """A PENDING row that may not start now (:meth:`_may_start`: a start was taken
        within the last interval, and it has no start of its own on time): the key's
        next start is reserved for it (its ETA; the key's next start moves one interval on),
        and its delivery is acked. Published again at once (due then), or held in the
        store when the start is more than ``lease_hold_eta_after`` away. ``None``: the row
        is not PENDING, or may start now (the claim failed for another reason)."""
        t, c = self.t.tasks, self.t.concurrency
        assert slot.interval is not None
        may = self._may_start(t, slot.name, slot.key).label("may")
        row = conn.execute(
            select(t.c.state, may).where(t.c.id == task_id),
            {"b_interval": slot.interval, "b_now": now},
        ).first()
        if row is None or row.state != State.PENDING.value or row.may:
            return None
        start = conn.execute(
            select(c.c.next_start_at).where(c.c.name == slot.name, c.c.key == slot.key)
        ).scalar()
        if start is None or start <= now:
            # not given out since a start within the last interval (a key migrated from
            # schema version 14, whose last start is not known): the next one after it
            start = now + timedelta(seconds=slot.interval)
        conn.execute(
            update(c)
            .where(c.c.name == slot.name, c.c.key == slot.key)
            .values(
                next_start_at=after(bindparam("b_start", start, type_=t.c.eta.type), slot.interval)
            )
        )
        delay = (start - now).total_seconds()
        hold = self.config.hold_eta_after is not None and delay > self.config.hold_eta_after
        why = paced_reason(slot, start)
        conn.execute(
            update(t)
            .where(t.c.id == task_id, state_is(t, State.PENDING))
            .values(
                slot=PACED,
                slot_key=slot.key,
                eta=start,
                held=hold,
                reason=why,
                updated_at=db_now(),
            )
        )
        return Refusal(task_id, State.PENDING, why, paced=True, held=hold)

    def _claim_pg(self) -> Any:
        return self._claim_one_pg(*self._claim_spec())

    def _claim_one_pg(
        self,
        where: list[ColumnElement[bool]],
        values: dict[str, Any],
        returning: tuple[Any, ...],
        *ctes: Any,
    ) -> Any:
        """PostgreSQL: a claim and its audit row in one statement (``ctes``: what its
        ``where`` also reads). One row per existing task: the claim's answer, or (claim
        refused) the state the statement's snapshot saw; no row when the task has none."""
        t = self.t.tasks
        update_stmt = self._move_update(where, State.PENDING, State.RUNNING, values, returning)
        moved, audit = self._move_ctes(update_stmt, State.PENDING, State.RUNNING)
        row = t.alias("row")
        stmt = (
            select(
                moved.c.attempt,
                moved.c.name,
                moved.c.retries,
                moved.c.recoveries,
                moved.c.cancel_requested_at,
                row.c.state,
                row.c.token,
            )
            .select_from(row.outerjoin(moved, true()))
            .where(row.c.id == bindparam("b_task_id", type_=t.c.id.type))
        )
        for cte in ctes:
            stmt = stmt.add_cte(cte)
        return stmt.add_cte(audit)

    def _claim_slot_pg(self) -> Any:
        """PostgreSQL: a limited claim (concurrency limit, no rate) in one statement.

        A statement reads one snapshot, taken before it waits for the key's lock, so
        its count of the slots in use misses the takes committed while it waited. The
        key's ``changes`` bounds them: every claim of the key adds one to it under the
        lock, a grant one per slot it gives, a waiting mark :data:`~._slots.MARK`
        (:meth:`lock_slot`, :meth:`_grant`, :meth:`mark_waiting`). The statement
        takes the lock with that upsert, which returns the newest count (after the
        wait), so the changes committed between its snapshot and its lock are that
        count less one less its snapshot's: it moves the row only if the slots its
        snapshot counts, plus those changes (each at most one take), are fewer than
        the limit. A free committed meanwhile only makes the count one too high, which
        can refuse a claim, never let one through. So a limit far from reached needs
        no transaction however many claims of the key meet; any other answer (the key
        full or nearly, the row not due, no row) is decided by the transaction of
        :meth:`claim`, as before."""
        c = self.t.concurrency
        lock = self._lock_slot_statement().returning(c.c.changes).cte("slot_lock")
        name = bindparam("b_slot_name", type_=String)
        key = bindparam("b_slot_key", type_=String)
        # A key unused for KEY_IDLE_FOR has its row deleted by the purge, and the next
        # claim makes it again with a count that starts over, lower than the one this
        # snapshot may have seen: only a row used within half that time is compared
        # (the purge cannot delete it while this statement waits); with an older one,
        # or none, the count is NULL, the row does not move, the transaction decides.
        recent = c.c.updated_at > after(db_now(), -KEY_IDLE_FOR / 2)
        seen = select(c.c.changes).where(c.c.name == name, c.c.key == key, recent).scalar_subquery()
        unseen = select(lock.c.changes).scalar_subquery() - seen - 1
        return self._claim_one_pg(*self._claim_slot_spec(unseen), lock)

    def _adopt(self, conn: Connection, new: NewTask) -> None:
        t = self.t.tasks
        stmt = (
            self._insert(t)
            .values(
                id=new.id,
                name=new.name,
                state=State.PENDING.value,
                args=new.args,
                kwargs=new.kwargs,
                options=new.options,
                message=new.message,
                lease_ttl=new.lease_ttl,
                max_runtime=new.max_runtime,
                max_retries=new.max_retries,
                on_timeout=new.on_timeout if new.args is not None else "manual",
                on_exhausted=new.on_exhausted,
                max_recoveries=new.max_recoveries,
                created_at=db_now(),
                updated_at=db_now(),
                published_at=db_now(),
                reason="adopted",
            )
            .on_conflict_do_nothing()
            .returning(t.c.id)
        )
        if conn.execute(stmt).scalar() is not None:
            reason = "adopted: message without a row"
            if new.args is None:
                reason += f" ({_NO_ARGS_NOTE})"
            self._audit(conn, new.id, None, State.PENDING, reason, "worker", 0)

    def claim_many(self, asks: Sequence[Ask], owner: str, actor: str) -> dict[str, Claim]:
        """Compare-and-set PENDING -> RUNNING (attempt += 1) of every eligible row of
        ``asks`` in one statement; the claims made, by token. Several asks of one task
        id claim it once: only the ask whose token the row took is answered."""
        if not asks:
            return {}
        reason = f"claimed ahead by {actor}"

        def op(conn: Connection, _: bool) -> list[Any]:
            if self.is_pg:
                stmt = self._prepared("claim_many", self._claim_many_pg)
                params = {
                    "b_ids": [a[0] for a in asks],
                    "b_tokens": [a[1] for a in asks],
                    "b_owner": owner,
                    "b_reason": reason,
                    "b_actor": actor,
                }
                rows = conn.execute(stmt, params).all()
                for r in rows:
                    self._record_event(
                        TransitionEvent(
                            r.id, r.name, State.PENDING, State.RUNNING, reason, actor, r.attempt
                        )
                    )
                return list(rows)
            rows = []
            for task_id, token in asks:
                rows += self._move_prepared(
                    conn,
                    "claim-ahead",
                    self._claim_ahead_spec,
                    {"b_task_id": task_id, "b_token": token, "b_owner": owner},
                    State.PENDING,
                    State.RUNNING,
                    reason=reason,
                    actor=actor,
                )
            return rows

        rows = self._tx(op, single=self.is_pg)
        return {
            str(r.token): Claim(
                lease=Lease(str(r.id), int(r.attempt), str(r.token)),
                retries=int(r.retries),
                recoveries=int(r.recoveries),
                resumed=int(r.attempt) > 1,
                cancel_requested=r.cancel_requested_at is not None,
            )
            for r in rows
        }

    def unclaim(self, lease: Lease, owner: str, actor: str, reason: str) -> bool:
        """Give back a claim made ahead whose delivery never reached a pool process
        (none of the task's code ran): its lease ends (RUNNING -> TIMEOUT) and the row
        is retried at once (TIMEOUT -> RETRY_WAIT, due now: the reaper publishes it
        again) with no recovery counted, so that ``max_recoveries`` is spent on lost
        runs only (the attempt, a count of claims that never goes back, keeps the
        one the claim added). Fenced by
        owner, attempt and token; a row whose cancel was requested is left RUNNING
        (the lease's expiry decides it). ``False``: nothing changed."""
        t = self.t.tasks
        where = [
            t.c.id == lease.task_id,
            t.c.owner == owner,
            t.c.attempt == lease.attempt,
            t.c.token == lease.token,
            t.c.cancel_requested_at.is_(None),
        ]
        why = f"{reason} (none of its code ran: no recovery counted)"

        def op(conn: Connection, _: bool) -> bool:
            ended = self._move(
                conn,
                where,
                State.RUNNING,
                State.TIMEOUT,
                reason=why,
                actor=actor,
                values={"token": None},
            )
            if not ended:
                return False
            self._move(
                conn,
                [t.c.id == lease.task_id],
                State.TIMEOUT,
                State.RETRY_WAIT,
                reason=f"retried at once: {reason}",
                actor=actor,
                values={"next_retry_at": db_now()},
            )
            return True

        return self._tx(op)

    def _claim_ahead_spec(self) -> tuple[list[Any], dict[str, Any], tuple[Any, ...]]:
        """Where, values and returning of one claim made ahead (bind parameters
        ``b_task_id``, ``b_token``, ``b_owner``): the claim's, for eligible rows only."""
        t = self.t.tasks
        where, values, returning = self._claim_spec()
        # a delivery with a revision is never claimed ahead (see LeaseAgent.reserved):
        # an ask stands for a message without one, which a replaced row refuses
        where = [*where[:2], t.c.revision.is_(None)]
        return [*where, *_eligible(t)], values, (*returning, t.c.token)

    def _claim_many_pg(self) -> Any:
        t = self.t.tasks
        where, values, returning = self._claim_ahead_spec()
        v = (
            func.unnest(
                bindparam("b_ids", type_=ARRAY(String)),
                bindparam("b_tokens", type_=ARRAY(String)),
            )
            .table_valued(column("id", String), column("token", String))
            .render_derived(name="v")
        )
        # the single claim's where and values, with the id and token from the arrays
        where = [w for w in where if not _names_task_id(w)] + [t.c.id == v.c.id]
        values = {**values, "token": v.c.token}
        stmt = self._move_update(where, State.PENDING, State.RUNNING, values, returning)
        moved, audit = self._move_ctes(stmt, State.PENDING, State.RUNNING)
        return select(moved).add_cte(audit)

    # -- a running task's fenced writes: steps, progress -----------------------------------

    def fence(
        self,
        lease: Lease,
        conn: Connection,
        *,
        progress: str | None = None,
        set_progress: bool = False,
    ) -> FenceResult | None:
        """Check the lease inside a write transaction and count it as progress.

        ``None``: the lease is lost. Otherwise says whether a cancel was requested.
        """
        t = self.t.tasks
        values: dict[str, Any] = {"progress_at": db_now()}
        if set_progress:
            values["progress"] = progress
        row = conn.execute(
            update(t)
            .where(
                *self._fenced(lease), t.c.state.in_([State.RUNNING.value, State.WAIT_MANUAL.value])
            )
            .values(**values)
            .returning(t.c.cancel_requested_at, t.c.cancel_reason)
        ).first()
        if row is None:
            return None
        return FenceResult(row.cancel_requested_at is not None, row.cancel_reason)

    def check_lease(self, lease: Lease) -> FenceResult | None:
        """Read-only lease check (for ``check_cancelled``)."""
        t = self.t.tasks

        def op(conn: Connection) -> FenceResult | None:
            row = conn.execute(
                select(t.c.cancel_requested_at, t.c.cancel_reason).where(
                    *self._fenced(lease),
                    t.c.state.in_([State.RUNNING.value, State.WAIT_MANUAL.value]),
                )
            ).first()
            if row is None:
                return None
            return FenceResult(row.cancel_requested_at is not None, row.cancel_reason)

        return self._read(op)

    def load_steps(self, task_id: str) -> dict[str, RecordedStep]:
        """Every recorded step of a task, by name."""
        s = self.t.steps
        return self._read(
            lambda conn: {
                row.name: RecordedStep(row.state, row.result, int(row.attempt))
                for row in conn.execute(
                    select(s.c.name, s.c.state, s.c.result, s.c.attempt).where(
                        s.c.task_id == task_id
                    )
                )
            }
        )

    def step_started(self, lease: Lease, name: str, *, checkable: bool) -> FenceResult | None:
        """Record that a non-idempotent step is about to call out (fenced).

        ``None``: the lease is lost and nothing was written. With a cancel requested
        nothing is recorded either: the caller stops before calling out.
        """
        s = self.t.steps

        def op(conn: Connection, _: bool) -> FenceResult | None:
            fenced = self.fence(lease, conn)
            if fenced is None or fenced.cancel_requested:
                # a STARTED row for a call never made would read "outcome unknown"
                return fenced
            values: dict[str, Any] = {
                "state": STARTED,
                "idempotent": False,
                "checkable": checkable,
                "attempt": lease.attempt,
                "started_at": db_now(),
            }
            conn.execute(
                self._insert(s)
                .values(task_id=lease.task_id, name=name, **values)
                .on_conflict_do_update(
                    index_elements=[s.c.task_id, s.c.name],
                    set_=values,
                    where=s.c.state != DONE,
                )
            )
            return fenced

        return self._tx(op)

    def step_done(
        self, lease: Lease, name: str, result: str, *, idempotent: bool
    ) -> tuple[FenceResult | None, str]:
        """Store a step's result, first writer wins (fenced).

        Returns the fence answer (``None``: lease lost, nothing written) and the stored
        result, which is the earlier one if the step was already done.
        """
        s = self.t.steps

        def op(conn: Connection, _: bool) -> tuple[FenceResult | None, str]:
            fenced = self.fence(lease, conn)
            if fenced is None:
                return None, result
            values: dict[str, Any] = {
                "state": DONE,
                "result": result,
                "attempt": lease.attempt,
                "finished_at": db_now(),
            }
            stored = conn.execute(
                self._insert(s)
                .values(
                    task_id=lease.task_id,
                    name=name,
                    idempotent=idempotent,
                    started_at=db_now(),
                    **values,
                )
                .on_conflict_do_update(
                    index_elements=[s.c.task_id, s.c.name],
                    set_=values,
                    where=s.c.state != DONE,
                )
                .returning(s.c.result)
            ).scalar()
            if stored is None:  # already done by an earlier attempt: keep the first result
                stored = conn.execute(
                    select(s.c.result).where(s.c.task_id == lease.task_id, s.c.name == name)
                ).scalar_one()
            return fenced, str(stored)

        return self._tx(op)

    def save_progress(self, lease: Lease, value: str) -> FenceResult | None:
        """Store the task's progress cursor (fenced); ``None``: lease lost."""
        return self._tx(lambda conn, _: self.fence(lease, conn, progress=value, set_progress=True))

    def load_progress(self, task_id: str) -> str | None:
        t = self.t.tasks
        return self._read(
            lambda conn: conn.execute(select(t.c.progress).where(t.c.id == task_id)).scalar()
        )


def _eligible(t: Any) -> list[Any]:
    return [t.c.max_runtime.is_(None), t.c.on_timeout == "retry"]


def _names_task_id(clause: Any) -> bool:
    """Whether ``clause`` is the single claim's ``id = :b_task_id``."""
    right = getattr(clause, "right", None)
    return getattr(right, "key", None) == "b_task_id"
