"""Follow-ups recorded with a success: what is left to publish, and marking it done.

A SUCCEEDED row whose success sends follow-ups (the chain's next task, ``link``
callbacks, the chord's part-return) carries ``follow_ups_at``, written in the
outcome's own transaction. Whoever publishes them clears it; a row still carrying it
after ``lease_publish_grace`` is taken by the reaper, which publishes them from the
stored message and result.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection, select, update

from ..states import State
from ._base import StoreBase
from ._sql import after, db_now
from ._types import FollowUps


class FollowUpsMixin(StoreBase):
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
                    self._publishes(),
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
