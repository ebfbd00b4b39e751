"""The database layer: engines per dialect, a deadline on every call, driver errors
wrapped once and retried when transient, and URLs with their secrets masked.

**Deadlines.** PostgreSQL's ``statement_timeout`` and ``lock_timeout`` end a slow
statement, and TCP keepalives and ``tcp_user_timeout`` notice a peer that stopped
acknowledging, but neither helps when the server (or a proxy, a NAT, a load balancer
in between) accepts the connection and then never answers: psycopg waits on the
socket for as long as it stays open. So each store call runs under a deadline, and a
watchdog thread shuts down the socket of a connection that is still in use when its
deadline passes. The blocked driver call then fails at once as a lost connection
(SQLAlchemy invalidates it, the pool opens a fresh one next time) and the store
raises :class:`~celery_lease.exceptions.StoreUnavailable`. The connections are
watched from the pool's ``connect`` and ``checkout`` events, so the session settings
sent at connect and the idle ping at checkout are bounded too; a new connection's
handshake is bounded by libpq's ``connect_timeout``, which the engine sets per
connection to what remains of the deadline.

**Redaction.** A URL reaches logs, error messages and the CLI in many ways (the
worker's start-up line, every ``StoreError``, ``celery lease migrate``, the Django
admin's messages). A secret can sit in several places of it, all valid for libpq and
passed on by SQLAlchemy: the password of the netloc (``postgresql://user:secret@host/db``);
a query parameter (``?password=secret``, ``?sslpassword=secret``, the client key's
passphrase, or any parameter whose name says password, secret or token); a connection
string inside a parameter or the database name, which libpq expands
(``?dbname=host%3Ddb%20password%3Dsecret`` or ``?dbname=postgresql://u:secret@h/db``).
Every one is masked, in one place. ``passfile``, ``sslkey`` and ``sslcert`` name
files; their paths are not secret and stay visible (they are what one needs to debug
a connection).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, quote_plus

from sqlalchemy import Connection, Engine, create_engine, event, exc, func, select
from sqlalchemy.engine import URL, make_url

from ..config import LeaseConfig
from ..exceptions import (
    ConfigurationError,
    MissingDependencyError,
)

T = TypeVar("T")

# -- redaction ----------------------------------------------------------------------------

#: What a secret is replaced with (SQLAlchemy's own ``hide_password`` mask).
MASK = "***"

_SECRET_NAME = r"(?:\w*(?:password|passwd|secret|token)\w*|pwd)"
_SECRET_KEY = re.compile(rf"^{_SECRET_NAME}$", re.IGNORECASE)

#: ``scheme://user:password@`` anywhere in a text.
_NETLOC = re.compile(r"(\b[a-z][\w+.-]*://[^\s:/@'\"]*:)([^\s@]*)(@)", re.IGNORECASE)
#: ``password=value`` in a query (``?``, ``&``, ``;``) or a libpq conninfo (spaces), with
#: a value plain, single-quoted (conninfo) or double-quoted.
_KEYWORD = re.compile(
    rf"((?:^|[?&;\s'\"(,])\s*{_SECRET_NAME}\s*=\s*)('(?:\\.|[^'\\])*'|\"[^\"]*\"|[^\s&;'\",)]+)",
    re.IGNORECASE,
)


#: Known secret values shorter than this are not searched for in free text (the patterns
#: still mask them wherever they appear as a password or a ``password=`` value).
_SHORTEST_REPLACED = 4


def is_secret_key(name: str) -> bool:
    """Whether a URL query parameter or libpq keyword named ``name`` holds a secret."""
    return bool(_SECRET_KEY.match(name))


def _embedded(value: str) -> bool:
    """Whether a parameter's value is itself a connection string libpq would expand."""
    return "=" in value or "://" in value


def _parse(url: URL | str) -> URL | None:
    """``url`` parsed, or ``None`` if it is no URL (SQLAlchemy raises ``ValueError`` for a
    port that is no number, ``ArgumentError`` for the rest)."""
    if isinstance(url, URL):
        return url
    try:
        return make_url(url)
    except (exc.ArgumentError, ValueError):
        return None


