"""What operators do: a person's transitions, bulk actions, purges, pauses; and
retention, the reaper's purge.

A bulk action reads the rows a filter selects once, then moves them one batch per
transaction (all or nothing: the first row the table refuses rolls its batch back).

**Purges and tombstones.** Every purge (``lease purge`` or retention) deletes a row
with its steps and audit rows (the audit rows through :meth:`Counting._delete_audit`,
so the transition totals never drop) and writes a tombstone (id, purged_at,
keep_until) in the same transaction, kept until ``lease_retention`` (default a week
when retention is off) after the later of the purge and the row's ETA: a message of a
purged row may still arrive (a cancelled task's countdown still queued, a redelivery
after a visibility timeout), and the claim refuses to adopt an id that has one. The
reaper deletes the tombstones past ``keep_until``. Retention runs one bounded batch
per transaction; on PostgreSQL a batch is one statement: the rows are chosen with
``FOR UPDATE SKIP LOCKED``, their steps, audit rows and the rows themselves are
deleted and the ``purged`` counter is raised, in one round trip. Live rows are never
chosen (the query names the finished states only, in the words of the partial index
``<prefix>tasks_finished``), nor a SUCCEEDED row whose follow-ups are not yet published.

**Pauses.** A pause is a row in ``<prefix>pauses`` while it lasts; every pause and
resume adds a row to ``<prefix>pause_log`` (who, why, when) in the same transaction.
Workers read the pauses at most once per heartbeat interval; the reaper leaves the
rows of a paused task name unpublished (``Sweeps.paused_names_clause``).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Float,
    String,
    bindparam,
    case,
    delete,
    func,
    insert,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql

from .. import states
from ..config import DEFAULT_RETENTION
from ..exceptions import TaskNotFound
from ..states import STEP_DONE, Actor, State
from ._base import state_is
from ._totals import PURGED, Counting
from ._types import Filter, Pause, PauseEvent, Selected
from .schema import FINISHED_SQL, after, db_now, greatest

#: The two things that can be paused.
KINDS = ("queue", "task")


#: ``published_at`` of a row whose delivery a pause dropped: long ago, so that the
#: reaper publishes it again as soon as no pause holds it (a lost message, in effect);
#: not ``NULL``, which a producer's deferred "published" mark could overwrite.
HELD = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


class Operator(Counting):
    """A person's moves, bulk actions, purges and pauses; retention."""

    # -- a person's moves ------------------------------------------------------------------

    def _lock_state(self, conn: Connection, task_id: str) -> State:
        t = self.t.tasks
        q = select(t.c.state).where(t.c.id == task_id)
        if self.is_pg:
            q = q.with_for_update()
        state = conn.execute(q).scalar()
        if state is None:
            raise TaskNotFound(task_id)
        return State(state)

    def operator_move(
        self,
        task_id: str,
        to: State,
        *,
        actor: str,
        reason: str,
        result: str | None = None,
        allowed: Sequence[State] | None = None,
    ) -> State:
        """A person moves a task to ``to``; returns the state it left.

        Raises :class:`TaskNotFound` or :class:`IllegalTransition` and changes nothing
        when the table (or ``allowed``) does not permit it.
        """
        return self._tx(
            lambda conn, _: self._operator_move_in(
                conn, task_id, to, actor=actor, reason=reason, result=result, allowed=allowed
            )
        )

    def _operator_move_in(
        self,
        conn: Connection,
        task_id: str,
        to: State,
        *,
        actor: str,
        reason: str,
        result: str | None = None,
        allowed: Sequence[State] | None = None,
    ) -> State:
        """:meth:`operator_move` inside the caller's transaction (bulk actions)."""
        t, s = self.t.tasks, self.t.steps
        frm = self._lock_state(conn, task_id)
        permitted = states.sources(to, Actor.OPERATOR) if allowed is None else allowed
        if frm not in permitted or not states.is_legal(frm, to):
            from ..exceptions import IllegalTransition

            raise IllegalTransition(task_id, frm, to)
        # the token goes: a still-running owner (WAIT_MANUAL over max_runtime) is fenced off
        values: dict[str, Any] = {"token": None}
        if to is State.PENDING:
            values.update(
                publish_count=0,
                published_at=None,
                next_retry_at=None,
                finished_at=None,
                eta=None,
                # published now (by the caller, or by the grace sweep if it dies first):
                # not held, whatever an earlier pacing left on the row
                held=False,
                cancel_requested_at=None,
                cancel_actor=None,
                cancel_reason=None,
            )
            # a step whose outcome was unknown is re-run: the person decided so
            conn.execute(delete(s).where(s.c.task_id == task_id, s.c.state != STEP_DONE))
        else:
            values["finished_at"] = db_now()
        if to is State.FAILED:
            values["error"] = reason
        if to is State.SUCCEEDED:
            values["result"] = result
            # a resolved task's follow-ups (chain, callbacks, chord part-return) are sent
            # as after a run: recorded here, published after the commit or by the reaper
            values["follow_ups_at"] = case((t.c.message.is_not(None), db_now()), else_=None)
        self._move(conn, [t.c.id == task_id], frm, to, reason=reason, actor=actor, values=values)
        return frm

    def request_cancel(
        self, task_id: str, *, actor: str, reason: str, keep_earlier: bool = False
    ) -> State:
        """Cancel a task: at once unless RUNNING, where the request waits for the task
        to reach a step boundary. Returns the state found. With ``keep_earlier`` a
        request already recorded for the RUNNING task (who asked, and why) is kept."""
        return self._tx(
            lambda conn, _: self._request_cancel_in(
                conn, task_id, actor=actor, reason=reason, keep_earlier=keep_earlier
            )
        )

    def _request_cancel_in(
        self,
        conn: Connection,
        task_id: str,
        *,
        actor: str,
        reason: str,
        keep_earlier: bool = False,
    ) -> State:
        """:meth:`request_cancel` inside the caller's transaction (bulk actions)."""
        t = self.t.tasks
        frm = self._lock_state(conn, task_id)
        if frm is State.RUNNING:
            where = [t.c.id == task_id, t.c.state == State.RUNNING.value]
            if keep_earlier:
                where.append(t.c.cancel_requested_at.is_(None))
            conn.execute(
                update(t)
                .where(*where)
                .values(cancel_requested_at=db_now(), cancel_actor=actor, cancel_reason=reason)
            )
            return frm
        if not states.is_legal(frm, State.CANCELLED):
            from ..exceptions import IllegalTransition

            raise IllegalTransition(task_id, frm, State.CANCELLED)
        self._move(
            conn,
            [t.c.id == task_id],
            frm,
            State.CANCELLED,
            reason=reason,
            actor=actor,
            values={"finished_at": db_now(), "token": None},
        )
        return frm

    # -- bulk actions ----------------------------------------------------------------------

    def select_tasks(self, where: Filter, *, limit: int) -> list[Selected]:
        """At most ``limit`` rows matching ``where``, oldest first (read once: the
        batches then act on these ids, each checked again in its transaction)."""
        t, w = self.t.tasks, self.t.workers
        q = (
            select(t.c.id, t.c.name, t.c.state, t.c.reason, t.c.created_at, t.c.args)
            .select_from(t.outerjoin(w, w.c.id == t.c.owner))
            .order_by(t.c.created_at, t.c.id)
            .limit(limit)
        )
        if where.state is not None:
            q = q.where(t.c.state == where.state.value)
        if where.name is not None:
            q = q.where(t.c.name == where.name)
        if where.reason_contains is not None:
            q = q.where(t.c.reason.like(f"%{_escape_like(where.reason_contains)}%", escape="\\"))
        if where.worker is not None:
            q = q.where(or_(t.c.owner == where.worker, w.c.nodename == where.worker))
        if where.older_than is not None:
            q = q.where(after(t.c.created_at, where.older_than) < db_now())
        rows = self._read(lambda conn: conn.execute(q).all())
        return [
            Selected(str(r.id), r.name, State(r.state), r.reason, r.created_at, r.args is not None)
            for r in rows
        ]

    def bulk_move(
        self,
        ids: Sequence[str],
        to: State,
        *,
        actor: str,
        reason: str,
        result: str | None = None,
    ) -> list[tuple[str, State]]:
        """Move every one of ``ids`` to ``to`` in one transaction (``to`` CANCELLED: a
        RUNNING row gets a cancel request). Returns ``(id, state it left)`` per row;
        raises :class:`IllegalTransition` or :class:`TaskNotFound` for the first row the
        table refuses, and then nothing of this batch is written."""

        def op(conn: Connection, _: bool) -> list[tuple[str, State]]:
            out: list[tuple[str, State]] = []
            for task_id in ids:
                frm: Any
                if to is State.CANCELLED:
                    frm = self._request_cancel_in(conn, task_id, actor=actor, reason=reason)
                else:
                    frm = self._operator_move_in(
                        conn, task_id, to, actor=actor, reason=reason, result=result
                    )
                out.append((task_id, frm))
            return out

        return self._tx(op)

    # -- purges, retention, tombstones -----------------------------------------------------

    def _purgeable_where(
        self, states_: Sequence[State], older_than: float
    ) -> list[ColumnElement[bool]]:
        """Rows in ``states_`` finished (or last changed) more than ``older_than`` seconds
        ago: what ``purge`` deletes and ``purgeable_count`` counts."""
        t = self.t.tasks
        return [
            t.c.state.in_([s.value for s in states_]),
            after(func.coalesce(t.c.finished_at, t.c.updated_at), older_than) < db_now(),
            t.c.follow_ups_at.is_(None),  # kept until its follow-ups are published
        ]

    def purgeable_count(self, states_: Sequence[State], older_than: float) -> int:
        """How many rows :meth:`purge` would delete now with these arguments."""
        q = select(func.count()).where(*self._purgeable_where(states_, older_than))
        return int(self._read(lambda conn: conn.execute(q).scalar_one()))

    def purge(self, *, older_than: float, states_: Sequence[State], batch: int = 1000) -> int:
        """Delete one batch of rows in ``states_`` finished more than ``older_than`` seconds
        ago, with their steps and audit rows. Returns how many tasks were deleted."""
        t, s, tr = self.t.tasks, self.t.steps, self.t.transitions

        def op(conn: Connection, _: bool) -> int:
            q = select(t.c.id).where(*self._purgeable_where(states_, older_than)).limit(batch)
            ids = self._take_ids(conn, q)
            if ids:
                # a late message of a purged row must not be adopted as a new task
                conn.execute(self._tombstones(t.c.id.in_(ids)))
                conn.execute(delete(s).where(s.c.task_id.in_(ids)))
                self._delete_audit(conn, tr.c.task_id.in_(ids))  # counted, then deleted
                conn.execute(delete(t).where(t.c.id.in_(ids)))
            return len(ids)

        return self._tx(op)

    def _victims(self) -> Any:
        """Ids of one batch of finished rows older than ``b_older`` seconds (bind
        parameters ``b_older`` and ``b_limit``)."""
        t = self.t.tasks
        q = (
            select(t.c.id)
            .where(
                text(FINISHED_SQL),
                t.c.finished_at < after(db_now(), -bindparam("b_older", type_=Float)),
                # a success whose follow-ups are not yet published is what the reaper
                # publishes them from: kept until they are
                t.c.follow_ups_at.is_(None),
            )
            # oldest first: the finished_at index drives the batch whatever share of the
            # table is old (a sequential scan would wade through the dead rows of the
            # batches before, until a vacuum)
            .order_by(t.c.finished_at)
            .limit(bindparam("b_limit"))
        )
        if self.is_pg:
            q = q.with_for_update(skip_locked=True)
        return q

    def _purge_pg(self) -> Any:
        t, s, tr, c = self.t.tasks, self.t.steps, self.t.transitions, self.t.counters
        victims = self._victims().cte("victims")
        chosen = select(victims.c.id)
        tombs = self._tombstones(t.c.id.in_(chosen)).cte("tombs")
        gone_steps = delete(s).where(s.c.task_id.in_(chosen)).cte("gone_steps")
        gone_audit, counted_audit = self._audit_delete_ctes(tr.c.task_id.in_(chosen))
        gone = delete(t).where(t.c.id.in_(chosen)).returning(t.c.id).cte("gone")
        counted = select(func.count()).select_from(gone).scalar_subquery()
        bump = postgresql.insert(c).from_select(
            ["name", "value", "updated_at"],
            select(bindparam("b_name", PURGED, type_=String), counted, db_now()).where(counted > 0),
        )
        bump = bump.on_conflict_do_update(
            index_elements=[c.c.name],
            set_={"value": c.c.value + bump.excluded.value, "updated_at": db_now()},
        )
        return select(counted.label("purged")).add_cte(
            tombs, gone_steps, gone_audit, *counted_audit, gone, bump.cte("bumped")
        )

    def purge_expired(self, older_than: float, *, limit: int | None = None) -> int:
        """Delete one batch (at most ``limit``, default ``lease_retention_batch_size``)
        of SUCCEEDED, FAILED and CANCELLED rows whose ``finished_at`` is more than
        ``older_than`` seconds ago, with their steps and audit rows; raise the
        ``purged`` counter by as many. Returns how many tasks were deleted."""
        batch = limit or self.config.retention_batch_size
        params = {"b_older": float(older_than), "b_limit": batch}
        t, s, tr = self.t.tasks, self.t.steps, self.t.transitions
        if self.is_pg:
            stmt = self._prepared("purge-expired-pg", self._purge_pg)
            return int(
                self._tx(
                    lambda conn, _: conn.execute(stmt, params).scalar_one(),
                    single=True,
                )
            )

        def op(conn: Connection, _: bool) -> int:
            ids = [r.id for r in conn.execute(self._victims(), params)]
            if ids:
                conn.execute(self._tombstones(t.c.id.in_(ids)))
                conn.execute(delete(s).where(s.c.task_id.in_(ids)))
                self._delete_audit(conn, tr.c.task_id.in_(ids))
                conn.execute(delete(t).where(t.c.id.in_(ids)))
                self.add_counts({PURGED: len(ids)}, conn)
            return len(ids)

        return self._tx(op)

    def _tombstones(self, which: ColumnElement[bool]) -> Any:
        """INSERT a tombstone for each task row ``which`` selects, in the purge's own
        transaction, before the rows are deleted (see the module docstring)."""
        t, p = self.t.tasks, self.t.purged
        keep = self.config.retention or DEFAULT_RETENTION
        stmt = self._insert(p).from_select(
            ["id", "purged_at", "keep_until"],
            select(
                t.c.id, db_now(), after(greatest(func.coalesce(t.c.eta, db_now()), db_now()), keep)
            ).where(which),
        )
        return stmt.on_conflict_do_update(
            index_elements=[p.c.id],
            set_={"purged_at": stmt.excluded.purged_at, "keep_until": stmt.excluded.keep_until},
        )

    def purge_tombstones(self, *, limit: int | None = None) -> int:
        """Delete one batch of tombstones kept past their ``keep_until``; how many."""
        p = self.t.purged
        batch = limit or self.config.retention_batch_size
        old = select(p.c.id).where(p.c.keep_until < db_now()).limit(batch)
        if self.is_pg:
            old = old.with_for_update(skip_locked=True)
        stmt = delete(p).where(p.c.id.in_(old.scalar_subquery()))
        return int(self._tx(lambda conn, _: conn.execute(stmt).rowcount, single=True))

    # -- pauses ----------------------------------------------------------------------------

    def pause(self, kind: str, target: str, *, actor: str, reason: str) -> bool:
        """Pause a queue or a task name. ``False``: it was already paused (nothing
        changes, nothing is logged)."""
        p, log = self.t.pauses, self.t.pause_log

        def op(conn: Connection, _: bool) -> bool:
            inserted = conn.execute(
                self._insert(p)
                .values(kind=kind, target=target, actor=actor, reason=reason, paused_at=db_now())
                .on_conflict_do_nothing()
                .returning(p.c.target)
            ).first()
            if inserted is None:
                return False
            conn.execute(
                insert(log).values(
                    kind=kind,
                    target=target,
                    action="pause",
                    actor=actor,
                    reason=reason,
                    at=db_now(),
                )
            )
            return True

        return self._tx(op)

    def resume(self, kind: str, target: str, *, actor: str, reason: str) -> bool:
        """Resume a paused queue or task name. ``False``: it was not paused."""
        p, log = self.t.pauses, self.t.pause_log

        def op(conn: Connection, _: bool) -> bool:
            gone = conn.execute(
                delete(p).where(p.c.kind == kind, p.c.target == target).returning(p.c.target)
            ).first()
            if gone is None:
                return False
            conn.execute(
                insert(log).values(
                    kind=kind,
                    target=target,
                    action="resume",
                    actor=actor,
                    reason=reason,
                    at=db_now(),
                )
            )
            return True

        return self._tx(op)

    def pauses(self) -> list[Pause]:
        """Everything paused now, oldest pause first."""
        p = self.t.pauses
        rows = self._read(lambda conn: conn.execute(select(p).order_by(p.c.paused_at)).all())
        return [Pause(r.kind, r.target, r.actor, r.reason, r.paused_at) for r in rows]

    def pause_history(self, *, limit: int = 100) -> list[PauseEvent]:
        """The pauses' audit log, newest first."""
        log = self.t.pause_log
        q = select(log).order_by(log.c.id.desc()).limit(limit)
        rows = self._read(lambda conn: conn.execute(q).all())
        return [PauseEvent(r.kind, r.target, r.action, r.actor, r.reason, r.at) for r in rows]

    def hold_for_pause(self, task_id: str) -> bool:
        """A delivery of a paused task was dropped without running: its PENDING row is
        marked as published long ago (:data:`HELD`), so that the reaper publishes it
        again once the pause ends (and not before: :meth:`paused_names_clause`).
        ``False``: the row is not PENDING."""
        t = self.t.tasks

        def op(conn: Connection, _: bool) -> bool:
            count = conn.execute(
                update(t)
                .where(t.c.id == task_id, state_is(t, State.PENDING))
                .values(published_at=HELD)
            ).rowcount
            return bool(count)

        return self._tx(op, single=True)
