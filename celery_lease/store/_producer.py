"""Submission: the new row with its creation audit row, and recording that its message
was published."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    DateTime,
    Float,
    Integer,
    String,
    Text,
    and_,
    any_,
    bindparam,
    delete,
    exc,
    func,
    insert,
    literal,
    null,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql

from ..config import LeaseConfig
from ..exceptions import StoreError, StoreUnavailable, SubmissionOutcomeUnknown
from ..states import Actor, State
from . import _engine
from ._base import TransitionEvent, state_is
from ._deadline import WATCHDOG
from ._executor import Executor
from ._marks import PublishedMarks
from ._sql import after, db_now
from ._totals import TotalsMixin
from ._types import NewTask

#: Statements a submission tries when its insert conflicts with a row that its snapshot
#: cannot see (committed meanwhile, or purged meanwhile).
_CONFLICT_TRIES = 5
#: A reading of the database's clock is taken again after this many seconds.
_CLOCK_SAMPLE_MAX_AGE = 60.0
#: How much the database's clock and this process's monotonic clock may differ in rate
#: (1000 ppm, generous: NTP keeps both far closer), taken off a submission's deadline.
_CLOCK_DRIFT = 1e-3

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


#: The reason of a finished row's new run (a new submission of its task id).
RESUBMITTED = "resubmitted: a new run of the same task id"

#: The reason of a run ended by ``Task.replace()`` (followed by what replaced it): the
#: row hands its task id over to the replacement's submission, even a re-sent one.
REPLACED = "replaced: the task id's result is its replacement's"

#: The finished states whose row a new submission of the same task id replaces (the
#: rest are live, or CANCELLED: a re-sent id is dropped, as Celery's worker drops a
#: revoked one).
REOPENABLE: tuple[State, ...] = (State.SUCCEEDED, State.FAILED)


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
        #: The database's clock as last read, and this process's monotonic time when
        #: that answer arrived (see :meth:`_db_deadline`).
        self._db_clock: tuple[datetime, float] | None = None

    def submit(self, new: NewTask, conn: Executor | None = None) -> tuple[str, bool]:
        """Insert a PENDING row; returns (task id, created). A duplicate dedup key or id
        returns the existing row's id with ``created=False``, except a new submission
        of a finished (SUCCEEDED or FAILED) task's id without a dedup key: a fresh
        PENDING row with the new message replaces the finished one (``created=True``).

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
            if self._reopen(conn, new):
                return new.id, True
            return str(existing), False

        if conn is not None:
            return op(conn, False)
        marks = self._marks.take()
        try:
            if not self.is_pg:
                # a local file: a call that fails wrote nothing (its transaction is gone)
                return self._tx(lambda conn, is_retry: op(conn, is_retry, marks))
            return self._submit_pg_call(new, params, countdown, marks)
        except BaseException:
            self._marks.put_back(marks)
            raise

    def _submit_pg_call(
        self, new: NewTask, params: dict[str, Any], countdown: bool, marks: Sequence[str]
    ) -> tuple[str, bool]:
        """PostgreSQL's :meth:`submit`: row, audit row, waiting "published" marks and
        the dedup answer in one autocommit statement, which writes nothing if it runs
        after the call's deadline (see :meth:`_db_deadline`).

        Raises:
            SubmissionOutcomeUnknown: the database stopped answering after the statement
                was sent (its row may have been written before the deadline).
            StoreUnavailable: nothing was written.
        """
        stmt = self._prepared(("submit-pg", countdown), lambda: self._submit_pg(countdown))
        sent = False

        def once(conn: Connection, is_retry: bool) -> tuple[str, bool] | None:
            nonlocal sent
            deadline = self._db_deadline(conn)
            sent = True
            row = conn.execute(stmt, {**params, "b_marks": marks, "b_deadline": deadline}).one()
            self._db_clock = (row.db_clock, time.monotonic())
            if row.created is not None:
                self._record_event(
                    TransitionEvent(
                        new.id, new.name, None, State.PENDING, "submitted", "producer", 0
                    )
                )
                return new.id, True
            if row.existing is not None:
                existing = str(row.existing)
                # an earlier try whose commit went through but whose answer was lost
                return existing, is_retry and existing == new.id
            if row.late:
                sent = False  # refused by its deadline: this and any earlier try wrote nothing
                raise StoreUnavailable(
                    f"lease store {self.url} unavailable: the submission of task {new.id} "
                    f"reached the database after the call's deadline "
                    f"({self.config.db_timeout:g} s, lease_db_timeout) and was not written"
                )
            return None  # a conflicting row this statement's snapshot cannot see

        def answered(conn: Connection, is_retry: bool) -> tuple[str, bool]:
            # the next statement's snapshot sees the conflicting row (or writes ours, if
            # it was purged meanwhile), each statement under the same deadline
            for _ in range(_CONFLICT_TRIES):
                answer = once(conn, is_retry)
                if answer is not None:
                    return answer
            raise StoreError(
                f"lease store {self.url}: task {new.id} conflicts with a row that keeps "
                "appearing and disappearing"
            )

        try:
            tid, created = self._tx(answered, single=True)
        except StoreUnavailable as error:
            if not sent or isinstance(error, SubmissionOutcomeUnknown):
                raise
            raise SubmissionOutcomeUnknown(
                [new.id],
                f"task {new.id}: submission outcome unknown: {error}; its row may have been "
                "written (then the reaper publishes it): retry with the same task_id or "
                "dedup_key",
            ) from error
        if not created and tid == new.id and self._tx(lambda conn, _: self._reopen(conn, new)):
            # a new submission of a finished task's id: a fresh row (in a transaction of
            # its own: the row it replaces was committed before this call)
            return new.id, True
        return tid, created

    def _db_deadline(self, conn: Connection) -> datetime:
        """The calling store call's deadline in database time, a little early.

        The database's clock is read once (``clock_timestamp()``, returned by every
        submit statement as well) together with this process's monotonic time when the
        answer arrived; the deadline is that reading plus the monotonic time from then
        to the call's deadline. The reading was taken before the answer arrived, so in
        database time the result is never later than the moment the call gives up (the
        two clocks' rates may differ by :data:`_CLOCK_DRIFT` at most, taken off; a
        step of the server's clock during the call is not allowed for). A reading older
        than :data:`_CLOCK_SAMPLE_MAX_AGE` is taken again, in one more round trip.
        """
        left = WATCHDOG.remaining()
        if left is None:
            left = self.config.db_timeout
        now = time.monotonic()
        sample = self._db_clock
        if sample is None or now - sample[1] > _CLOCK_SAMPLE_MAX_AGE:
            read = conn.execute(select(func.clock_timestamp())).scalar_one()
            now = time.monotonic()
            sample = self._db_clock = (read, now)
        db_time, seen = sample
        span = max(0.0, now + left - seen)
        return db_time + timedelta(seconds=span * (1.0 - _CLOCK_DRIFT))

    def _reopen(self, conn: Executor, new: NewTask) -> bool:
        """A new submission of a finished task's id (no dedup key asked for) is a new
        run, as Celery runs a re-sent id again: the finished row (SUCCEEDED or FAILED)
        and its steps are replaced by a fresh PENDING row with the new message. The
        audit trail of the id keeps both runs; the finished row itself never changes
        state (a fresh row starts at ``None -> PENDING``; its claims get new tokens, so
        an execution of the old run stays fenced off). Whether it was replaced
        (``False``: a dedup key was given, or the row is live or CANCELLED, or the
        submission is a re-send, :attr:`NewTask.resend`, of a row not replaced)."""
        if new.dedup_key is not None:
            return False
        t, steps = self.t.tasks, self.t.steps
        finished: ColumnElement[bool] = t.c.state.in_([s.value for s in REOPENABLE])
        if new.resend:
            # a message sent again (a follow-up published a second time): the row is
            # this task, unless a replaced run left it for its replacement
            finished = and_(state_is(t, State.SUCCEEDED), t.c.reason.startswith(REPLACED))
        gone = conn.execute(delete(t).where(t.c.id == new.id, finished)).rowcount
        if not gone:
            return False
        conn.execute(delete(steps).where(steps.c.task_id == new.id))
        countdown = new.countdown is not None
        insert_stmt = self._prepared(("submit", countdown), lambda: self._submit_insert(countdown))
        conn.execute(insert_stmt, _submit_params(new))
        self._audit(conn, new.id, None, State.PENDING, RESUBMITTED, Actor.PRODUCER.value, 0)
        return True

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

    def _submit_insert(self, countdown: bool, deadline: Any = None) -> Any:
        """INSERT of one new row; with ``deadline`` (PostgreSQL: a timestamp bind
        parameter) the row is written only while ``clock_timestamp()`` is before it."""
        t = self.t.tasks
        values: dict[str, Any] = {c: bindparam(f"b_{c}", type_=t.c[c].type) for c in _SUBMIT}
        values.update(
            state=State.PENDING.value,
            created_at=db_now(),
            updated_at=db_now(),
            reason="submitted",
            # explicit: a column default is not applied inside a CTE (PostgreSQL's path)
            origin=literal(self.config.origin, String),
            eta=(
                after(db_now(), bindparam("b_countdown", type_=Float))
                if countdown
                else bindparam("b_eta", type_=t.c.eta.type)
            ),
        )
        if deadline is None:
            return self._insert(t).values(**values).on_conflict_do_nothing().returning(t.c.id)
        names = list(values)
        return (
            self._insert(t)
            .from_select(
                names,
                select(
                    *(
                        v if isinstance(v, ColumnElement) else literal(v, t.c[n].type)
                        for n, v in ((n, values[n]) for n in names)
                    )
                ).where(func.clock_timestamp() < deadline),
            )
            .on_conflict_do_nothing()
            .returning(t.c.id)
        )

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
        deadline = bindparam("b_deadline", type_=DateTime(timezone=True))
        inserted = self._submit_insert(countdown, deadline).cte("inserted")
        marked = self._mark_statement(
            t.c.id == any_(bindparam("b_marks", type_=postgresql.ARRAY(String)))
        )
        # the statement's snapshot does not see its own insert: "existing" is the row
        # that made the insert conflict (a duplicate dedup key or id)
        return select(
            select(inserted.c.id).scalar_subquery().label("created"),
            self._existing().scalar_subquery().label("existing"),
            (func.clock_timestamp() >= deadline).label("late"),
            func.clock_timestamp().label("db_clock"),
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
