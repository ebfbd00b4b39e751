"""Engine creation per dialect, fork safety and driver-error wrapping."""

from __future__ import annotations

import contextlib
import math
import os
import random
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event, exc
from sqlalchemy.engine import URL, make_url

from ..config import LeaseConfig
from ..exceptions import (
    ConfigurationError,
    MissingDependencyError,
    StoreDataError,
    StoreError,
    StoreUnavailable,
)
from ._deadline import WATCHDOG
from ._redact import redact, safe_url

T = TypeVar("T")

_TRANSIENT_PG_CODES = {
    "40001",
    "40P01",
    "57P01",
    "57P02",
    "57P03",
    "08000",
    "08003",
    "08006",
    "08001",
}


def _normalize(url: URL) -> URL:
    if url.drivername in ("postgresql", "postgres"):
        url = url.set(drivername="postgresql+psycopg")
    return url


def create(config: LeaseConfig) -> Engine:
    """An engine for ``config.database_url`` set up for short, contended transactions."""
    try:
        url = _normalize(make_url(config.database_url))
    except (exc.ArgumentError, ValueError) as error:  # ValueError: a port that is no number
        # the parse error quotes the whole URL, secrets included: mask them, and leave the
        # original out of the traceback
        message = redact(str(error), config.database_url)
        raise ConfigurationError(f"lease_database_url is not a valid URL: {message}") from None
    backend = url.get_backend_name()
    if backend == "sqlite":
        engine = _sqlite(url, config)
    elif backend == "postgresql":
        if url.get_driver_name() == "psycopg":
            try:
                import psycopg  # noqa: F401
            except ImportError as error:
                raise MissingDependencyError("psycopg", "postgres") from error
        try:
            engine = create_engine(
                url,
                pool_size=config.pool_size,
                max_overflow=config.pool_size,
                pool_recycle=1800,
                # waiting for a free connection counts against the call's bound too
                pool_timeout=config.db_timeout,
                # the most recently used connection first: a process in steady use keeps
                # reusing warm connections and the others idle out (pinged if used again)
                pool_use_lifo=True,
                connect_args=_libpq_timeouts(config),
            )
        except ImportError as error:
            raise MissingDependencyError(url.get_driver_name(), "postgres") from error
        # first: the session settings and the idle ping below run under the deadline
        _watch_connections(engine)
        _bound_stalled_transactions(engine, config)
        _ping_when_idle(engine)
    else:
        raise ConfigurationError(
            f"lease_database_url {safe_url(url)}: only sqlite and postgresql are supported"
        )
    _dispose_after_fork(engine)
    return engine


#: libpq's smallest ``connect_timeout`` (psycopg raises smaller values to it).
MIN_CONNECT_TIMEOUT = 2


def _libpq_timeouts(config: LeaseConfig) -> dict[str, Any]:
    """Connection parameters that keep a lost server from holding a call for long.

    ``connect_timeout`` bounds opening a connection (the engine lowers it per connection
    to what remains of the call's deadline); keepalives find a dead peer under an idle
    pooled connection, and ``tcp_user_timeout`` one that stopped acknowledging what we
    sent. A server that accepts and never answers is left to the deadline watchdog.
    """
    return {
        "connect_timeout": max(MIN_CONNECT_TIMEOUT, math.ceil(config.db_connect_timeout)),
        "keepalives": 1,
        "keepalives_idle": max(1, int(config.db_timeout)),
        "keepalives_interval": max(1, int(config.db_timeout / 3)),
        "keepalives_count": 3,
        "tcp_user_timeout": int(config.db_timeout * 1000),
    }


