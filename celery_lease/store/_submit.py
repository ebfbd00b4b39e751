"""Submission: new PENDING rows (one, or many in one statement per batch) with their
creation audit rows, the run that replaces a finished one, and recording that their
messages were published.

One row: on PostgreSQL one autocommit statement writes the row, its audit row, the
"published" marks waiting in this process and answers the dedup question, and writes
nothing if it reaches the database after the call's deadline. Many rows (what
``LeasedTask.submit_many``, ``celery_lease.bulk()`` and a group of leased tasks write
before they publish): up to ``batch_size`` per transaction, then the ids of those that
already existed (a duplicate dedup key or id) in one more read. On PostgreSQL a batch
is one ``INSERT ... SELECT FROM json_to_recordset(...)`` (the batch's rows as one JSON
document bound as one parameter, so the statement text is the same for every batch and
psycopg prepares it once; one document costs the client far less than a text array per
column) with the audit rows inserted by a data-modifying CTE over the inserted rows;
on SQLite the single-row statement run as an executemany, which SQLAlchemy sends as
multi-row ``INSERT ... VALUES`` pages. Either way the row is written before its
message is published.

A submission's transaction seen from outside the store: the caller's transaction
it joins, and recording "published" after the message went out.

**Joined transactions.** The row is the outbox (DESIGN.md): a committed PENDING row is
published, sooner or later, by the producer or by the reaper; an uncommitted one never
is. What joining adds is *when*: a callback runs right after the commit, when a hook
tells us the commit happened.

* ``Session``: its ``after_commit`` event (checked against the connection, so a
  savepoint release or a session joined to an outer transaction does not count).
  A rollback of the transaction (or savepoint) that holds the row drops the callback.
* ``Connection`` inside :func:`outbox_transaction`: run when the block commits.
* Any other ``Connection``: SQLAlchemy has no after-commit hook on a bare connection
  (its ``commit`` event fires *before* the commit, so publishing from it could send a
  message for a row that then rolls back). Nothing is run; the reaper publishes the row
  instead, once it is committed and older than ``lease_publish_grace``.

**Published marks.** After a producer hands a message to the broker it records
``published_at`` on the row, so that the reaper does not publish it again after
``lease_publish_grace``. That record is bookkeeping, not a decision: a row left
unmarked is re-published by the reaper and the extra message is dropped at claim (the
row is no longer PENDING, or its claim refuses a second copy). So instead of one
statement per task, the ids wait in :class:`PublishedMarks` and are recorded in bulk:
inside the process's next submit statement (no round trip of its own), or by a
background thread once the oldest id has waited ``delay``, when ``batch`` ids are
waiting, and at interpreter exit. A producer that dies leaves at most these few rows
unmarked.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import dataclasses
import functools
import itertools
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Boolean,
    ColumnElement,
    Connection,
    DateTime,
    Engine,
    Float,
    Integer,
    String,
    Text,
    and_,
    any_,
    bindparam,
    case,
    cast,
    column,
    delete,
    event,
    exc,
    func,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import JSON
from sqlalchemy.orm import Session, SessionTransaction, scoped_session

from ..config import LeaseConfig
from ..exceptions import ConfigurationError, StoreError, StoreUnavailable, SubmissionOutcomeUnknown
from ..states import Actor, State
from ._base import StoreBase, state_is, wrap
from ._db import DbClock
from ._group import GroupCommit
from ._types import Executor, JoinedSubmission, Lease, NewTask, TransitionEvent
from .schema import after, db_now

#: Statements a submission tries when its insert conflicts with a row that its snapshot
#: cannot see (committed meanwhile, or purged meanwhile).
_CONFLICT_TRIES = 5


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
    "held",
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


logger = logging.getLogger("celery_lease.store")

#: Key of the pending callbacks in ``Session.info``.
_SESSION_KEY = "celery_lease.outbox"


@dataclasses.dataclass
class _Pending:
    """A row written in an open transaction, waiting for its commit."""

    run: Callable[[], None]
    #: The connection that wrote the row: run only once it left its transaction.
    conn: Connection
    #: Session path: the (innermost) session transaction that holds the row.
    holder: SessionTransaction | None = None


@dataclasses.dataclass
class _Block:
    """One :func:`outbox_transaction` block: its connection and what it will run."""

    conn: Connection
    pending: list[_Pending] = dataclasses.field(default_factory=list)


_blocks: contextvars.ContextVar[tuple[_Block, ...]] = contextvars.ContextVar(
    "celery_lease_outbox_blocks", default=()
)


@contextlib.contextmanager
def outbox_transaction(bind: Engine | Connection) -> Iterator[Connection]:
    """Begin a transaction whose leased tasks are published as soon as it commits.

    Use it where you would use ``engine.begin()`` when you work with SQLAlchemy Core
    connections rather than a ``Session``::

        with outbox_transaction(engine) as conn:
            conn.execute(orders.insert().values(id=order_id, total=total))
            fulfil.apply_async((order_id,), connection=conn)
        # committed: the message is on its way

    If the block raises, the transaction rolls back and nothing is published. If the
    process dies between the commit and the publish, the reaper publishes the row.

    Args:
        bind: an ``Engine`` (a connection is taken and returned), or a ``Connection``
            that is not in a transaction yet (its transaction is begun and committed
            here).

    Raises:
        ConfigurationError: ``bind`` is a connection already in a transaction (its
            commit would happen elsewhere, out of sight).
    """
    if isinstance(bind, Engine):
        with bind.connect() as conn, outbox_transaction(conn) as same:
            yield same
        return
    if not isinstance(bind, Connection):
        raise ConfigurationError(
            f"outbox_transaction() takes a SQLAlchemy Engine or Connection, got "
            f"{type(bind).__name__}"
        )
    if bind.in_transaction():
        raise ConfigurationError(
            "outbox_transaction(): the connection is already in a transaction; commit it "
            "first, pass the Engine instead, or pass connection= your Session"
        )
    block = _Block(bind)
    token = _blocks.set((*_blocks.get(), block))
    try:
        with bind.begin():
            yield bind
    finally:
        _blocks.reset(token)
    # only reached when the commit succeeded: a failed block or commit raised above
    _run_all(block.pending)


@dataclasses.dataclass(frozen=True)
class JoinedTransaction:
    """The open transaction of a caller's ``Session`` or ``Connection``."""

    #: What the row is written with (pass it to ``Store.submit_joined``).
    conn: Connection
    session: Session | None

    def after_commit(self, fn: Callable[[], None]) -> bool:
        """Run ``fn`` once the transaction holding what :attr:`conn` wrote has
        committed, and never if it rolls back. ``False``: nothing tells us of that
        commit (a bare ``Connection`` outside :func:`outbox_transaction`), ``fn`` is
        dropped."""
        if self.session is not None:
            holder = self.session.get_nested_transaction() or self.session.get_transaction()
            _session_pending(self.session).append(_Pending(fn, self.conn, holder))
            return True
        for block in reversed(_blocks.get()):
            if block.conn is self.conn:
                block.pending.append(_Pending(fn, self.conn))
                return True
        return False


