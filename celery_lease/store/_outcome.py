"""Execution's end: the execution's own outcome and its retries, one or many at once,
each fenced by attempt and token.

A worker's outcome writer collects the outcomes of the executions that finished in the
last few milliseconds and writes them with :meth:`Outcomes.finish_many` (and the
retries with :meth:`Outcomes.retry_many`); each row is fenced by its own attempt and
token exactly as :meth:`Outcomes.finish` fences one, and a row whose lease was lost is
not written and is answered ``False``. On PostgreSQL a batch is one statement: an
``UPDATE ... FROM unnest(...)`` (one element per outcome, arrays as bind parameters,
so the statement text is the same for every batch size and is prepared once) with the
audit rows inserted by a data-modifying CTE over the updated rows. On SQLite a batch
is one transaction.

A success that sends follow-ups (the chain's next task, ``link`` callbacks, the
chord's part-return) records ``follow_ups_at`` in the outcome's own transaction;
whoever publishes them clears it (:meth:`Outcomes.follow_ups_sent`), and the reaper
publishes those still recorded after ``lease_publish_grace``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    Boolean,
    ColumnElement,
    Connection,
    Float,
    Integer,
    String,
    Text,
    bindparam,
    case,
    column,
    func,
    insert,
    literal,
    select,
    union_all,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY

from .. import states
from ..exceptions import IllegalTransition
from ..states import Actor, State
from ._base import state_is
from ._slots import Slots
from ._types import Lease, Outcome, TransitionEvent
from .schema import after, db_now


def retry_published(requeued: bool = False) -> str:
    """The reason of a retry's ``RETRY_WAIT -> PENDING``, written with it by its worker."""
    return f"retry {'requeued' if requeued else 'published'} by its worker"


#: The reason of a held retry's ``RETRY_WAIT -> PENDING``: not published by its worker.
RETRY_HELD = "retry held in the store until due (lease_hold_eta_after); the reaper publishes it"


def _unnest(*columns: tuple[str, str, Any]) -> Any:
    """PostgreSQL: ``unnest`` of bound arrays as the derived table ``v``; each column
    is (bind parameter, column name, element type)."""
    return (
        func.unnest(*(bindparam(param, type_=ARRAY(kind)) for param, _, kind in columns))
        .table_valued(*(column(name, kind) for _, name, kind in columns))
        .render_derived(name="v")
    )


#: The bound arrays naming each element's lease (id, attempt, token).
_LEASES = (
    ("b_ids", "id", String),
    ("b_attempts", "attempt", Integer),
    ("b_tokens", "token", String),
)


def _running_as(t: Any, v: Any) -> list[Any]:
    """Each row still RUNNING under the lease of its element of ``v`` (the fence)."""
    return [
        t.c.id == v.c.id,
        t.c.attempt == v.c.attempt,
        t.c.token == v.c.token,
        state_is(t, State.RUNNING),
    ]


#: Outcomes a batch writes (the execution's own final states).
BATCHED = (State.SUCCEEDED, State.FAILED, State.CANCELLED)


