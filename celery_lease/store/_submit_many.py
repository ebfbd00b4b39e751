"""Bulk submission: many PENDING rows in one multi-row statement per batch.

What ``LeasedTask.submit_many`` and ``celery_lease.bulk()`` write before they publish:
the rows (with their audit rows) of up to ``batch_size`` tasks per transaction, then
the ids of those that already existed (a duplicate dedup key or id), in one more
read. The row is still written before its message is published.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, insert, or_, select

from ..states import Actor, State
from ._base import StoreBase, TransitionEvent
from ._sql import after, db_now
from ._types import NewTask

#: Rows per statement: well under SQLite's and PostgreSQL's bound-parameter limits.
BATCH_SIZE = 500

#: Columns of a new row taken from :class:`NewTask` as they are.
_COLUMNS = (
    "id",
    "name",
    "dedup_key",
    "args",
    "kwargs",
    "options",
    "message",
    "lease_ttl",
    "max_runtime",
    "max_retries",
    "on_timeout",
    "on_exhausted",
    "max_recoveries",
)


class SubmitManyMixin(StoreBase):
    def submit_many(
        self, rows: Sequence[NewTask], *, batch_size: int = BATCH_SIZE
    ) -> list[tuple[str, bool]]:
        """Insert PENDING rows, ``batch_size`` per statement and transaction; for each
        row in order, (task id, created). A duplicate dedup key or id (also one earlier
        in ``rows``: the first wins) gives the existing row's id with ``created=False``.
        """
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        out: list[tuple[str, bool]] = []
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]

            def write(
                conn: Connection, is_retry: bool, chunk: Sequence[NewTask] = chunk
            ) -> list[tuple[str, bool]]:
                return self._submit_chunk(conn, chunk, is_retry)

            out.extend(self._tx(write))
        return out

    def _submit_chunk(
        self, conn: Connection, rows: Sequence[NewTask], is_retry: bool
    ) -> list[tuple[str, bool]]:
        t, tr = self.t.tasks, self.t.transitions
        now = db_now()
        values: list[dict[str, Any]] = []
        for new in rows:
            row: dict[str, Any] = {c: getattr(new, c) for c in _COLUMNS}
            row.update(
                state=State.PENDING.value,
                created_at=now,
                updated_at=now,
                reason="submitted",
                eta=after(now, new.countdown) if new.countdown is not None else new.eta,
            )
            values.append(row)
        inserted = self._insert(t).values(values).on_conflict_do_nothing().returning(t.c.id)
        created = {str(i) for i in conn.execute(inserted).scalars()}
        if created:
            conn.execute(
                insert(tr).values(
                    [
                        {
                            "task_id": new.id,
                            "from_state": None,
                            "to_state": State.PENDING.value,
                            "reason": "submitted",
                            "actor": Actor.PRODUCER.value,
                            "attempt": 0,
                            "at": now,
                        }
                        for new in rows
                        if new.id in created
                    ]
                )
            )
            for new in rows:
                if new.id in created:
                    self._record_event(
                        TransitionEvent(
                            new.id,
                            new.name,
                            None,
                            State.PENDING,
                            "submitted",
                            Actor.PRODUCER.value,
                            0,
                        )
                    )
        others = [new for new in rows if new.id not in created]
        if not others:
            return [(new.id, True) for new in rows]
        ids = [new.id for new in others]
        keys = [new.dedup_key for new in others if new.dedup_key is not None]
        found = conn.execute(
            select(t.c.id, t.c.dedup_key).where(
                or_(t.c.id.in_(ids), t.c.dedup_key.in_(keys)) if keys else t.c.id.in_(ids)
            )
        ).all()
        by_id = {str(r.id) for r in found}
        by_key = {r.dedup_key: str(r.id) for r in found if r.dedup_key is not None}
        answer: list[tuple[str, bool]] = []
        for new in rows:
            if new.id in created:
                answer.append((new.id, True))
            elif new.dedup_key is not None and new.dedup_key in by_key:
                existing = by_key[new.dedup_key]
                # a try whose commit went through but whose answer was lost wrote it
                answer.append((existing, is_retry and existing == new.id))
            elif new.id in by_id:
                answer.append((new.id, is_retry))
            else:  # the conflicting row was purged meanwhile: write it on its own
                answer.append(self._submit_chunk(conn, [new], is_retry)[0])
        return answer
