"""Bulk submission: many PENDING rows in one multi-row statement per batch.

What ``LeasedTask.submit_many`` and ``celery_lease.bulk()`` write before they publish:
the rows (with their audit rows) of up to ``batch_size`` tasks per transaction, then
the ids of those that already existed (a duplicate dedup key or id), in one more
read. The row is still written before its message is published.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from sqlalchemy import Connection, or_, select

from ..states import Actor, State
from ._base import TransitionEvent
from ._producer import ProducerMixin, _submit_params
from ._types import NewTask

#: Rows per statement: well under SQLite's and PostgreSQL's bound-parameter limits.
BATCH_SIZE = 500


class SubmitManyMixin(ProducerMixin):
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
        # the single-row statements of submit(), built once and run as executemany:
        # SQLAlchemy sends each as multi-row INSERT ... VALUES pages ("insertmanyvalues")
        created: set[str] = set()
        for countdown in (False, True):
            params = [_submit_params(n) for n in rows if (n.countdown is not None) is countdown]
            if not params:
                continue
            stmt = self._prepared(
                ("submit", countdown), functools.partial(self._submit_insert, countdown)
            )
            created.update(str(i) for i in conn.execute(stmt, params).scalars())
        if created:
            audit = [
                {
                    "b_task_id": new.id,
                    "b_from": None,
                    "b_to": State.PENDING.value,
                    "b_reason": "submitted",
                    "b_actor": Actor.PRODUCER.value,
                    "b_attempt": 0,
                }
                for new in rows
                if new.id in created
            ]
            conn.execute(self._prepared("audit", self._audit_insert), audit)
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
        t = self.t.tasks
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