def join_transaction(store: StoreBase, connection: object) -> JoinedTransaction:
    """The transaction of ``connection`` (a SQLAlchemy ``Connection``, ``Session`` or
    ``scoped_session``), checked to be on ``store``'s database.

    Raises:
        ConfigurationError: ``connection`` is something else, or on another database.
    """
    if isinstance(connection, scoped_session):
        connection = connection()  # Flask-SQLAlchemy's db.session and the like
    if isinstance(connection, Session):
        joined = JoinedTransaction(connection.connection(), connection)
    elif isinstance(connection, Connection):
        joined = JoinedTransaction(connection, None)
    else:
        raise ConfigurationError(
            "connection= takes a SQLAlchemy Connection or Session on the store's database, "
            f"got {type(connection).__name__}"
        )
    _check_same_database(store, joined.conn)
    return joined


def _check_same_database(store: StoreBase, conn: Connection) -> None:
    """Raise unless ``conn`` is on the store's database (same dialect and database)."""
    mine, theirs = store.engine.url, conn.engine.url
    if conn.dialect.name != store.dialect:
        raise ConfigurationError(
            f"connection= is a {conn.dialect.name} connection but the lease store is "
            f"{store.dialect}: both must be the same database"
        )
    same = (
        _sqlite_path(mine.database) == _sqlite_path(theirs.database)
        if store.dialect == "sqlite"
        else mine.database == theirs.database
    )
    if not same:
        raise ConfigurationError(
            f"connection= is on database {theirs.database!r} but the lease store is on "
            f"{mine.database!r}: the row must be written in the same database as the "
            "business data, or the transaction cannot cover both"
        )


