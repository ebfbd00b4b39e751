"""What operators read and do: records, history, and transitions made by a person."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, case, delete, select, update

from .. import states
from ..exceptions import TaskNotFound
from ..states import STEP_DONE, Actor, State
from ._reads import ReadsMixin
from ._sql import db_now
from ._tombstones import TombstonesMixin
from ._totals import TotalsMixin


class OperatorMixin(ReadsMixin, TombstonesMixin, TotalsMixin):
    # -- operator transitions ---------------------------------------------------------

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
