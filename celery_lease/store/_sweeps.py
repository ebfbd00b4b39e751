"""The reaper's sweeps, each one bounded batch per transaction: expired leases and
overruns (RUNNING -> TIMEOUT and what the policy decides), what to publish again (due
retries, rows never published or whose message was lost, follow-ups never sent, rows
held because the broker still queues their message), and the worker rows with the
named lock the embedded reapers share.

The row is the outbox: a PENDING row is published sooner or later.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    and_,
    delete,
    false,
    literal_column,
    not_,
    or_,
    select,
    true,
    tuple_,
    update,
)
from sqlalchemy.sql.expression import ColumnElement as _CE  # noqa: F401

from .. import policy
from ..config import MAX_SECONDS
from ..states import STEP_STARTED, State
from ._base import StoreBase, state_is
from ._slots import OVERRUN
from ._types import Expiry, FollowUps, Held, Lease, Peer, Publishable
from .schema import (
    after,
    db_now,
    lease_expired,
    message_lost,
    never_published,
    published_by,
    seconds_between,
)

#: The timestamp a destination of an expiry sets to the database's time.
_STAMPS = {State.RETRY_WAIT: "next_retry_at", State.CANCELLED: "finished_at"}


def reaper_lock_name(origin: str | None) -> str:
    """The embedded reaper's lock for the apps of one broker (``origin``): one per broker,
    so that each app's reaper sweeps, and publishes its own rows, whoever holds the
    others' lock."""
    if origin is None:
        return "reaper"
    return "reaper:" + hashlib.sha256(origin.encode()).hexdigest()[:24]