def _watch_connections(engine: Engine) -> None:
    """Put every connection a store call uses under its deadline (see :mod:`._deadline`)."""

    @event.listens_for(engine, "do_connect")
    def _on_do_connect(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> None:
        remaining = WATCHDOG.remaining()
        if remaining is not None:
            # a handshake started late in the call must not outlive its deadline
            wanted = max(MIN_CONNECT_TIMEOUT, math.ceil(remaining))
            cparams["connect_timeout"] = min(int(cparams["connect_timeout"]), wanted)

    @event.listens_for(engine.pool, "connect")
    def _on_connect(dbapi_conn: Any, record: Any) -> None:
        WATCHDOG.watch(dbapi_conn)

    @event.listens_for(engine.pool, "checkout")
    def _on_checkout(dbapi_conn: Any, record: Any, proxy: Any) -> None:
        WATCHDOG.watch(dbapi_conn)

    @event.listens_for(engine.pool, "checkin")
    def _on_checkin(dbapi_conn: Any, record: Any) -> None:
        if dbapi_conn is not None:
            WATCHDOG.unwatch(dbapi_conn)


def _bound_stalled_transactions(engine: Engine, config: LeaseConfig) -> None:
    """Session settings that let PostgreSQL itself end what runs too long.

    ``statement_timeout`` and ``lock_timeout`` end a statement that runs or waits for
    a lock longer than ``lease_db_timeout`` (the call would be abandoned by then
    anyway). ``idle_in_transaction_session_timeout`` ends a session that stays idle
    inside a transaction for a whole TTL: the store's transactions are a few
    statements issued back to back, so one left open means its process was frozen
    (SIGSTOP, a paused VM) or hung between two statements, and the row locks it holds
    (the reaper lock's row, a task row) would otherwise block every other worker's
    reaper for as long as the freeze lasts. One round trip, once per connection.
    """
    idle_ms = max(1000, int(config.ttl * 1000))
    statement_ms = max(1, int(config.db_timeout * 1000))

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, record: Any) -> None:
        with dbapi_conn.cursor() as cur:
            cur.execute(
                "SELECT set_config('statement_timeout', %(s)s, false),"
                " set_config('lock_timeout', %(s)s, false),"
                " set_config('idle_in_transaction_session_timeout', %(i)s, false)",
                {"s": str(statement_ms), "i": str(idle_ms)},
            )
        dbapi_conn.commit()


#: A pooled connection unused for longer than this is pinged before it is handed out.
IDLE_PING_AFTER = 10.0

_LAST_USED = "celery_lease_last_used"


def _ping_when_idle(engine: Engine) -> None:
    """Ping a pooled connection at checkout only if it sat idle for ``IDLE_PING_AFTER``.

    ``pool_pre_ping`` pings at every checkout: one extra round trip per statement,
    since the store's hot operations are single autocommit statements. A connection in
    steady use is known alive from its last statement a moment ago; one that sat idle
    may have been dropped by a server restart, a firewall or an idle timeout, and is
    pinged. A connection that dies between two uses anyway fails its statement as a
    disconnect: SQLAlchemy invalidates it (and every older pooled connection) and the
    store's :func:`retrying` runs the transaction again on a fresh connection.
    """

    @event.listens_for(engine.pool, "checkin")
    def _on_checkin(dbapi_conn: Any, record: Any) -> None:
        if record is not None:
            record.info[_LAST_USED] = time.monotonic()

    @event.listens_for(engine.pool, "checkout")
    def _on_checkout(dbapi_conn: Any, record: Any, proxy: Any) -> None:
        last = record.info.get(_LAST_USED)
        if last is None or time.monotonic() - last < IDLE_PING_AFTER:
            return  # fresh from connect(), or used a moment ago
        try:
            with dbapi_conn.cursor() as cur:
                cur.execute("SELECT 1")
            if not dbapi_conn.autocommit:
                dbapi_conn.rollback()
        except Exception as error:
            # the pool discards this connection and checks out (or opens) another
            raise exc.DisconnectionError(f"idle connection is gone: {error}") from error


def _sqlite(url: URL, config: LeaseConfig) -> Engine:
    database = url.database
    if not database or database == ":memory:":
        raise ConfigurationError(
            "lease_database_url must name a SQLite file: worker processes cannot share :memory:"
        )
    Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        url,
        connect_args={"timeout": config.sqlite_busy_timeout, "check_same_thread": False},
        pool_size=config.pool_size,
        max_overflow=config.pool_size,
        pool_timeout=config.db_timeout,
    )
    busy_ms = int(config.sqlite_busy_timeout * 1000)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, record: Any) -> None:
        # let SQLAlchemy, not pysqlite, decide when transactions begin
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute(f"PRAGMA busy_timeout={busy_ms}")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        if conn.get_execution_options().get("lease_readonly"):
            # readers never take the write lock (WAL lets them run beside a writer)
            conn.exec_driver_sql("BEGIN")
        else:
            # take the write lock up front: a deferred transaction that later writes
            # can fail with SQLITE_BUSY without waiting for busy_timeout
            conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


