"""A submission's transaction seen from outside the store: the caller's transaction
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
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from sqlalchemy import Connection, Engine, event
from sqlalchemy.orm import Session, SessionTransaction, scoped_session

from ..exceptions import ConfigurationError, StoreError
from ._base import StoreBase

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


class PublishedMarks:
    """The ids of one store whose messages were published but not yet recorded."""

    def __init__(
        self, record: Callable[[Sequence[str]], None], *, delay: float = 0.005, batch: int = 500
    ) -> None:
        self._record = record
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
        #: Held while ids taken by :meth:`flush` are being recorded: a flush at exit
        #: waits for the background thread's, or the interpreter would end it midway.
        self._flushing = threading.Lock()

    def add(self, task_id: str) -> None:
        """Record ``task_id`` as published soon."""
        with self._cond:
            if not self._ids:
                self._since = time.monotonic()
                self._cond.notify()
            self._ids.append(task_id)
            if len(self._ids) >= self.batch:
                self._cond.notify()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="celery-lease-published", daemon=True
                )
                self._thread.start()

    def take(self) -> list[str]:
        """Every waiting id, for the caller to record in a statement it sends anyway."""
        with self._cond:
            ids, self._ids = self._ids, []
        return ids

    def put_back(self, ids: Sequence[str]) -> None:
        """Ids taken with :meth:`take` whose statement failed."""
        if not ids:
            return
        with self._cond:
            if not self._ids:
                self._since = time.monotonic()
                self._cond.notify()
            self._ids[:0] = ids

    def flush(self) -> None:
        """Record every waiting id now (after any flush already under way)."""
        with self._flushing:
            ids = self.take()
            if not ids:
                return
            try:
                self._record(ids)
            except StoreError as error:
                # harmless: re-published after lease_publish_grace, dropped at claim
                logger.warning(
                    "celery-lease: could not mark %d rows published: %s", len(ids), error
                )

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._ids:
                    self._cond.wait()
                wait = self._since + self.delay - time.monotonic()
                if wait > 0 and len(self._ids) < self.batch:
                    self._cond.wait(wait)
                    continue
            self.flush()


@atexit.register
def _flush_all() -> None:
    for marks in list(_LIVE):
        marks.flush()
