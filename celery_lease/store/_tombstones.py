"""Tombstones of purged rows: a message that arrives after its task's row was purged
(``lease purge`` or retention) is not adopted as a new task.

A message of a purged row may still arrive: a cancelled task's countdown still queued,
a redelivery after a visibility timeout. Without its row, the claim would adopt it
("a message with no row is adopted") and run a task celery-lease has already ended.
Every purge writes a tombstone (id, purged_at, keep_until) in its own transaction,
kept until ``lease_retention`` (default a week when retention is off) after the later of
the purge and the row's ETA; the claim refuses to adopt an id that has one, and the
reaper deletes the tombstones past ``keep_until``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Connection, delete, func, select

from ..config import DEFAULT_RETENTION
from ._base import StoreBase
from ._sql import after, db_now, greatest


class TombstonesMixin(StoreBase):
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

    def _is_purged(self, conn: Connection, task_id: str) -> bool:
        """Whether ``task_id``'s row was purged and a late message of it is still refused."""
        p = self.t.purged
        return conn.execute(select(p.c.id).where(p.c.id == task_id)).first() is not None

    def purge_tombstones(self, *, limit: int | None = None) -> int:
        """Delete one batch of tombstones kept past their ``keep_until``; how many."""
        p = self.t.purged
        batch = limit or self.config.retention_batch_size
        old = select(p.c.id).where(p.c.keep_until < db_now()).limit(batch)
        if self.is_pg:
            old = old.with_for_update(skip_locked=True)
        stmt = delete(p).where(p.c.id.in_(old.scalar_subquery()))
        return int(self._tx(lambda conn, _: conn.execute(stmt).rowcount, single=True))