#: Held by every SQLite transaction of this process, and by ``fork()`` while it runs.
#: SQLite keeps the lock state of a database file in process memory shared by all
#: connections to that file; a child forked while a thread of the parent is inside a
#: transaction (the heartbeat, the embedded reaper, the fast path that handles the very
#: child death that makes billiard fork a replacement) inherits "the write lock is held
#: here" and waits on it forever: its first BEGIN IMMEDIATE never succeeds.
_SQLITE_FORK_LOCK = threading.RLock()
os.register_at_fork(
    before=_SQLITE_FORK_LOCK.acquire,
    after_in_parent=_SQLITE_FORK_LOCK.release,
    after_in_child=_SQLITE_FORK_LOCK.release,
)


def fork_guard(engine: Engine) -> AbstractContextManager[Any]:
    """What a transaction on ``engine`` holds so that no ``fork()`` happens inside it
    (SQLite only; PostgreSQL connections keep no lock state in the process)."""
    if engine.dialect.name == "sqlite":
        return _SQLITE_FORK_LOCK
    return contextlib.nullcontext()


def _dispose_after_fork(engine: Engine) -> None:
    ref = weakref.ref(engine)

    def _after_fork() -> None:
        inherited = ref()
        if inherited is not None:
            # the parent's connections must not be used (or closed) by the child
            inherited.dispose(close=False)

    os.register_at_fork(after_in_child=_after_fork)


def is_transient(error: exc.DBAPIError) -> bool:
    """Whether retrying the transaction may succeed (connection lost, lock busy, serialization)."""
    if error.connection_invalidated:
        return True
    code = getattr(error.orig, "sqlstate", None) or getattr(error.orig, "pgcode", None)
    if code in _TRANSIENT_PG_CODES:
        return True
    return isinstance(error, (exc.OperationalError, exc.InterfaceError))


def wrap(error: exc.SQLAlchemyError, url: str, *, timeout: float | None = None) -> StoreError:
    """The library's exception for a driver error (the cause is kept by ``raise ... from``).

    ``timeout``: the call ran out of its ``lease_db_timeout`` (said in the message).
    """
    detail = str(getattr(error, "orig", None) or error).strip().splitlines()
    first = redact(detail[0]) if detail else type(error).__name__
    if timeout is not None:
        return StoreUnavailable(
            f"lease store {url} unavailable: no answer within {timeout:g} s "
            f"(lease_db_timeout): {first}"
        )
    if isinstance(error, exc.DBAPIError) and is_transient(error):
        return StoreUnavailable(f"lease store {url} unavailable: {first}")
    if isinstance(error, exc.TimeoutError):  # no free connection in the pool in time
        return StoreUnavailable(f"lease store {url} unavailable: {first}")
    if isinstance(error, (exc.DataError, exc.IntegrityError)):
        # the value was wrong (too long, out of range, a constraint), not the database
        return StoreDataError(f"lease store {url} refused a value: {first}")
    return StoreError(f"lease store {url}: {first}")


def retrying(fn: Callable[[bool], T], *, retries: int, url: str, timeout: float | None = None) -> T:
    """Run ``fn(is_retry)``, retrying transient driver errors with jittered exponential
    backoff, all within ``timeout`` seconds (``None``: no deadline).

    Past the deadline the watchdog shuts down the connection the call is blocked on,
    and no further try starts: the call ends with :class:`StoreUnavailable`.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    outer = None if deadline is None else WATCHDOG.arm(deadline)
    try:
        for attempt in range(retries + 1):
            try:
                return fn(attempt > 0)
            except exc.DBAPIError as error:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise wrap(error, url, timeout=timeout) from error
                if attempt < retries and is_transient(error):
                    pause = random.uniform(0, min(2.0, 0.05 * 2**attempt))
                    time.sleep(pause if left is None else min(pause, left))
                    continue
                raise wrap(error, url) from error
            except exc.SQLAlchemyError as error:
                raise wrap(error, url) from error
    finally:
        if outer is not None:
            WATCHDOG.disarm(outer)
    raise AssertionError("unreachable")
