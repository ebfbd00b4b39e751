"""Bulk operator actions: the rows a filter selects, and one batch of them moved in
one transaction (all or nothing: the first row the table refuses rolls its batch back).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, or_, select

from ..states import State
from ._operator import OperatorMixin
from ._sql import after, db_now


@dataclasses.dataclass(frozen=True)
class Filter:
    """Which tasks a bulk action takes; every field given must match."""

    state: State | None = None
    name: str | None = None
    #: Text the row's last reason contains (case-sensitive substring).
    reason_contains: str | None = None
    #: The owner of the latest attempt: a worker's node name or incarnation id.
    worker: str | None = None
    #: Seconds since the task was submitted, at least.
    older_than: float | None = None

    def is_empty(self) -> bool:
        return all(getattr(self, f.name) is None for f in dataclasses.fields(self))


@dataclasses.dataclass(frozen=True)
class Selected:
    """One row a filter selected, as it was when read."""

    id: str
    name: str
    state: State
    reason: str | None
    created_at: datetime
    has_args: bool


def _escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


class BulkMixin(OperatorMixin):
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