def _secrets(url: URL) -> list[str]:
    """The secret values ``url`` carries, longest first (for replacing in free text)."""
    found: list[str] = []
    if url.password:
        found.append(str(url.password))
    values = [url.database or ""]
    for key, value in url.query.items():
        items = (value,) if isinstance(value, str) else tuple(value)
        if is_secret_key(key):
            found.extend(v for v in items if v)
        else:
            values.extend(items)
    for value in values:
        if not _embedded(value):
            continue
        for match in _KEYWORD.finditer(value):
            found.append(match.group(2).strip("'\""))
        nested = _parse(value)
        if nested is not None:
            found.extend(_secrets(nested))
    return sorted({s for s in found if s}, key=len, reverse=True)


def redact(text: str, *urls: URL | str | None) -> str:
    """``text`` with every secret masked: the values carried by ``urls`` (as given and
    URL-quoted), and anything that reads as a URL password or a ``password=`` keyword.

    This is for text that may quote a URL or a driver's view of it: a parse error, a
    driver's message. An unparseable URL string is masked by the patterns alone.
    """
    for url in urls:
        parsed = None if url is None else _parse(url)
        if parsed is None:
            continue
        for secret in _secrets(parsed):
            if len(secret) < _SHORTEST_REPLACED:
                continue  # masking every "ab" of a message would garble it
            for form in {secret, quote(secret, safe=""), quote_plus(secret), quote(secret)}:
                text = text.replace(form, MASK)
    text = _NETLOC.sub(lambda m: m.group(1) + MASK + m.group(3), text)
    return _KEYWORD.sub(lambda m: m.group(1) + MASK, text)


def _mask_embedded(value: str) -> str:
    if not _embedded(value):
        return value
    if _parse(value) is None:
        return redact(value)  # a libpq conninfo: ``host=db password=...``
    return safe_url(value)


def safe_url(url: URL | str) -> str:
    """The URL as it may be shown in logs, errors and output: every secret masked.

    Everything else (driver, user, host, port, database, non-secret parameters such as
    ``sslmode`` or ``passfile``) stays visible, so two safe URLs are equal when their
    URLs name the same database with the same options.
    """
    parsed = _parse(url)
    if parsed is None:
        return redact(str(url))
    query: dict[str, str | tuple[str, ...]] = {}
    for key, value in parsed.query.items():
        items = (value,) if isinstance(value, str) else tuple(value)
        masked = tuple(MASK if is_secret_key(key) else _mask_embedded(v) for v in items)
        query[key] = masked[0] if isinstance(value, str) else masked
    parsed = parsed.set(
        password=MASK if parsed.password else None,
        database=_mask_embedded(parsed.database) if parsed.database else parsed.database,
        query=query,
    )
    # the mask is percent-encoded in a query: show it as the mask
    rendered = parsed.render_as_string(hide_password=False).replace("%2A%2A%2A", MASK)
    rendered = _HOST_LISTS.sub(lambda m: m.group(1) + _readable(m.group(2)), rendered)
    return redact(rendered)


#: libpq's host lists in a query (``host=db1:5432&host=db2:5432``, ``host=db1,db2``,
#: ``port=5432,5433``): shown as written, not percent-encoded, so that the hosts of a
#: multi-host URL can be read in a log line.
_HOST_LISTS = re.compile(r"([?&](?:host|hostaddr|port)=)([^&]*)")


def _readable(value: str) -> str:
    return value.replace("%3A", ":").replace("%2C", ",")


# -- deadlines ----------------------------------------------------------------------------


