"""The execution's own outcome and its retries, fenced by attempt and token."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    bindparam,
    select,
)

from .. import states
from ..states import Actor, State
from ._base import StoreBase
from ._sql import after, db_now
from ._types import Lease


def retry_published(requeued: bool = False) -> str:
    """The reason of a retry's ``RETRY_WAIT -> PENDING``, written with it by its worker."""
    return f"retry {'requeued' if requeued else 'published'} by its worker"


class OutcomeMixin(StoreBase):
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
    ) -> bool:
        """The execution's own outcome (SUCCEEDED, FAILED, CANCELLED, WAIT_MANUAL),
        fenced by attempt and token. ``False``: the lease was lost; nothing was written.

        ``follow_ups``: the success sends follow-ups (chain, ``link`` callbacks, chord
        part-return), recorded with it (``follow_ups_at``) until :meth:`follow_ups_sent`
        says they are published; the reaper publishes them if that never comes."""
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

        def fast(conn: Connection, _: bool) -> bool | None:
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
    ) -> bool:
        """RUNNING -> RETRY_WAIT -> PENDING, fenced, in one transaction: the retry is due
        ``delay`` seconds from now (database time) and its message goes out at once.

        ``message``: the retry's message as Celery built it (stored in the row, which is
        its outbox: if it is never published, the reaper publishes it). ``requeued``:
        the broker keeps the delivered message (a ``Reject(requeue=True)``), so the row
        is recorded published. ``False``: the lease was lost; nothing was written."""

        def op(conn: Connection, is_retry: bool) -> bool:
            return self._retry_one(
                conn, lease, delay, actor, reason, error, message, requeued, is_retry
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
                reason=retry_published(requeued),
                actor=actor,
                values=due,
            )
            return True
        if is_retry:
            row = conn.execute(select(t.c.state, t.c.token).where(t.c.id == lease.task_id)).first()
            return row is not None and row.token == lease.token and row.state == "PENDING"
        return False