class Sweeps(StoreBase):
    """Expiry, overruns, re-publishing, backlog, follow-ups; worker rows and the lock."""

    # -- expired leases and overruns -------------------------------------------------------

    def expire(
        self,
        *,
        actor: str,
        reason: str,
        task_ids: Sequence[str] | None = None,
        owners: Sequence[str] | None = None,
        attempt: int | None = None,
        claimed_before: float | None = None,
        only_expired: bool = True,
        limit: int | None = None,
    ) -> list[Expiry]:
        """RUNNING -> TIMEOUT -> RETRY_WAIT (due now) or WAIT_MANUAL, per the policy.

        Selects RUNNING rows (optionally only those of ``task_ids``/``owners``, and only
        the execution of that ``attempt``, when the caller knows which one it lost; with
        ``only_expired``, only those whose owner's heartbeat is older than their TTL),
        at most ``limit`` (a batch), skipping rows another reaper holds.

        ``claimed_before``: a moment of this process's ``time.monotonic()``; only a row
        claimed before it is selected (a worker that lost an execution without knowing
        its attempt: a claim made after it saw the loss is a later execution, which
        this expiry must not cut short). The moment's age is taken as the statement is
        built and subtracted from the database's own time in the statement, so the
        fence is in database time (the row's ``started_at``, written by its claim) and
        costs the claims nothing. It assumes the database's clock runs steadily over
        that age: one stepped back by more than the lost execution's age meanwhile (a
        failover to a server whose clock is that far behind) leaves that row RUNNING
        until its worker stops, which expires every lease it holds.

        A batch is decided together, in one transaction: one read of the candidates,
        one fenced ``RUNNING -> TIMEOUT`` of them all, one read of their steps in flight,
        the policy's decision for each row, and one write of the decisions (on
        PostgreSQL each of these is one statement, whatever the batch's size).
        """
        t, w = self.t.tasks, self.t.workers
        batch = limit or self.config.reaper_batch_size

        def op(conn: Connection, _: bool) -> list[Expiry]:
            q = (
                select(t.c.id, t.c.token)
                .select_from(t.outerjoin(w, w.c.id == t.c.owner))
                .where(t.c.state == State.RUNNING.value)
                .limit(batch)
            )
            named = self._named_runs(task_ids, owners, attempt, claimed_before)
            q = q.where(*named)
            if only_expired:
                q = q.where(lease_expired(self.t))
            if self.is_pg:
                q = q.with_for_update(of=t, skip_locked=True)
            candidates = [(str(c.id), c.token) for c in conn.execute(q).all()]
            if not only_expired and (task_ids is not None or owners is not None):
                self._end_overruns(conn, named)
            return self._expire_batch(conn, candidates, actor=actor, reason=reason)

        return self._tx(op)

    def _expire_batch(
        self,
        conn: Connection,
        candidates: Sequence[tuple[str, str | None]],
        *,
        actor: str,
        reason: str,
    ) -> list[Expiry]:
        """Expire the leases ``(task id, token)`` (each fenced by its token) and apply
        the policy to each, in the caller's transaction."""
        if not candidates:
            return []
        t, s = self.t.tasks, self.t.steps
        held = [c for c in candidates if c[1] is not None]
        tokenless = [task_id for task_id, token in candidates if token is None]
        fence = or_(
            tuple_(t.c.id, t.c.token).in_(held) if held else false(),
            and_(t.c.id.in_(tokenless), t.c.token.is_(None)) if tokenless else false(),
        )
        timed_out = self._move(
            conn,
            [fence],
            State.RUNNING,
            State.TIMEOUT,
            reason=reason,
            actor=actor,
            values={"token": None, "recoveries": t.c.recoveries + 1},
            returning=(
                t.c.recoveries,
                t.c.max_recoveries,
                t.c.on_timeout,
                t.c.cancel_requested_at,
                seconds_between(db_now(), t.c.created_at).label("age"),
            ),
        )
        if not timed_out:
            return []
        # only this attempt's calls can be in flight: a step left STARTED by an earlier
        # attempt ended when its call raised and the task chose to retry
        inflight: dict[str, str] = {}
        for step in conn.execute(
            select(s.c.task_id, s.c.name)
            .where(
                tuple_(s.c.task_id, s.c.attempt).in_([(r.id, r.attempt) for r in timed_out]),
                s.c.state == STEP_STARTED,
                s.c.idempotent.is_(False),
                s.c.checkable.is_(False),
            )
            .order_by(s.c.task_id, s.c.name)
        ).all():
            inflight.setdefault(str(step.task_id), str(step.name))
        decided: list[Expiry] = []
        for row in timed_out:
            to, why = policy.after_timeout(
                on_timeout=row.on_timeout,
                recoveries=int(row.recoveries),
                max_recoveries=int(row.max_recoveries),
                age=float(row.age),
                max_age=self.config.max_age,
                inflight_step=inflight.get(str(row.id)),
                cancel_requested=row.cancel_requested_at is not None,
            )
            decided.append(Expiry(str(row.id), to, why))
        self._move_each(
            conn,
            State.TIMEOUT,
            [(e.task_id, e.to_state, f"{e.reason} (after: {reason})") for e in decided],
            actor=actor,
            stamps=_STAMPS,
        )
        return decided

    def give_up(self, lease: Lease, *, actor: str, reason: str) -> Expiry | None:
        """An execution gives up its own lease (it stopped without an outcome): expire it
        at once, fenced by its token, then apply the policy. ``None``: it was no longer
        this execution's lease (nothing changed)."""
        expiries = self._tx(
            lambda conn, _: self._expire_batch(
                conn, [(lease.task_id, lease.token)], actor=actor, reason=reason
            )
        )
        return expiries[0] if expiries else None

    def owned_past_ttl(self, worker_id: str, *, limit: int = 10_000) -> list[tuple[str, int]]:
        """The RUNNING rows ``worker_id`` owns, claimed longer ago than their own lease
        TTL (``started_at``, database time), as ``(task id, attempt)``: what the worker
        compares with the tasks it has in hand (its reconciliation). One statement, read
        through the partial index of RUNNING rows by owner (the state is written as a
        literal, so that a generic plan of a prepared statement still matches the
        index's condition)."""
        t = self.t.tasks
        q = (
            select(t.c.id, t.c.attempt)
            .where(
                t.c.state == literal_column(f"'{State.RUNNING.value}'"),
                t.c.owner == worker_id,
                after(t.c.started_at, t.c.lease_ttl) < db_now(),
            )
            .order_by(t.c.started_at)  # past the limit, the same rows each round
            .limit(limit)
        )
        rows = self._read(lambda conn: conn.execute(q).all())
        return [(str(r.id), int(r.attempt)) for r in rows]

    def _named_runs(
        self,
        task_ids: Sequence[str] | None,
        owners: Sequence[str] | None,
        attempt: int | None,
        claimed_before: float | None,
    ) -> list[ColumnElement[bool]]:
        """The conditions of :meth:`expire`'s selection (see its arguments), over the
        tasks table."""
        t = self.t.tasks
        where: list[ColumnElement[bool]] = []
        if task_ids is not None:
            where.append(t.c.id.in_(task_ids))
        if owners is not None:
            where.append(t.c.owner.in_(owners))
        if attempt is not None:
            where.append(t.c.attempt == attempt)
        if claimed_before is not None:
            age = max(0.0, time.monotonic() - claimed_before)
            where.append(t.c.started_at < after(db_now(), -age))
        return where

    def _end_overruns(self, conn: Connection, named: Sequence[ColumnElement[bool]]) -> None:
        """The runs an expiry names (``named``: :meth:`_named_runs`) ended (a pool child
        lost, a worker stopping or restarted): those that an overrun had moved to
        WAIT_MANUAL, still holding their slot, give it back (the row stays WAIT_MANUAL:
        a person decides)."""
        t = self.t.tasks
        q = update(t).where(
            t.c.state == State.WAIT_MANUAL.value,
            t.c.slot.is_not(None),
            t.c.slot == OVERRUN,
            *named,
        )
        rows = conn.execute(q.values(slot=None).returning(t.c.name, t.c.slot_key)).all()
        self._note_frees(rows)

    def overrun(self, *, actor: str, limit: int | None = None) -> list[str]:
        """RUNNING rows with a live lease but no progress for ``max_runtime`` -> WAIT_MANUAL.

        The owner keeps its token: if it finishes, its outcome is accepted."""
        t, w = self.t.tasks, self.t.workers
        batch = limit or self.config.reaper_batch_size

        def op(conn: Connection, _: bool) -> list[str]:
            q = (
                select(t.c.id, t.c.max_runtime)
                .select_from(t.join(w, w.c.id == t.c.owner))
                .where(
                    t.c.state == State.RUNNING.value,
                    t.c.max_runtime.is_not(None),
                    after(t.c.progress_at, t.c.max_runtime) < db_now(),
                    ~lease_expired(self.t),
                )
                .limit(batch)
            )
            if self.is_pg:
                q = q.with_for_update(of=t, skip_locked=True)
            moves = [
                (
                    str(cand.id),
                    State.WAIT_MANUAL,
                    f"alive but no progress for more than max_runtime ({cand.max_runtime:g} s): "
                    "left running; a person decides",
                )
                for cand in conn.execute(q).all()
            ]
            rows = self._move_each(conn, State.RUNNING, moves, actor=actor, stamps={})
            moved = {str(r.id) for r in rows}
            if moved:
                # a limited task's run goes on: its slot stays taken while its owner lives
                conn.execute(
                    update(t)
                    .where(
                        t.c.id.in_(sorted(moved)),
                        t.c.state == State.WAIT_MANUAL.value,
                        t.c.slot_key.is_not(None),
                    )
                    .values(slot=OVERRUN)
                )
            return [task_id for task_id, _, _ in moves if task_id in moved]

        return self._tx(op)

    def out_of_range(self, *, limit: int = 10) -> list[str]:
        """RUNNING rows whose stored ``lease_ttl`` or ``max_runtime`` is outside the range
        a setting or option may take (not finite, not positive, over ``MAX_SECONDS``):
        written by an older version or by hand. The sweeps clamp such a value (see
        :class:`~.schema.after`), so the row stops no sweep; the reaper reports it."""
        t = self.t.tasks

        def bad(column: Any) -> ColumnElement[bool]:
            # NaN: PostgreSQL orders it above every number, so it fails the upper bound
            return not_(and_(column > 0, column <= MAX_SECONDS))

        q = (
            select(t.c.id)
            .where(
                t.c.state == State.RUNNING.value,
                or_(bad(t.c.lease_ttl), and_(t.c.max_runtime.is_not(None), bad(t.c.max_runtime))),
            )
            .order_by(t.c.id)
            .limit(limit)
        )
        return [str(i) for i in self._read(lambda conn: conn.execute(q).scalars().all())]

    # -- what to publish again -------------------------------------------------------------

    def take_due_retries(self, *, actor: str, limit: int | None = None) -> list[Publishable]:
        """RETRY_WAIT rows whose ``next_retry_at`` has come -> PENDING, to publish."""
        t = self.t.tasks
        batch = limit or self.config.reaper_batch_size
        mine = published_by(self.t, self.config.origin)

        def op(conn: Connection, _: bool) -> list[Publishable]:
            q = (
                select(t.c.id)
                .where(t.c.state == State.RETRY_WAIT.value, t.c.next_retry_at <= db_now())
                .where(mine)  # another broker's row: its own app publishes it
                .order_by(t.c.next_retry_at)
                .limit(batch)
            )
            ids = self._take_ids(conn, q)
            if not ids:
                return []
            rows = self._move(
                conn,
                [t.c.id.in_(ids)],
                State.RETRY_WAIT,
                State.PENDING,
                reason="retry due: re-published",
                actor=actor,
                # a new run of the row: its lost-message backoff starts over
                values={"published_at": None, "eta": None, "publish_count": 0, "held": False},
                returning=self._publishable_columns(),
            )
            return self._publishable(rows)

        return self._tx(op)

    def take_held(self, *, limit: int | None = None) -> list[Publishable]:
        """Held rows (due far ahead when submitted) whose ETA comes within one
        ``lease_reaper_interval``: no longer held, and reserved for publishing now
        with their stored message (a worker waits out what is left of the ETA, at most
        one interval, so the task starts on time, not up to an interval late).

        Read through the partial index on ``eta`` of the held rows: the sweep costs
        the rows due, not the rows held. On PostgreSQL the rows are taken ``FOR UPDATE
        SKIP LOCKED`` and released in the same transaction, so two reapers never take
        one row (on SQLite the transaction holds the file's write lock). A row that
        left PENDING while held (cancelled) only loses its mark: nothing is published.
        A paused task name's rows stay held until the pause ends. If the reaper dies
        before publishing, the rows are PENDING and unpublished, and the grace sweep
        (:meth:`take_unpublished`) publishes them."""
        t = self.t.tasks
        cfg = self.config
        batch = limit or cfg.reaper_batch_size

        def op(conn: Connection, _: bool) -> list[Publishable]:
            q = (
                select(t.c.id)
                .where(t.c.held == true(), t.c.eta <= after(db_now(), cfg.reaper_interval))
                .where(self.paused_names_clause())  # held until the pause ends
                .where(published_by(self.t, cfg.origin))  # another broker's: its own app's
                .order_by(t.c.eta)
                .limit(batch)
            )
            ids = self._take_ids(conn, q)
            if not ids:
                return []
            conn.execute(
                update(t)
                .where(t.c.id.in_(ids), t.c.state != State.PENDING.value)
                .values(held=False)
            )
            return self._reserve(conn, ids)

        return self._tx(op)

    def held(self, *, limit: int = 100, name: str | None = None) -> list[Held]:
        """The held rows, soonest ETA first (``lease list --scheduled``)."""
        t = self.t.tasks
        q = (
            select(t.c.id, t.c.name, t.c.eta, t.c.created_at)
            .where(t.c.held == true(), t.c.state == State.PENDING.value)
            .order_by(t.c.eta, t.c.id)
            .limit(limit)
        )
        if name is not None:
            q = q.where(t.c.name == name)
        rows = self._read(lambda conn: conn.execute(q).all())
        return [Held(str(r.id), str(r.name), r.eta, r.created_at) for r in rows]

    def take_pending(self, task_ids: Sequence[str]) -> list[Publishable]:
        """These rows, if still PENDING, reserved for publishing again at once (their
        message was lost with a pool child before it could claim)."""
        return self._tx(lambda conn, _: self._reserve(conn, task_ids))

    def take_unpublished(self, *, limit: int | None = None) -> list[Publishable]:
        """PENDING rows never marked published after the grace, or published but not
        claimed for ``republish_after`` (message lost): reserved for re-publishing."""
        t = self.t.tasks
        cfg = self.config
        batch = limit or cfg.reaper_batch_size
        never = never_published(self.t, cfg.publish_grace)
        lost = message_lost(self.t, cfg.republish_after)
        mine = published_by(self.t, cfg.origin)

        def op(conn: Connection, _: bool) -> list[Publishable]:
            q = (
                select(t.c.id)
                .where(t.c.state == State.PENDING.value, or_(never, lost))
                .where(self.paused_names_clause())  # held until the pause ends
                .where(mine)  # another broker's row: its own app publishes it
                .limit(batch)
            )
            ids = self._take_ids(conn, q)
            if not ids:
                return []
            return self._reserve(conn, ids)

        return self._tx(op)

    def _reserve(self, conn: Connection, ids: Sequence[str]) -> list[Publishable]:
        """Reserve these rows, if still PENDING, for publishing now: a concurrent reaper
        sees a fresh ``updated_at`` and leaves them alone; if this one dies before
        publishing, the grace sweep picks them up again."""
        t = self.t.tasks
        rows = conn.execute(
            update(t)
            .where(t.c.id.in_(ids), t.c.state == State.PENDING.value)
            # published now: no longer held for its ETA (if it was)
            .values(published_at=None, updated_at=db_now(), held=False)
            .returning(t.c.id, *self._publishable_columns())
        ).all()
        return self._publishable(rows)

    def paused_names_clause(self) -> ColumnElement[bool]:
        """``tasks.name`` is not a paused task name (for the reaper's publishing)."""
        t, p = self.t.tasks, self.t.pauses
        paused: Any = select(p.c.target).where(p.c.kind == "task")
        return t.c.name.not_in(paused)

    def hold_published(self, task_ids: Sequence[str]) -> list[str]:
        """Of these PENDING rows, just reserved for re-publishing, those that were
        published before (``publish_count > 0``) are marked published now instead:
        their message is taken to be still queued (the broker said their queue holds
        messages), and they are looked at again after ``lease_republish_after``.
        Returns the ids not to publish: those held, and those no longer PENDING
        (claimed since they were reserved); the others (never published) are to be
        published."""
        if not task_ids:
            return []
        t = self.t.tasks

        def op(conn: Connection, _: bool) -> list[str]:
            held = [
                str(r.id)
                for r in conn.execute(
                    update(t)
                    .where(
                        t.c.id.in_(list(task_ids)),
                        state_is(t, State.PENDING),
                        t.c.published_at.is_(None),
                        t.c.publish_count > 0,
                    )
                    .values(published_at=db_now())
                    .returning(t.c.id)
                ).all()
            ]
            rest = [i for i in task_ids if i not in set(held)]
            if not rest:
                return held
            # a row claimed since it was reserved (its message was delivered after all)
            # is not published again either
            pending = {
                str(r.id)
                for r in conn.execute(
                    select(t.c.id).where(t.c.id.in_(rest), state_is(t, State.PENDING))
                ).all()
            }
            return held + [i for i in rest if i not in pending]

        return self._tx(op)

    def overtaken(self, task_ids: Sequence[str]) -> set[str]:
        """Of these PENDING rows, published once, those whose message was overtaken: a
        task of the same name and routing (so the same queue, at the same priority),
        submitted more than ``lease_republish_after`` later and published once, has been
        claimed. A queue hands out its messages in order, so such a row's message is not
        waiting in the queue any more: it was lost (or it waits in a dead consumer's
        prefetch), however long the queue stays busy.

        Times are submission times (``created_at``, database time), which a message is
        published right after; a row published more than once is left to the backlog
        rule (its last publication's time is not kept). A message that was in fact only
        late (a producer held up for longer than ``lease_republish_after`` between its
        insert and its publish) is published a second time, and that copy is dropped at
        claim."""
        if not task_ids:
            return set()
        t = self.t.tasks
        later = t.alias("later")
        margin = self.config.republish_after
        claimed_states = [s.value for s in State if s is not State.PENDING]

        def op(conn: Connection) -> set[str]:
            evidence = (
                select(later.c.id)
                .where(
                    later.c.state.in_(claimed_states),  # the (state, created_at) index
                    later.c.created_at > after(t.c.created_at, margin),
                    later.c.name == t.c.name,
                    or_(
                        later.c.options == t.c.options,
                        and_(later.c.options.is_(None), t.c.options.is_(None)),
                    ),
                    later.c.publish_count == 1,
                    later.c.started_at.is_not(None),
                )
                .limit(1)
            )
            rows = conn.execute(
                select(t.c.id).where(
                    t.c.id.in_(list(task_ids)),
                    state_is(t, State.PENDING),
                    t.c.publish_count == 1,
                    evidence.exists(),
                )
            ).all()
            return {str(r.id) for r in rows}

        return self._read(op)

    def take_follow_ups(self, *, limit: int | None = None) -> list[FollowUps]:
        """SUCCEEDED rows whose follow-ups were recorded more than ``lease_publish_grace``
        ago and not marked published (their worker died, or the broker refused them):
        reserved for publishing now (a concurrent reaper leaves them alone for another
        grace; if this one dies before it is done, the next sweep takes them again)."""
        t = self.t.tasks
        batch = limit or self.config.reaper_batch_size
        grace = self.config.publish_grace

        def op(conn: Connection, _: bool) -> list[FollowUps]:
            q = (
                select(t.c.id)
                .where(
                    t.c.follow_ups_at.is_not(None),
                    after(t.c.follow_ups_at, grace) < db_now(),
                    t.c.state == State.SUCCEEDED.value,
                    # follow-ups go to the broker of the row's own app
                    published_by(self.t, self.config.origin),
                )
                .order_by(t.c.follow_ups_at)
                .limit(batch)
            )
            ids = self._take_ids(conn, q)
            if not ids:
                return []
            rows = conn.execute(
                update(t)
                .where(t.c.id.in_(ids), t.c.follow_ups_at.is_not(None))
                .values(follow_ups_at=db_now())
                .returning(t.c.id, t.c.name, t.c.message, t.c.result, t.c.retries)
            ).all()
            return [FollowUps(str(r.id), r.name, r.message, r.result, int(r.retries)) for r in rows]

        return self._tx(op)

    # -- worker incarnations and the reaper's lock -----------------------------------------

    def register_worker(
        self, worker_id: str, nodename: str, hostname: str, pid: int, *, supersede: bool = True
    ) -> list[str]:
        """Insert this incarnation; with ``supersede``, mark earlier live incarnations of
        the same node name stopped (a restart means they are gone) and return their ids.

        A worker that may find a live duplicate registers with ``supersede=False``, looks
        at :meth:`peers` and supersedes only the dead ones (:meth:`supersede`).
        """
        w = self.t.workers

        def op(conn: Connection, _: bool) -> list[str]:
            conn.execute(
                self._insert(w)
                .values(
                    id=worker_id,
                    nodename=nodename,
                    hostname=hostname,
                    pid=pid,
                    started_at=db_now(),
                    heartbeat_at=db_now(),
                )
                .on_conflict_do_nothing()
            )
            if not supersede:
                return []
            rows = conn.execute(
                update(w)
                .where(w.c.nodename == nodename, w.c.id != worker_id, w.c.stopped_at.is_(None))
                .values(stopped_at=db_now(), stop_reason=f"superseded by restart {worker_id}")
                .returning(w.c.id)
            ).all()
            return [str(r.id) for r in rows]

        return self._tx(op)

    def peers(self, nodename: str, worker_id: str) -> list[Peer]:
        """The other live (not stopped) incarnations named ``nodename``."""
        w = self.t.workers
        q = select(
            w.c.id,
            w.c.hostname,
            w.c.pid,
            w.c.heartbeat_at,
            seconds_between(db_now(), w.c.heartbeat_at).label("age"),
        ).where(w.c.nodename == nodename, w.c.id != worker_id, w.c.stopped_at.is_(None))
        rows = self._read(lambda conn: conn.execute(q).all())
        return [
            Peer(str(r.id), str(r.hostname), int(r.pid), float(r.age), r.heartbeat_at) for r in rows
        ]

    def supersede(self, worker_ids: Sequence[str], by: str) -> list[str]:
        """Mark these incarnations stopped (gone: superseded by ``by``); returns the ids
        this call stopped (not those already stopped)."""
        if not worker_ids:
            return []
        w = self.t.workers

        def op(conn: Connection, _: bool) -> list[str]:
            rows = conn.execute(
                update(w)
                .where(w.c.id.in_(list(worker_ids)), w.c.stopped_at.is_(None))
                .values(stopped_at=db_now(), stop_reason=f"superseded by restart {by}")
                .returning(w.c.id)
            ).all()
            return [str(r.id) for r in rows]

        return self._tx(op)

    def renew(self, worker_id: str) -> bool:
        """One heartbeat: one statement however many tasks the worker runs.

        ``False``: the incarnation was marked stopped by someone else.
        """
        w = self.t.workers

        def op(conn: Connection, _: bool) -> bool:
            count = conn.execute(
                update(w)
                .where(w.c.id == worker_id, w.c.stopped_at.is_(None))
                .values(heartbeat_at=db_now())
            ).rowcount
            return bool(count)

        return self._tx(op, single=True)

    def worker_started_at(self, worker_id: str) -> datetime | None:
        """When this incarnation registered, by the database's clock (``None``: no row)."""
        w = self.t.workers
        q = select(w.c.started_at).where(w.c.id == worker_id)
        return self._read(lambda conn: conn.execute(q).scalar())

    def reactivate_worker(
        self,
        worker_id: str,
        nodename: str,
        hostname: str,
        pid: int,
        started_at: datetime | None,
    ) -> bool:
        """Make this incarnation alive again, as its heartbeat found it stopped or gone:
        marked stopped while it still ran (an operator, or a worker that took it for a
        dead predecessor), or its row missing (a failover to a replica that had not
        received it yet: asynchronous replication loses the last commits). A missing
        row is inserted again as it was registered (``started_at``: the incarnation's
        own registration time, kept in memory), so its leases and claims have a live
        owner again.

        Fenced: an incarnation superseded by a later one stays stopped. ``False``, and
        nothing written, while another live incarnation of ``nodename`` registered
        after ``started_at`` (with ``started_at`` unknown, any other live one): a worker
        started under the same name since, which took this one for gone (or never saw
        its row), runs the name's tasks; two live incarnations under one name would
        expire each other's leases."""
        w = self.t.workers

        def op(conn: Connection, _: bool) -> bool:
            later = [w.c.nodename == nodename, w.c.id != worker_id, w.c.stopped_at.is_(None)]
            if started_at is not None:
                later.append(w.c.started_at > started_at)
            if conn.execute(select(w.c.id).where(*later).limit(1)).first() is not None:
                return False
            revived = conn.execute(
                update(w)
                .where(w.c.id == worker_id)
                .values(stopped_at=None, stop_reason=None, heartbeat_at=db_now())
            ).rowcount
            if not revived:
                conn.execute(
                    self._insert(w)
                    .values(
                        id=worker_id,
                        nodename=nodename,
                        hostname=hostname,
                        pid=pid,
                        started_at=started_at if started_at is not None else db_now(),
                        heartbeat_at=db_now(),
                    )
                    .on_conflict_do_nothing()
                )
            return True

        return self._tx(op)

    def stop_worker(self, worker_id: str, reason: str) -> None:
        """Mark this incarnation stopped: leases it still holds are expired at once."""
        w = self.t.workers
        self._tx(
            lambda conn, _: conn.execute(
                update(w)
                .where(w.c.id == worker_id, w.c.stopped_at.is_(None))
                .values(stopped_at=db_now(), stop_reason=reason)
            )
        )

    def reaper_lock(self) -> str:
        """The name of the embedded reaper's lock (see :func:`reaper_lock_name`)."""
        return reaper_lock_name(self.config.origin)

    def try_lock(self, name: str, holder: str, ttl: float) -> bool:
        """Take or renew a named lock for ``ttl`` seconds (database time)."""
        lk = self.t.locks

        def op(conn: Connection, _: bool) -> bool:
            got = conn.execute(
                update(lk)
                .where(lk.c.name == name, or_(lk.c.holder == holder, lk.c.expires_at < db_now()))
                .values(holder=holder, expires_at=after(db_now(), ttl))
            ).rowcount
            if got:
                return True
            inserted = conn.execute(
                self._insert(lk)
                .values(name=name, holder=holder, expires_at=after(db_now(), ttl))
                .on_conflict_do_nothing()
                .returning(lk.c.name)
            ).first()
            return inserted is not None

        return self._tx(op)

    def release_lock(self, name: str, holder: str) -> None:
        lk = self.t.locks
        self._tx(
            lambda conn, _: conn.execute(delete(lk).where(lk.c.name == name, lk.c.holder == holder))
        )