def _sqlite_path(database: str | None) -> Path | None:
    return Path(database).expanduser().resolve() if database else None


# -- Session hooks ----------------------------------------------------------------------


def _session_pending(session: Session) -> list[_Pending]:
    pending: list[_Pending] | None = session.info.get(_SESSION_KEY)
    if pending is None:
        pending = session.info[_SESSION_KEY] = []
    if not event.contains(session, "after_commit", _after_commit):
        event.listen(session, "after_commit", _after_commit)
        event.listen(session, "after_soft_rollback", _after_soft_rollback)
    return pending


def _after_commit(session: Session) -> None:
    pending: list[_Pending] = session.info.get(_SESSION_KEY, [])
    # after_commit also fires when a savepoint is released, and when a session joined to
    # an outer transaction "commits": the row is only committed once its connection has
    # left every transaction (an outer one is committed by someone else, later: the
    # reaper publishes those rows)
    ready = [p for p in pending if p.conn.closed or not p.conn.in_transaction()]
    if not ready:
        return
    pending[:] = [p for p in pending if p not in ready]
    _run_all(ready)


def _after_soft_rollback(session: Session, previous: SessionTransaction) -> None:
    pending: list[_Pending] = session.info.get(_SESSION_KEY, [])
    pending[:] = [p for p in pending if not _inside(p.holder, previous)]


def _inside(holder: SessionTransaction | None, rolled_back: SessionTransaction) -> bool:
    """Whether ``holder`` is ``rolled_back`` or nested in it (its writes are undone)."""
    node = holder
    while node is not None:
        if node is rolled_back:
            return True
        node = node.parent
    return False


def _run_all(pending: Sequence[_Pending]) -> None:
    """Run the callbacks of committed rows. A broker that is down is handled by the
    publish itself (the reaper publishes later); any other error is raised once every
    callback was tried."""
    failure: Exception | None = None
    for item in pending:
        try:
            item.run()
        except Exception as error:
            failure = failure or error
    if failure is not None:
        raise failure


# -- published marks ------------------------------------------------------------------

_LIVE: weakref.WeakSet[PublishedMarks] = weakref.WeakSet()
#: Seconds between an idle marks thread's checks that its store still exists.
_IDLE_CHECK = 5.0