class Watchdog:
    """Shuts down connections whose store call outlived its deadline (one per process)."""

    def __init__(self) -> None:
        self._reset()
        self._local = threading.local()
        # a child forked while a thread of the parent held the lock would wait on it
        # for ever; it inherits no thread and none of the parent's calls either
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        #: id(dbapi connection) -> (deadline, the connection)
        self._watched: dict[int, tuple[float, Any]] = {}
        self._thread: threading.Thread | None = None
        self._pid = 0
        #: When the thread wakes next by itself (it is woken earlier only for an earlier
        #: deadline: deadlines mostly grow, so a store call rarely wakes it at all).
        self._wake_at = float("inf")
        #: How many connections this watchdog has shut down (for logs and tests).
        self.fired = 0

    def remaining(self) -> float | None:
        """Seconds left before the calling thread's deadline (``None``: no deadline)."""
        deadline: float | None = getattr(self._local, "deadline", None)
        if deadline is None:
            return None
        return deadline - time.monotonic()

    def arm(self, deadline: float) -> tuple[Any, Any]:
        """Watch every connection this thread uses until ``deadline`` (monotonic); give
        what this returns to :meth:`disarm` when the call ends (a plain pair of methods,
        not a context manager: this runs once per store call)."""
        local = self._local
        outer = (getattr(local, "deadline", None), getattr(local, "conns", None))
        if outer[0] is not None and outer[0] < deadline:
            deadline = outer[0]  # a call made inside another keeps the outer deadline
        local.deadline = deadline
        local.conns = []
        return outer

    def disarm(self, outer: tuple[Any, Any]) -> None:
        """End the calling thread's deadline (restoring an outer call's)."""
        local = self._local
        conns = local.conns
        if conns:
            with self._cond:
                for conn in conns:
                    self._watched.pop(id(conn), None)
        local.deadline, local.conns = outer

    def watch(self, dbapi_conn: Any) -> None:
        """Called by the pool when this thread gets ``dbapi_conn`` (connect, checkout)."""
        deadline: float | None = getattr(self._local, "deadline", None)
        if deadline is None:
            return  # not inside a store call (a caller's own use of the engine)
        self._local.conns.append(dbapi_conn)
        with self._cond:
            self._watched[id(dbapi_conn)] = (deadline, dbapi_conn)
            if self._thread is None or self._pid != os.getpid():
                # first use (a forked child starts its own: threads are not inherited)
                self._pid = os.getpid()
                self._thread = threading.Thread(
                    target=self._run, name="celery-lease-store-deadline", daemon=True
                )
                self._thread.start()
            if deadline < self._wake_at:
                self._wake_at = deadline
                self._cond.notify()

    def unwatch(self, dbapi_conn: Any) -> None:
        """Called by the pool when the connection is given back (or closed)."""
        with self._cond:
            self._watched.pop(id(dbapi_conn), None)

    def _run(self) -> None:
        while True:
            expired: list[Any] = []
            with self._cond:
                now = time.monotonic()
                for key, (deadline, conn) in list(self._watched.items()):
                    if deadline <= now:
                        del self._watched[key]
                        expired.append(conn)
                if not expired:
                    soonest = min((d for d, _ in self._watched.values()), default=None)
                    self._wake_at = float("inf") if soonest is None else soonest
                    self._cond.wait(None if soonest is None else max(0.0, soonest - now))
                    continue
            for conn in expired:
                self._shut_down(conn)

    def _shut_down(self, dbapi_conn: Any) -> None:
        try:
            fd = dbapi_conn.fileno()
        except Exception:
            return  # already closed
        try:
            # shutdown acts on the socket, not on this duplicate descriptor: the driver
            # blocked in poll() on its own descriptor wakes up to a closed connection
            with socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return
        self.fired += 1


#: The process's watchdog: deadlines are per thread, so every engine shares it.
WATCHDOG = Watchdog()


#: A reading of the database's clock is taken again after this many seconds.
_CLOCK_SAMPLE_MAX_AGE = 60.0


#: How much the database's clock and this process's monotonic clock may differ in rate
#: (1000 ppm, generous: NTP keeps both far closer), taken off a submission's deadline.
_CLOCK_DRIFT = 1e-3


