"""Submission: the new row with its creation audit row, and recording that its message
was published."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Float,
    Integer,
    String,
    Text,
    any_,
    bindparam,
    delete,
    exc,
    insert,
    literal,
    null,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql

from ..config import LeaseConfig
from ..states import Actor, State
from . import _engine
from ._base import TransitionEvent, state_is
from ._executor import Executor
from ._marks import PublishedMarks
from ._sql import after, db_now
from ._totals import TotalsMixin
from ._types import NewTask

#: Columns of a new row taken from :class:`NewTask` (bound as ``b_<name>``).
_SUBMIT = (
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


@dataclasses.dataclass(frozen=True)
class JoinedSubmission:
    """A row written in a caller's open transaction (see ``Store.submit_joined``)."""

    task_id: str
    #: ``False``: a row with that id or dedup key existed; nothing was written.
    created: bool
    #: To hand to ``Store.announce`` once the caller's transaction committed.
    events: tuple[TransitionEvent, ...]


def _submit_params(new: NewTask) -> dict[str, Any]:
    params = {f"b_{c}": getattr(new, c) for c in _SUBMIT}
    params["b_countdown"] = new.countdown
    params["b_eta"] = new.eta
    return params


class ProducerMixin(TotalsMixin):
    def __init__(self, config: LeaseConfig) -> None:
        super().__init__(config)
        self._marks = PublishedMarks(self.mark_published)

    def submit(self, new: NewTask, conn: Executor | None = None) -> tuple[str, bool]:
        """Insert a PENDING row; returns (task id, created). A duplicate dedup key or id
        returns the existing row's id with ``created=False``.

        With ``conn`` the row joins the caller's transaction (transactional enqueue; see
        :meth:`submit_joined`). Without, the same transaction also records the rows
        waiting in :meth:`mark_published_soon`.
        """
        params = _submit_params(new)
        countdown = new.countdown is not None

        def op(conn: Executor, is_retry: bool, marks: Sequence[str] = ()) -> tuple[str, bool]:
            insert_stmt = self._prepared(
                ("submit", countdown), lambda: self._submit_insert(countdown)
            )
            created = conn.execute(insert_stmt, params).scalar()
            if marks:
                self._mark(conn, marks)
            if created is not None:
                self._audit(conn, new.id, None, State.PENDING, "submitted", "producer", 0)
                return new.id, True
            existing = conn.execute(self._prepared("existing", self._existing), params).scalar()
            if existing is None:  # the conflicting row was purged meanwhile: insert again
                return op(conn, is_retry)
            return str(existing), False

        if conn is not None:
            return op(conn, False)
        marks = self._marks.take()
        try:
            if not self.is_pg:
                return self._tx(lambda conn, is_retry: op(conn, is_retry, marks))

            def fast(conn: Connection, _: bool) -> tuple[str, bool] | None:
                # row, audit row, waiting "published" marks and the dedup answer in one
                # statement: one round trip in autocommit
                stmt = self._prepared(("submit-pg", countdown), lambda: self._submit_pg(countdown))
                row = conn.execute(stmt, {**params, "b_marks": marks}).one()
                if row.created is not None:
                    self._record_event(
                        TransitionEvent(
                            new.id, new.name, None, State.PENDING, "submitted", "producer", 0
                        )
                    )
                    return new.id, True
                if row.existing is not None:
                    return str(row.existing), False
                return None  # a conflicting row this statement's snapshot cannot see

            return self._single_then(fast, op)
        except BaseException:
            self._marks.put_back(marks)
            raise

    def submit_joined(self, new: NewTask, conn: Executor) -> JoinedSubmission:
        """:meth:`submit` in the caller's open transaction on ``conn`` (a SQLAlchemy
        ``Connection``, or the Django adapter's executor): the row commits or rolls back
        with the caller's data.

        Its transitions are returned instead of told: the caller hands them to
        :meth:`announce` once its transaction committed (the listeners must not hear of
        a row that may still roll back).

        Raises:
            StoreError: a driver error on a SQLAlchemy connection.
        """
        events: list[TransitionEvent] = []
        local = self._local
        saved = getattr(local, "events", None)
        local.events = events
        try:
            tid, created = self.submit(new, conn=conn)
        except exc.SQLAlchemyError as error:
            raise _engine.wrap(error, self.url) from error
        finally:
            local.events = saved
        return JoinedSubmission(tid, created, tuple(events))

    def _submit_insert(self, countdown: bool) -> Any:
        t = self.t.tasks
        values: dict[str, Any] = {c: bindparam(f"b_{c}", type_=t.c[c].type) for c in _SUBMIT}
        values.update(
            state=State.PENDING.value,
            created_at=db_now(),
            updated_at=db_now(),
            reason="submitted",
            eta=(
                after(db_now(), bindparam("b_countdown", type_=Float))
                if countdown
                else bindparam("b_eta", type_=t.c.eta.type)
            ),
        )
        return self._insert(t).values(**values).on_conflict_do_nothing().returning(t.c.id)

    def _existing(self) -> Any:
        t = self.t.tasks
        return (
            select(t.c.id)
            .where(
                or_(
                    t.c.id == bindparam("b_id", type_=t.c.id.type),
                    t.c.dedup_key == bindparam("b_dedup_key", type_=t.c.dedup_key.type),
                )
            )
            .limit(1)
        )

    def _submitted_audit(self, inserted: Any) -> Any:
        """PostgreSQL: the ``None -> PENDING`` audit rows of the rows a CTE inserted,
        as CTE ``audit``."""
        return (
            insert(self.t.transitions)
            .from_select(
                ["task_id", "from_state", "to_state", "reason", "actor", "attempt", "at"],
                select(
                    inserted.c.id,
                    null(),
                    literal(State.PENDING.value, String),
                    literal("submitted", Text),
                    literal(Actor.PRODUCER.value, String),
                    literal(0, Integer),
                    db_now(),
                ),
            )
            .cte("audit")
        )

    def _submit_pg(self, countdown: bool) -> Any:
        t = self.t.tasks
        inserted = self._submit_insert(countdown).cte("inserted")
        marked = self._mark_statement(
            t.c.id == any_(bindparam("b_marks", type_=postgresql.ARRAY(String)))
        )
        # the statement's snapshot does not see its own insert: "existing" is the row
        # that made the insert conflict (a duplicate dedup key or id)
        return select(
            select(inserted.c.id).scalar_subquery().label("created"),
            self._existing().scalar_subquery().label("existing"),
        ).add_cte(self._submitted_audit(inserted), marked.cte("marked"))

    def _mark_statement(self, which: ColumnElement[bool]) -> Any:
        t = self.t.tasks
        return (
            update(t)
            .where(which, state_is(t, State.PENDING), t.c.published_at.is_(None))
            .values(published_at=db_now(), publish_count=t.c.publish_count + 1)
        )

    def _mark(self, conn: Executor, ids: Sequence[str]) -> None:
        t = self.t.tasks
        stmt = self._prepared(
            "mark",
            lambda: self._mark_statement(t.c.id.in_(bindparam("b_ids", expanding=True))),
        )
        conn.execute(stmt, {"b_ids": list(ids)})

    def mark_published(self, ids: Sequence[str]) -> None:
        """Record that these PENDING rows' messages were handed to the broker."""
        if ids:
            self._tx(lambda conn, _: self._mark(conn, ids), single=True)

    def mark_published_soon(self, task_id: str) -> None:
        """:meth:`mark_published` for one row, recorded a few milliseconds later with
        others (in this process's next submit, or in one statement for many rows).

        Until then the row looks unpublished; if this process dies first, the reaper
        publishes the row again after ``lease_publish_grace`` and the extra message is
        dropped at claim.
        """
        self._marks.add(task_id)

    def flush_published(self) -> None:
        """Record every row waiting in :meth:`mark_published_soon` now."""
        self._marks.flush()

    def discard_unpublished(self, task_id: str) -> None:
        """Delete a row whose message could not be built (nothing was published)."""
        t, tr = self.t.tasks, self.t.transitions

        def op(conn: Connection, _: bool) -> None:
            gone = conn.execute(
                delete(t).where(
                    t.c.id == task_id,
                    t.c.state == State.PENDING.value,
                    t.c.attempt == 0,
                    t.c.published_at.is_(None),
                )
            ).rowcount
            if gone:
                self._delete_audit(conn, tr.c.task_id == task_id)

        self._tx(op)