class PublishedMarks:
    """The ids of one store whose messages were published but not yet recorded."""

    def __init__(
        self, record: Callable[[Sequence[str]], None], *, delay: float = 0.005, batch: int = 500
    ) -> None:
        # weakly: this thread must not keep a store alive whose app is gone
        self._record = weakref.WeakMethod(record)
        self.delay = delay
        self.batch = batch
        self._reset()
        _LIVE.add(self)
        ref = weakref.ref(self)

        def after_fork() -> None:
            marks = ref()
            if marks is not None:
                marks._reset()  # the parent records its own ids; the child starts empty

        os.register_at_fork(after_in_child=after_fork)

    def _reset(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._ids: list[str] = []
        self._since = 0.0
        self._thread: threading.Thread | None = None
        #: The thread waits for ids to arrive (not for the oldest one's delay to pass).
        self._idle = False
        #: Held while ids taken by :meth:`flush` are being recorded: a flush at exit
        #: waits for the background thread's, or the interpreter would end it midway.
        self._flushing = threading.Lock()

    def add(self, task_id: str) -> None:
        """Record ``task_id`` as published soon."""
        with self._cond:
            if not self._ids:
                self._since = time.monotonic()
                if self._idle:  # a thread in its timed wait wakes by itself
                    self._cond.notify()
            self._ids.append(task_id)
            if len(self._ids) >= self.batch:
                self._cond.notify()
        if self._thread is None:
            self._start()

    def take(self) -> list[str]:
        """Every waiting id, for the caller to record in a statement it sends anyway.

        Called by a submit before its publish, it also starts the background thread: a
        thread start waits for the new thread, and after the publish that wait would
        let other threads of the process (an in-process worker's consumer) run before
        ``apply_async`` returns, as it does not in plain Celery."""
        self._start()
        with self._cond:
            ids, self._ids = self._ids, []
        return ids

    def _start(self) -> None:
        if self._thread is not None:
            return
        with self._cond:
            if self._thread is not None:
                return
            thread = self._thread = threading.Thread(
                target=self._run, name="celery-lease-published", daemon=True
            )
        thread.start()

    def put_back(self, ids: Sequence[str]) -> None:
        """Ids taken with :meth:`take` whose statement failed."""
        if not ids:
            return
        with self._cond:
            if not self._ids:
                self._since = time.monotonic()
                if self._idle:
                    self._cond.notify()
            self._ids[:0] = ids

    def flush(self) -> None:
        """Record every waiting id now (after any flush already under way)."""
        with self._flushing:
            ids = self.take()
            if not ids:
                return
            record = self._record()
            if record is None:
                return
            try:
                record(ids)
            except StoreError as error:
                # harmless: re-published after lease_publish_grace, dropped at claim
                logger.warning(
                    "celery-lease: could not mark %d rows published: %s", len(ids), error
                )

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._ids:
                    self._idle = True
                    try:
                        self._cond.wait(_IDLE_CHECK)
                    finally:
                        self._idle = False
                    if not self._ids and self._record() is None:
                        return  # the store is gone
                wait = self._since + self.delay - time.monotonic()
                if wait > 0 and len(self._ids) < self.batch:
                    self._cond.wait(wait)
                    continue
            self.flush()


@atexit.register
def _flush_all() -> None:
    for marks in list(_LIVE):
        marks.flush()


def _submit_params(new: NewTask) -> dict[str, Any]:
    params = {f"b_{c}": getattr(new, c) for c in _SUBMIT}
    params["b_countdown"] = new.countdown
    params["b_eta"] = new.eta
    return params


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
    ("held", Boolean),
    ("countdown", Float),
    ("eta", DateTime(timezone=True)),
    ("n", Integer),  # the row's place in the batch
)