class DbClock:
    """The database's clock as last read, and this process's monotonic time when that
    answer arrived: a store call's deadline in database time (a submission is written
    only while the database's clock is before it)."""

    def __init__(self) -> None:
        self._sample: tuple[datetime, float] | None = None

    def saw(self, db_time: datetime) -> None:
        """A statement just answered with the database's clock ``db_time``."""
        self._sample = (db_time, time.monotonic())

    def now(self, read: Callable[[], datetime]) -> datetime:
        """The database's clock now, estimated from the last reading and this process's
        monotonic time since (``read``: a fresh reading, taken when the last one is older
        than :data:`_CLOCK_SAMPLE_MAX_AGE`)."""
        sample = self._sample
        if sample is None or time.monotonic() - sample[1] > _CLOCK_SAMPLE_MAX_AGE:
            value = read()
            sample = self._sample = (value, time.monotonic())
        db_time, seen = sample
        return db_time + timedelta(seconds=time.monotonic() - seen)

    def deadline(self, conn: Connection, timeout: float) -> datetime:
        """The calling store call's deadline in database time, a little early (``timeout``:
        the call's bound when it runs under no deadline).

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
            left = timeout
        now = time.monotonic()
        sample = self._sample
        if sample is None or now - sample[1] > _CLOCK_SAMPLE_MAX_AGE:
            read = conn.execute(select(func.clock_timestamp())).scalar_one()
            now = time.monotonic()
            sample = self._sample = (read, now)
        db_time, seen = sample
        span = max(0.0, now + left - seen)
        return db_time + timedelta(seconds=span * (1.0 - _CLOCK_DRIFT))


@contextlib.contextmanager
def bounded_connection(dbapi_conn: Any, timeout: float) -> Iterator[None]:
    """Shut down ``dbapi_conn``'s socket if the block outlives ``timeout`` seconds.

    For a connection the store does not own but that reads its tables (the Django
    admin's queries through Django's own connection): the driver call blocked on it
    then fails at once as a lost connection, as a store call's would."""
    outer = WATCHDOG.arm(time.monotonic() + timeout)
    try:
        WATCHDOG.watch(dbapi_conn)
        yield
    finally:
        WATCHDOG.disarm(outer)


# -- engines, driver errors and retries ---------------------------------------------------


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
        _reconnect_when_read_only(engine)
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
    """Put every connection a store call uses under its deadline (see "Deadlines" above)."""

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
    inside a transaction for a whole TTL, and never sooner than ``lease_db_timeout``:
    the store's transactions are a few statements issued back to back, so one left
    open that long means its process was frozen (SIGSTOP, a paused VM) or hung between
    two statements, and the row locks it holds (the reaper lock's row, a task row)
    would otherwise block every other worker's reaper for as long as the freeze lasts.
    A live process is never cut short by it: its own watchdog abandons a call at
    ``lease_db_timeout``, so a process merely slowed down (a busy machine, a short
    TTL) keeps its transaction. One round trip, once per connection.
    """
    idle_ms = max(1000, int(max(config.ttl, config.db_timeout) * 1000))
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


#: SQLSTATE ``read_only_sql_transaction``: the server refused a write.
READ_ONLY_SQLSTATE = "25006"


def _reconnect_when_read_only(engine: Engine) -> None:
    """Treat a write refused as read-only like a lost connection.

    After a failover the server a pooled connection reached may no longer take writes
    while the connection lives on: a former primary fenced with
    ``default_transaction_read_only`` (or demoted behind a proxy that keeps client
    connections), a standby a DNS name pointed at until it moved to the new primary.
    The idle ping (``SELECT 1``) passes there, and before this every write failed with
    a ``StoreError`` on the same connection until ``pool_recycle`` (30 minutes)
    replaced it. Marked a disconnect, SQLAlchemy invalidates the connection and every
    older pooled one; the store's :func:`retrying` runs the transaction again on a new
    connection, which libpq opens on the host that accepts writes (with
    ``target_session_attrs=read-write``, or once the name moved), and the call ends
    with :class:`~celery_lease.exceptions.StoreUnavailable` (transient) if none does
    within ``lease_db_timeout``. A dialect event: the store's fast path for submissions
    (no connection events) is kept.
    """

    @event.listens_for(engine, "handle_error")
    def _on_error(context: Any) -> None:
        if getattr(context.original_exception, "sqlstate", None) == READ_ONLY_SQLSTATE:
            context.is_disconnect = True


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
