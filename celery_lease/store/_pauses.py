"""Durable pauses per queue and per task name, and their audit log.

A pause is a row in ``<prefix>pauses`` while it lasts; every pause and resume adds a
row to ``<prefix>pause_log`` (who, why, when) in the same transaction. Workers read
the pauses at most once per heartbeat interval; the reaper leaves the rows of a paused
task name unpublished (see :meth:`PausesMixin.paused_names_clause`).
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import ColumnElement, Connection, delete, insert, select, update

from ..states import State
from ._base import StoreBase, state_is
from ._sql import db_now

#: The two things that can be paused.
KINDS = ("queue", "task")

#: ``published_at`` of a row whose delivery a pause dropped: long ago, so that the
#: reaper publishes it again as soon as no pause holds it (a lost message, in effect);
#: not ``NULL``, which a producer's deferred "published" mark could overwrite.
HELD = datetime(1970, 1, 1, tzinfo=timezone.utc)


@dataclasses.dataclass(frozen=True)
class Pause:
    """A queue or task name paused now."""

    kind: str
    target: str
    actor: str
    reason: str
    paused_at: datetime


@dataclasses.dataclass(frozen=True)
class PauseEvent:
    """One pause or resume, from the pauses' audit log."""

    kind: str
    target: str
    action: str
    actor: str
    reason: str
    at: datetime


class PausesMixin(StoreBase):
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

    def paused_names_clause(self) -> ColumnElement[bool]:
        """``tasks.name`` is not a paused task name (for the reaper's publishing)."""
        t, p = self.t.tasks, self.t.pauses
        paused: Any = select(p.c.target).where(p.c.kind == "task")
        return t.c.name.not_in(paused)