class _Row(dict[str, Any]):
    """A result row read by column name, as an attribute."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


#: Rows per statement: well under SQLite's and PostgreSQL's bound-parameter limits.
BATCH_SIZE = 500


class Submission(StoreBase):
    """Writing new rows, one or many; recording their messages published."""

    def __init__(self, config: LeaseConfig) -> None:
        super().__init__(config)
        self._marks = PublishedMarks(self.mark_published)
        #: Concurrent single submissions of this process share a statement and a commit.
        self._group = GroupCommit(self._submit_alone, self.submit_many)
        #: The database's clock, for the deadline of a submission in database time.
        self._db_clock = DbClock()

    def holds(self, countdown: float | None, eta: datetime | None) -> bool:
        """Whether a submission due in ``countdown`` seconds, or at ``eta``, is held: due
        more than ``lease_hold_eta_after`` seconds from now, by the database's clock
        (read at most once a minute, and followed by this process's monotonic clock
        meanwhile)."""
        hold_after = self.config.hold_eta_after
        if hold_after is None:
            return False
        if countdown is not None:
            return countdown > hold_after
        if eta is None:
            return False
        return (eta - self.database_time()).total_seconds() > hold_after

    def database_time(self) -> datetime:
        """The database's clock now (see :meth:`holds`)."""

        def read() -> datetime:
            value: datetime = self._read(
                lambda conn: conn.execute(
                    select(func.clock_timestamp() if self.is_pg else db_now())
                ).scalar_one()
            )
            return value

        return self._db_clock.now(read)

    def submit(self, new: NewTask, conn: Executor | None = None) -> tuple[str, bool]:
        """Insert a PENDING row; returns (task id, created). A duplicate dedup key or id
        returns the existing row's id with ``created=False``, except a new submission
        of a finished (SUCCEEDED or FAILED) task's id without a dedup key: a fresh
        PENDING row with the new message replaces the finished one (``created=True``).

        With ``conn`` the row joins the caller's transaction (transactional enqueue; see
        :meth:`submit_joined`). Without, the same transaction also records the rows
        waiting in :meth:`mark_published_soon`.
        """
        if conn is None and self.is_pg:
            return self._group.submit(new)
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
        # SQLite, a local file: a call that fails wrote nothing (its transaction is gone)
        marks = self._marks.take()
        try:
            return self._tx(lambda conn, is_retry: op(conn, is_retry, marks))
        except BaseException:
            self._marks.put_back(marks)
            raise

    def _submit_alone(self, new: NewTask) -> tuple[str, bool]:
        """PostgreSQL's :meth:`submit` with no other submission of this process under
        way: one statement, which also records the waiting "published" marks."""
        marks = self._marks.take()
        try:
            return self._submit_pg_call(new, _submit_params(new), new.countdown is not None, marks)
        except BaseException:
            self._marks.put_back(marks)
            raise

    def _submit_pg_call(
        self, new: NewTask, params: dict[str, Any], countdown: bool, marks: Sequence[str]
    ) -> tuple[str, bool]:
        """PostgreSQL's :meth:`submit`: row, audit row, waiting "published" marks and
        the dedup answer in one autocommit statement, which writes nothing if it runs
        after the call's deadline (see :meth:`DbClock.deadline`).

        Raises:
            SubmissionOutcomeUnknown: the database stopped answering after the statement
                was sent (its row may have been written before the deadline).
            StoreUnavailable: nothing was written.
        """
        sql, constants = self._prepared(
            ("submit-pg-sql", countdown), lambda: self._compiled(self._submit_pg(countdown))
        )
        sent = False

        def once(conn: Connection, is_retry: bool) -> tuple[str, bool] | None:
            nonlocal sent
            deadline = self._db_clock.deadline(conn, self.config.db_timeout)
            sent = True
            row = self._execute_compiled(
                conn, sql, {**constants, **params, "b_marks": marks, "b_deadline": deadline}
            )
            self._db_clock.saw(row.db_clock)
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

    def _compiled(self, stmt: Any) -> tuple[str, dict[str, Any]]:
        """``stmt`` compiled once for the driver: its text and the values of the bind
        parameters it holds itself (literals); the caller's ``b_*`` values go with
        them. The hot single-row submit runs it with no statement object to look up and
        bind on every call (see :meth:`_execute_compiled`); psycopg prepares it."""
        compiled = stmt.compile(dialect=self.engine.dialect)
        constants = {
            k: v
            for k, v in compiled.construct_params(_check=False).items()
            if not k.startswith("b_")
        }
        return str(compiled), constants

    @staticmethod
    def _execute_compiled(conn: Connection, sql: str, params: dict[str, Any]) -> Any:
        """The one row of ``sql`` run on ``conn``.

        With no connection event listened to (SQL instrumentation, statement counters),
        on the driver's cursor, prepared: the per-call work of SQLAlchemy's execution
        (an execution context, result metadata) is skipped, its handling of a driver
        error is not (wrapped, a lost connection invalidated). With listeners, as
        driver SQL through SQLAlchemy, so that they see it."""
        if conn._has_events or conn.engine._has_events:
            return conn.exec_driver_sql(sql, params).one()
        cursor: Any = conn.connection.cursor()
        try:
            cursor.execute(sql, params, prepare=True)
            values = cursor.fetchone()
            names = [d[0] for d in cursor.description or ()]
        except Exception as error:
            conn._handle_dbapi_exception(error, sql, params, cursor, None)  # raises
            raise
        finally:
            cursor.close()
        return _Row(zip(names, values or (), strict=True))

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
            raise wrap(error, self.url) from error
        finally:
            local.events = saved
        return JoinedSubmission(tid, created, tuple(events))

    # -- many rows, and the run Task.replace() ends ----------------------------------------

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
        # SQLAlchemy sends each as multi-row INSERT ... VALUES pages ("insertmanyvalues");
        # runs of rows in their order, so that of two rows with one id or dedup key the
        # first wins, whichever of them has a countdown
        for countdown, run in itertools.groupby(rows, key=lambda n: n.countdown is not None):
            params = [_submit_params(n) for n in run]
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

    # -- statements ------------------------------------------------------------------------

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

    # -- published marks -------------------------------------------------------------------

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