class Outcomes(Slots):
    """Outcomes and retries, one or many; follow-ups marked sent."""

    # -- one outcome, one retry ------------------------------------------------------------

    def finish(
        self,
        lease: Lease,
        to: State,
        *,
        actor: str,
        reason: str,
        result: str | None = None,
        error: str | None = None,
        follow_ups: bool = False,
        holds_slot: bool = False,
    ) -> bool:
        """The execution's own outcome (SUCCEEDED, FAILED, CANCELLED, WAIT_MANUAL),
        fenced by attempt and token. ``False``: the lease was lost; nothing was written.

        ``follow_ups``: the success sends follow-ups (chain, ``link`` callbacks, chord
        part-return), recorded with it (``follow_ups_at``) until :meth:`follow_ups_sent`
        says they are published; the reaper publishes them if that never comes.

        ``holds_slot``: the run's claim took a concurrency slot. On PostgreSQL the
        outcome then also tells, in its statement, whether its free needs a grant
        (see :meth:`~celery_lease.store._slots.Slots._free_pg`); without it the free
        is granted after the commit, which is always correct, one read dearer."""
        t = self.t.tasks
        params = {
            "b_task_id": lease.task_id,
            "b_attempt": lease.attempt,
            "b_token": lease.token,
            "b_result": result,
            "b_error": error,
        }
        # RUNNING first; over max_runtime the row went to WAIT_MANUAL but its owner kept
        # running, and may still finish from there
        sources = sorted(states.sources(to, Actor.TASK), key=lambda s: s is not State.RUNNING)

        def move(conn: Connection, frm: State) -> bool:
            return bool(
                self._move_prepared(
                    conn,
                    ("finish", to, follow_ups),
                    lambda: self._finish_spec(follow_ups),
                    params,
                    frm,
                    to,
                    reason=reason,
                    actor=actor,
                )
            )

        def freeing_statement() -> Any:
            where, values, returning = self._finish_spec(follow_ups)
            stmt = self._move_update(where, State.RUNNING, to, values, returning)
            return self._free_pg(stmt, State.RUNNING, to)

        def freeing(conn: Connection) -> bool:
            stmt = self._prepared(("finish-slot", to, follow_ups), freeing_statement)
            rows = conn.execute(stmt, {**params, "b_reason": reason, "b_actor": actor}).all()
            for row in rows:
                if row.slot_key is not None and (row.waiting or not row.settled):
                    self._note_grant_due(str(row.name), str(row.slot_key))
                self._record_event(
                    TransitionEvent(
                        row.id, row.name, State.RUNNING, to, reason, actor, int(row.attempt)
                    )
                )
            return bool(rows)

        def fast(conn: Connection, _: bool) -> bool | None:
            if holds_slot and self.is_pg:
                return True if freeing(conn) else None
            return True if move(conn, State.RUNNING) else None

        def op(conn: Connection, is_retry: bool) -> bool:
            if any(move(conn, frm) for frm in sources):
                return True
            if is_retry:
                row = conn.execute(
                    select(t.c.state, t.c.token).where(t.c.id == lease.task_id)
                ).first()
                return row is not None and row.token == lease.token and row.state == to.value
            return False

        return self._single_then(fast, op)

    def _finish_spec(
        self, follow_ups: bool = False
    ) -> tuple[list[ColumnElement[bool]], dict[str, Any], tuple[Any, ...]]:
        """Where and values of an outcome, fenced by bind parameters ``b_task_id``,
        ``b_attempt`` and ``b_token``; ``b_result`` and ``b_error`` are stored; with
        ``follow_ups``, the follow-ups are recorded as not yet published."""
        t = self.t.tasks
        where = [
            t.c.id == bindparam("b_task_id", type_=t.c.id.type),
            t.c.attempt == bindparam("b_attempt", type_=t.c.attempt.type),
            t.c.token == bindparam("b_token", type_=t.c.token.type),
        ]
        values = {
            "finished_at": db_now(),
            "result": bindparam("b_result", type_=t.c.result.type),
            "error": bindparam("b_error", type_=t.c.error.type),
        }
        if follow_ups:
            values["follow_ups_at"] = db_now()
        return where, values, ()

    def schedule_retry(
        self,
        lease: Lease,
        delay: float,
        *,
        actor: str,
        reason: str,
        error: str | None,
        message: str | None = None,
        requeued: bool = False,
        held: bool = False,
    ) -> bool:
        """RUNNING -> RETRY_WAIT -> PENDING, fenced, in one transaction: the retry is due
        ``delay`` seconds from now (database time) and its message goes out at once, or,
        ``held``, is kept in the row until the reaper publishes it, due (see
        :meth:`holds`, :meth:`take_held`).

        ``message``: the retry's message as Celery built it (stored in the row, which is
        its outbox: if it is never published, the reaper publishes it). ``requeued``:
        the broker keeps the delivered message (a ``Reject(requeue=True)``), so the row
        is recorded published. ``False``: the lease was lost; nothing was written."""

        def op(conn: Connection, is_retry: bool) -> bool:
            return self._retry_one(
                conn, lease, delay, actor, reason, error, message, requeued, is_retry, held
            )

        return self._tx(op)

    def _retry_one(
        self,
        conn: Connection,
        lease: Lease,
        delay: float,
        actor: str,
        reason: str,
        error: str | None,
        message: str | None,
        requeued: bool,
        is_retry: bool,
        held: bool = False,
    ) -> bool:
        """:meth:`schedule_retry`'s writes, in the caller's transaction."""
        t = self.t.tasks
        retry_values: dict[str, Any] = {
            "next_retry_at": after(db_now(), delay),
            "retries": t.c.retries + 1,
            "error": error,
        }
        due: dict[str, Any] = {
            "eta": t.c.next_retry_at,
            "next_retry_at": None,
            "published_at": db_now() if requeued else None,
            "publish_count": 0,
            "held": held,
        }
        if message is not None:
            due["message"] = message
        rows = self._move(
            conn,
            self._fenced(lease),
            State.RUNNING,
            State.RETRY_WAIT,
            reason=reason,
            actor=actor,
            values=retry_values,
        )
        if rows:
            self._move(
                conn,
                [t.c.id == lease.task_id],
                State.RETRY_WAIT,
                State.PENDING,
                reason=RETRY_HELD if held else retry_published(requeued),
                actor=actor,
                values=due,
            )
            return True
        if is_retry:
            row = conn.execute(select(t.c.state, t.c.token).where(t.c.id == lease.task_id)).first()
            return row is not None and row.token == lease.token and row.state == "PENDING"
        return False

    # -- many at once (the outcome writer) -------------------------------------------------

    def finish_many(self, outcomes: Sequence[Outcome], *, actor: str) -> list[bool]:
        """Write many executions' outcomes (SUCCEEDED, FAILED, CANCELLED) at once,
        each fenced by its attempt and token; one answer per outcome, in order.

        ``False``: that lease was lost; nothing was written for it. A row that left
        RUNNING for WAIT_MANUAL while its owner kept running (over ``max_runtime``)
        is finished from there by :meth:`Store.finish`, one by one (rare).

        Raises:
            IllegalTransition: an outcome's state is not one a batch writes.
        """
        if not outcomes:
            return []
        for o in outcomes:
            if o.to not in BATCHED:
                raise IllegalTransition(o.lease.task_id, State.RUNNING, o.to)
            states.check(State.RUNNING, o.to, o.lease.task_id)
        retried = False

        def op(conn: Connection, is_retry: bool) -> set[tuple[str, int]]:
            nonlocal retried
            retried = retried or is_retry
            if self.is_pg:
                return self._finish_batch_pg(conn, outcomes, actor)
            return self._finish_batch_sqlite(conn, outcomes, actor)

        done = self._tx(op, single=self.is_pg)
        answers: list[bool] = []
        for o in outcomes:
            if (o.lease.task_id, o.lease.attempt) in done:
                answers.append(True)
                continue
            answers.append(self._finish_missed(o, actor, retried))
        return answers

    def _finish_missed(self, o: Outcome, actor: str, retried: bool) -> bool:
        """An outcome the batch did not write: lost, finished from WAIT_MANUAL, or
        (after a retried batch whose commit's answer was lost) already written."""
        if any(s is not State.RUNNING for s in states.sources(o.to, Actor.TASK)):
            ok = self.finish(
                o.lease, o.to, actor=actor, reason=o.reason, result=o.result, error=o.error
            )
            if ok:
                return bool(ok)
        if not retried:
            return False
        t = self.t.tasks

        def read(conn: Connection) -> bool:
            row = conn.execute(
                select(t.c.state, t.c.token).where(t.c.id == o.lease.task_id)
            ).first()
            return row is not None and row.token == o.lease.token and row.state == o.to.value

        return self._read(read)

    def _finish_batch_sqlite(
        self, conn: Connection, outcomes: Sequence[Outcome], actor: str
    ) -> set[tuple[str, int]]:
        done: set[tuple[str, int]] = set()
        for o in outcomes:
            moved = self._move_prepared(
                conn,
                ("finish", o.to),
                self._finish_spec,
                {
                    "b_task_id": o.lease.task_id,
                    "b_attempt": o.lease.attempt,
                    "b_token": o.lease.token,
                    "b_result": o.result,
                    "b_error": o.error,
                },
                State.RUNNING,
                o.to,
                reason=o.reason,
                actor=actor,
            )
            if moved:
                done.add((o.lease.task_id, o.lease.attempt))
        return done

    def _finish_batch_pg(
        self, conn: Connection, outcomes: Sequence[Outcome], actor: str
    ) -> set[tuple[str, int]]:
        stmt = self._prepared("finish_many", self._finish_many_statement)
        params = {
            "b_ids": [o.lease.task_id for o in outcomes],
            "b_attempts": [o.lease.attempt for o in outcomes],
            "b_tokens": [o.lease.token for o in outcomes],
            "b_tos": [o.to.value for o in outcomes],
            "b_reasons": [o.reason for o in outcomes],
            "b_results": [o.result for o in outcomes],
            "b_errors": [o.error for o in outcomes],
            "b_actor": actor,
        }
        done: set[tuple[str, int]] = set()
        rows = conn.execute(stmt, params).all()
        self._note_frees(rows)
        for row in rows:
            attempt = int(row.attempt)
            done.add((row.id, attempt))
            self._record_event(
                TransitionEvent(
                    row.id, row.name, State.RUNNING, State(row.state), row.reason, actor, attempt
                )
            )
        return done

    def _finish_many_statement(self) -> Any:
        """PostgreSQL: the fenced ``RUNNING -> outcome`` of every element of the bound
        arrays, and its audit rows, as one statement."""
        t = self.t.tasks
        v = _unnest(
            *_LEASES,
            ("b_tos", "to_state", String),
            ("b_reasons", "reason", Text),
            ("b_results", "result", Text),
            ("b_errors", "error", Text),
        )
        moved = (
            update(t)
            .where(*_running_as(t, v))
            .values(
                state=v.c.to_state,
                updated_at=db_now(),
                reason=v.c.reason,
                finished_at=db_now(),
                result=v.c.result,
                error=v.c.error,
            )
            .returning(t.c.id, t.c.attempt, t.c.name, t.c.state, t.c.reason, t.c.slot_key)
            .cte("moved")
        )
        return select(moved).add_cte(self._audit_of(moved, State.RUNNING))

    def retry_many(self, outcomes: Sequence[Outcome], *, actor: str) -> list[bool]:
        """Schedule many executions' retries at once: each row, fenced by its attempt
        and token, goes ``RUNNING -> RETRY_WAIT -> PENDING`` as
        :meth:`schedule_retry` moves one, due ``delay`` seconds from now
        (database time), with its message stored and not yet published (the caller
        publishes it, or the reaper does after ``lease_publish_grace``). One answer per
        outcome, in order; ``False``: that lease was lost, nothing was written for it.

        Raises:
            IllegalTransition: an outcome is not a retry.
        """
        if not outcomes:
            return []
        for o in outcomes:
            if o.to is not State.RETRY_WAIT:
                raise IllegalTransition(o.lease.task_id, State.RUNNING, o.to)
        states.check(State.RUNNING, State.RETRY_WAIT)
        states.check(State.RETRY_WAIT, State.PENDING)
        retried = False

        def op(conn: Connection, is_retry: bool) -> set[tuple[str, int]]:
            nonlocal retried
            retried = retried or is_retry
            if self.is_pg:
                return self._retry_batch_pg(conn, outcomes, actor)
            done: set[tuple[str, int]] = set()
            for o in outcomes:
                if self._retry_one(
                    conn,
                    o.lease,
                    o.delay,
                    actor,
                    o.reason,
                    o.error,
                    o.message,
                    False,
                    is_retry,
                    o.held,
                ):
                    done.add((o.lease.task_id, o.lease.attempt))
            return done

        done = self._tx(op, single=self.is_pg)
        answers: list[bool] = []
        t = self.t.tasks
        for o in outcomes:
            if (o.lease.task_id, o.lease.attempt) in done:
                answers.append(True)
            elif not (retried and self.is_pg):
                answers.append(False)
            else:  # a retried statement whose commit's answer was lost may have written it
                lease = o.lease

                def read(conn: Connection, lease: Lease = lease) -> bool:
                    row = conn.execute(
                        select(t.c.state, t.c.token).where(t.c.id == lease.task_id)
                    ).first()
                    return row is not None and row.token == lease.token and row.state == "PENDING"

                answers.append(self._read(read))
        return answers

    def _retry_batch_pg(
        self, conn: Connection, outcomes: Sequence[Outcome], actor: str
    ) -> set[tuple[str, int]]:
        stmt = self._prepared("retry_many", self._retry_many_statement)
        params = {
            "b_ids": [o.lease.task_id for o in outcomes],
            "b_attempts": [o.lease.attempt for o in outcomes],
            "b_tokens": [o.lease.token for o in outcomes],
            "b_delays": [float(o.delay) for o in outcomes],
            "b_reasons": [o.reason for o in outcomes],
            "b_errors": [o.error for o in outcomes],
            "b_messages": [o.message for o in outcomes],
            "b_held": [o.held for o in outcomes],
            "b_actor": actor,
            "b_published": retry_published(),
            "b_held_reason": RETRY_HELD,
        }
        done: set[tuple[str, int]] = set()
        rows = conn.execute(stmt, params).all()
        self._note_frees(rows)
        for row in rows:
            attempt = int(row.attempt)
            done.add((row.id, attempt))
            for frm, to, reason in (
                (State.RUNNING, State.RETRY_WAIT, row.retry_reason),
                (State.RETRY_WAIT, State.PENDING, row.reason),
            ):
                self._record_event(
                    TransitionEvent(row.id, row.name, frm, to, reason, actor, attempt)
                )
        return done

    def _retry_many_statement(self) -> Any:
        """PostgreSQL: the fenced ``RUNNING -> RETRY_WAIT -> PENDING`` of every element
        of the bound arrays, with both audit rows of each, as one statement."""
        t, tr = self.t.tasks, self.t.transitions
        v = _unnest(
            *_LEASES,
            ("b_delays", "delay", Float),
            ("b_reasons", "reason", Text),
            ("b_errors", "error", Text),
            ("b_messages", "message", Text),
            ("b_held", "held", Boolean),
        )
        published = case(
            (v.c.held, bindparam("b_held_reason", type_=Text)),
            else_=bindparam("b_published", type_=Text),
        )
        moved = (
            update(t)
            .where(*_running_as(t, v))
            .values(
                state=State.PENDING.value,
                updated_at=db_now(),
                reason=published,
                held=v.c.held,
                retries=t.c.retries + 1,
                error=v.c.error,
                next_retry_at=None,
                eta=after(db_now(), v.c.delay),
                published_at=None,
                publish_count=0,
                message=func.coalesce(v.c.message, t.c.message),
            )
            .returning(
                t.c.id,
                t.c.attempt,
                t.c.name,
                t.c.reason,
                t.c.slot_key,
                v.c.reason.label("retry_reason"),
            )
            .cte("moved")
        )
        actor = bindparam("b_actor", type_=String)
        columns = ["task_id", "from_state", "to_state", "reason", "actor", "attempt", "at"]

        def audit_rows(frm: State, to: State, reason: Any) -> Any:
            return select(
                moved.c.id,
                literal(frm.value, String),
                literal(to.value, String),
                reason,
                actor,
                moved.c.attempt,
                db_now(),
            )

        audit = (
            insert(tr)
            .from_select(
                columns,
                union_all(
                    audit_rows(State.RUNNING, State.RETRY_WAIT, moved.c.retry_reason),
                    audit_rows(State.RETRY_WAIT, State.PENDING, moved.c.reason),
                ),
            )
            .cte("audit")
        )
        return select(moved).add_cte(audit)

    # -- follow-ups ------------------------------------------------------------------------

    def follow_ups_sent(self, task_ids: Sequence[str]) -> None:
        """The follow-ups of these rows are published: nothing is left for the reaper."""
        if not task_ids:
            return
        t = self.t.tasks
        self._tx(
            lambda conn, _: conn.execute(
                update(t)
                .where(t.c.id.in_(list(task_ids)), t.c.follow_ups_at.is_not(None))
                .values(follow_ups_at=None)
            ),
            single=True,
        )
