"""Rows the reaper leaves alone because the broker says their queue still holds
messages (see :mod:`celery_lease._broker`)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection, select, update

from ..states import State
from ._base import StoreBase, state_is
from ._sql import db_now


class BacklogMixin(StoreBase):
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
