"""What to publish (again): due retries, pending rows, messages lost before their claim.

The row is the outbox: a PENDING row is published sooner or later.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import (
    Connection,
    Row,
    or_,
    select,
    update,
)

from ..states import State
from ._pauses import PausesMixin
from ._sql import db_now, seconds_between
from ._types import Publishable


class PublishingMixin(PausesMixin):
    def _publishable_columns(self) -> tuple[Any, ...]:
        t = self.t.tasks
        return (
            t.c.name,
            t.c.args,
            t.c.kwargs,
            t.c.options,
            t.c.retries,
            seconds_between(t.c.eta, db_now()).label("countdown"),
            t.c.message,
            t.c.origin,
        )

    @staticmethod
    def _publishable(rows: Iterable[Row[Any]]) -> list[Publishable]:
        out = []
        for r in rows:
            countdown = float(r.countdown) if r.countdown is not None and r.countdown > 0 else None
            out.append(
                Publishable(
                    str(r.id),
                    r.name,
                    r.args,
                    r.kwargs,
                    r.options,
                    int(r.retries),
                    countdown,
                    r.message,
                    r.origin,
                )
            )
        return out

    def take_due_retries(self, *, actor: str, limit: int | None = None) -> list[Publishable]:
        """RETRY_WAIT rows whose ``next_retry_at`` has come -> PENDING, to publish."""
        t = self.t.tasks
        batch = limit or self.config.reaper_batch_size

        def op(conn: Connection, _: bool) -> list[Publishable]:
            q = (
                select(t.c.id)
                .where(t.c.state == State.RETRY_WAIT.value, t.c.next_retry_at <= db_now())
                .where(self._publishes())  # another broker's row: its own app publishes it
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
                values={"published_at": None, "eta": None, "publish_count": 0},
                returning=self._publishable_columns(),
            )
            return self._publishable(rows)

        return self._tx(op)

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
        never, lost = self._never_published(), self._message_lost()

        def op(conn: Connection, _: bool) -> list[Publishable]:
            q = (
                select(t.c.id)
                .where(t.c.state == State.PENDING.value, or_(never, lost))
                .where(self.paused_names_clause())  # held until the pause ends
                .where(self._publishes())  # another broker's row: its own app publishes it
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
            .values(published_at=None, updated_at=db_now())
            .returning(t.c.id, *self._publishable_columns())
        ).all()
        return self._publishable(rows)
