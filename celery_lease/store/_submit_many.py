"""Bulk submission: many PENDING rows in one multi-row statement per batch.

What ``LeasedTask.submit_many``, ``celery_lease.bulk()`` and a group of leased tasks
write before they publish: the rows (with their audit rows) of up to ``batch_size``
tasks per transaction, then the ids of those that already existed (a duplicate dedup
key or id), in one more read. The row is still written before its message is
published.

On PostgreSQL a batch is one statement: ``INSERT ... SELECT FROM json_to_recordset(...)``
(the batch's rows as one JSON document, bound as one parameter, so the statement
text is the same for every batch and psycopg prepares it once; one document costs
the client far less than a text array per column, which psycopg escapes element by
element) with the audit rows inserted by a data-modifying CTE over the inserted
rows. On SQLite it is the single-row statement
of ``submit()`` run as an executemany, which SQLAlchemy sends as multi-row
``INSERT ... VALUES`` pages.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    Connection,
    DateTime,
    Float,
    Integer,
    String,
    Text,
    bindparam,
    case,
    cast,
    column,
    func,
    literal,
    or_,
    select,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import JSON

from ..exceptions import StoreUnavailable, SubmissionOutcomeUnknown
from ..states import Actor, State
from ._base import TransitionEvent
from ._producer import _SUBMIT, ProducerMixin, _submit_params
from ._sql import after, db_now
from ._types import Lease, NewTask


def _json_row(new: NewTask, n: int) -> dict[str, Any]:
    row: dict[str, Any] = {c: getattr(new, c) for c, _ in _FIELDS[:-2]}
    row["eta"] = None if new.eta is None else new.eta.isoformat()
    row["n"] = n
    return row


#: The columns of a PostgreSQL batch's JSON rows, with their SQL types.
_FIELDS: tuple[tuple[str, Any], ...] = (
    ("id", String),
    ("name", String),
    ("dedup_key", String),
    ("args", Text),
    ("kwargs", Text),
    ("options", Text),
    ("message", Text),
    ("lease_ttl", Float),
    ("max_runtime", Float),
    ("max_retries", Integer),
    ("on_timeout", String),
    ("on_exhausted", String),
    ("max_recoveries", Integer),
    ("countdown", Float),
    ("eta", DateTime(timezone=True)),
    ("n", Integer),  # the row's place in the batch
)

#: Rows per statement: well under SQLite's and PostgreSQL's bound-parameter limits.
BATCH_SIZE = 500


class SubmitManyMixin(ProducerMixin):
    def submit_many(
        self, rows: Sequence[NewTask], *, batch_size: int = BATCH_SIZE
    ) -> list[tuple[str, bool]]:
        """Insert PENDING rows, ``batch_size`` per statement and transaction; for each
        row in order, (task id, created). A duplicate dedup key or id (also one earlier
        in ``rows``: the first wins) gives the existing row's id with ``created=False``,
        except a new submission of a finished task's id without a dedup key: a fresh
        row replaces the finished one (``created=True``, see :meth:`submit`).
        """
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        out: list[tuple[str, bool]] = []
        sent = False
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]

            def write(
                conn: Connection, is_retry: bool, chunk: Sequence[NewTask] = chunk
            ) -> list[tuple[str, bool]]:
                nonlocal sent
                # PostgreSQL: the batch may commit without its answer reaching us.
                # SQLite: a failed batch wrote nothing, but earlier batches are written
                sent = sent or self.is_pg or bool(out)
                return self._submit_chunk(conn, chunk, is_retry)

            try:
                out.extend(self._tx(write))
            except StoreUnavailable as error:
                if not sent:
                    raise
                raise SubmissionOutcomeUnknown(
                    [new.id for new in rows],
                    f"{len(rows)} tasks: submission outcome unknown: {error}; some or all of "
                    "their rows may have been written (then the reaper publishes them): "
                    "retry with the same task ids or dedup keys",
                ) from error
        return out

    def replace(
        self, lease: Lease, rows: Sequence[NewTask], *, actor: str, reason: str
    ) -> list[tuple[str, bool]] | None:
        """``Task.replace()``: the replaced run's outcome and its replacement's rows, one
        transaction. The run ends SUCCEEDED (fenced by attempt and token; Celery records
        nothing for a replaced task, its id's result is the replacement's), then the rows
        are written as :meth:`submit_many` writes them: one with the replaced task's own
        id is a fresh row in place of the replaced run's. ``None``: the lease was lost,
        nothing written.
        """

        def op(conn: Connection, is_retry: bool) -> list[tuple[str, bool]] | None:
            ended = self._move(
                conn,
                self._fenced(lease),
                State.RUNNING,
                State.SUCCEEDED,
                reason=reason,
                actor=actor,
                values={"finished_at": db_now()},
            )
            if not ended:
                # lost; or a first try that committed and whose answer was lost (its rows
                # are PENDING and not marked published: the reaper publishes them)
                return None
            return self._submit_chunk(conn, rows, is_retry) if rows else []

        return self._tx(op)

    def _submit_chunk(
        self, conn: Connection, rows: Sequence[NewTask], is_retry: bool
    ) -> list[tuple[str, bool]]:
        created: set[str] = set()
        if self.is_pg:
            stmt = self._prepared("submit_many", self._submit_many_pg)
            doc = json.dumps([_json_row(new, i) for i, new in enumerate(rows)])
            created.update(str(i) for i in conn.execute(stmt, {"b_rows": doc}).scalars())
            self._announce_submitted(rows, created)
            return self._answer(conn, rows, created, is_retry)
        # the single-row statements of submit(), built once and run as executemany:
        # SQLAlchemy sends each as multi-row INSERT ... VALUES pages ("insertmanyvalues")
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
            self._announce_submitted(rows, created)
        return self._answer(conn, rows, created, is_retry)

    def _announce_submitted(self, rows: Sequence[NewTask], created: set[str]) -> None:
        """The ``None -> PENDING`` transitions of the rows created, for the listeners."""
        for new in rows:
            if new.id in created:
                self._record_event(
                    TransitionEvent(
                        new.id, new.name, None, State.PENDING, "submitted", Actor.PRODUCER.value, 0
                    )
                )

    def _answer(
        self, conn: Connection, rows: Sequence[NewTask], created: set[str], is_retry: bool
    ) -> list[tuple[str, bool]]:
        """Each row's (task id, created), the rows not created looked up."""
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
                # a new submission of a finished task's id is a new run (a fresh row)
                answer.append((new.id, is_retry or self._reopen(conn, new)))
            else:  # the conflicting row was purged meanwhile: write it on its own
                answer.append(self._submit_chunk(conn, [new], is_retry)[0])
        return answer

    def _submit_many_pg(self) -> Any:
        """PostgreSQL: a batch of PENDING rows and their audit rows, one statement."""
        t = self.t.tasks
        v = (
            func.json_to_recordset(cast(bindparam("b_rows", type_=Text), JSON))
            .table_valued(*(column(c, kind) for c, kind in _FIELDS))
            .render_derived(name="v", with_types=True)
        )
        names = [*_SUBMIT, "state", "created_at", "updated_at", "reason", "eta", "origin"]
        rows = select(
            *(v.c[c] for c in _SUBMIT),
            literal(State.PENDING.value, String),
            db_now(),
            db_now(),
            literal("submitted", Text),
            case((v.c.countdown.is_not(None), after(db_now(), v.c.countdown)), else_=v.c.eta),
            literal(self.config.origin, String),
        ).order_by(v.c.n)  # the first of two rows with one id or dedup key wins
        inserted = (
            postgresql.insert(t)
            .from_select(names, rows)
            .on_conflict_do_nothing()
            .returning(t.c.id)
            .cte("inserted")
        )
        return select(inserted.c.id).add_cte(self._submitted_audit(inserted))
