"""Count what the store sends to its database: statements, BEGIN/COMMIT, pool pings.

:class:`SqlCounter` listens to SQLAlchemy events (``before_cursor_execute``,
``begin``/``commit``/``rollback``, and the pool's ``connect``/``checkout``) and derives
round trips from them the way the drivers behave:

- every statement is one round trip (psycopg sends Parse/Bind/Execute/Sync together);
- on PostgreSQL a transaction that is not in autocommit costs a ``BEGIN`` (psycopg sends
  it before the first statement) and a ``COMMIT``; in autocommit both cost nothing;
- on SQLite the store's ``BEGIN IMMEDIATE`` is itself a statement, and ``COMMIT`` is the
  driver's; there is no network, so a "round trip" is a call into the library;
- the store pings a pooled PostgreSQL connection at checkout only when it sat idle for
  ``IDLE_PING_AFTER`` seconds (on the raw DBAPI connection, so no cursor event sees
  it): one round trip then; an engine with ``pool_pre_ping`` pings at every checkout
  of a connection that is not new.

:func:`wire_trace` checks the model on PostgreSQL at the protocol level (libpq trace):
each frontend ``Query`` or ``Sync`` message is one round trip.

Counts are kept per *role*: by default the thread name tells the worker's heartbeat
and reaper threads ("background") from everything else ("task").
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.pool import Pool

BACKGROUND_THREADS = ("celery-lease-heartbeat", "celery-lease-reaper")


def thread_role() -> str:
    name = threading.current_thread().name
    return "background" if name in BACKGROUND_THREADS else "task"


def _autocommit(conn: Any) -> bool:
    try:
        return bool(getattr(conn.connection.dbapi_connection, "autocommit", False))
    except Exception:
        return False


def _idle_ping(dbapi_conn: Any, record: Any) -> bool:
    """Whether the store's checkout listener pings this connection (it sat idle)."""
    from celery_lease.store import _db

    if type(dbapi_conn).__module__.split(".")[0] != "psycopg":
        return False
    last = record.info.get(_db._LAST_USED)
    return last is not None and time.monotonic() - last >= _db.IDLE_PING_AFTER


class SqlCounter:
    """Thread-safe counters of statements, transactions, pings and time in statements."""

    def __init__(self, role: Callable[[], str] = thread_role) -> None:
        self.role = role
        self.counts: collections.Counter[str] = collections.Counter()
        self.seconds: collections.defaultdict[str, float] = collections.defaultdict(float)
        self._lock = threading.Lock()
        self._local = threading.local()

    # -- attaching ------------------------------------------------------------------------

    def attach(self, target: Any = Engine, pool: Any = Pool) -> SqlCounter:
        """Listen on one engine (and its pool), or on every engine (the classes)."""
        event.listen(target, "before_cursor_execute", self._before)
        event.listen(target, "after_cursor_execute", self._after)
        event.listen(target, "begin", self._begin)
        event.listen(target, "commit", self._commit)
        event.listen(target, "rollback", self._rollback)
        event.listen(pool, "connect", self._connect)
        event.listen(pool, "checkout", self._checkout)
        return self

    def detach(self, target: Any = Engine, pool: Any = Pool) -> None:
        engine_events: list[tuple[str, Callable[..., Any]]] = [
            ("before_cursor_execute", self._before),
            ("after_cursor_execute", self._after),
            ("begin", self._begin),
            ("commit", self._commit),
            ("rollback", self._rollback),
        ]
        for name, fn in engine_events:
            with contextlib.suppress(Exception):
                event.remove(target, name, fn)
        pool_events: list[tuple[str, Callable[..., Any]]] = [
            ("connect", self._connect),
            ("checkout", self._checkout),
        ]
        for name, fn in pool_events:
            with contextlib.suppress(Exception):
                event.remove(pool, name, fn)

    # -- events ---------------------------------------------------------------------------

    def _add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[f"{self.role()}:{key}"] += n

    def _before(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        verb = statement.lstrip().split(None, 1)[0].upper() if statement.strip() else "?"
        self._add(f"stmt:{verb}")
        self._local.t0 = time.perf_counter()

    def _after(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        t0 = getattr(self._local, "t0", None)
        if t0 is not None:
            with self._lock:
                self.seconds[self.role()] += time.perf_counter() - t0

    def _begin(self, conn: Any) -> None:
        # SQLite: the store's own "begin" listener sends BEGIN IMMEDIATE as a statement
        if conn.dialect.name == "postgresql" and not _autocommit(conn):
            self._add("tx:BEGIN")

    def _commit(self, conn: Any) -> None:
        if not _autocommit(conn):
            self._add("tx:COMMIT")

    def _rollback(self, conn: Any) -> None:
        if not _autocommit(conn):
            self._add("tx:ROLLBACK")

    def _connect(self, dbapi_conn: Any, record: Any) -> None:
        record.info["bench_fresh"] = True
        self._add("pool:connect")

    def _checkout(self, dbapi_conn: Any, record: Any, proxy: Any) -> None:
        self._add("pool:checkout")
        fresh = record.info.pop("bench_fresh", False)
        if getattr(record, "_ConnectionRecord__pool", None) is not None:
            pool = record._ConnectionRecord__pool
        else:
            pool = getattr(record, "_pool", None)
        pre_ping = bool(getattr(pool, "_pre_ping", False))
        if fresh:
            return
        if pre_ping or _idle_ping(dbapi_conn, record):
            self._add("pool:ping")

    # -- reading ----------------------------------------------------------------------------

    def take(self) -> tuple[dict[str, int], dict[str, float]]:
        """The counts so far, and reset."""
        with self._lock:
            counts, seconds = dict(self.counts), dict(self.seconds)
            self.counts.clear()
            self.seconds.clear()
        return counts, seconds

    def flush_to_redis(self, url: str, key: str) -> None:
        """Add the counts so far to a Redis hash (worker processes report this way)."""
        counts, seconds = self.take()
        if not counts and not seconds:
            return
        import redis

        client = redis.Redis.from_url(url)
        try:
            pipe = client.pipeline(transaction=False)
            for name, n in counts.items():
                pipe.hincrby(key, name, n)
            for role, s in seconds.items():
                pipe.hincrbyfloat(key, f"{role}:seconds", s)
            pipe.execute()
        finally:
            client.close()


def summarize(counts: dict[str, Any], role: str, per: float) -> dict[str, float]:
    """Statements, transactions, pings and round trips of ``role``, divided by ``per``."""

    def total(prefix: str) -> float:
        return sum(float(v) for k, v in counts.items() if k.startswith(f"{role}:{prefix}"))

    statements = total("stmt:")
    begins = total("tx:BEGIN")
    commits = total("tx:COMMIT") + total("tx:ROLLBACK")
    pings = total("pool:ping")
    out = {
        "statements": statements / per,
        "begin_commit": (begins + commits) / per,
        "pings": pings / per,
        "round_trips": (statements + begins + commits + pings) / per,
        "round_trips_no_ping": (statements + begins + commits) / per,
    }
    verbs: dict[str, float] = collections.defaultdict(float)
    for k, v in counts.items():
        if k.startswith(f"{role}:stmt:"):
            verbs[k.split(":", 2)[2]] += float(v) / per
    out.update({f"verb:{k}": v for k, v in verbs.items()})
    return out


# -- protocol-level check on PostgreSQL --------------------------------------------------------


@contextlib.contextmanager
def wire_trace(engine: Engine, path: Path) -> Iterator[Callable[[], int]]:
    """Trace every new psycopg connection of ``engine`` (libpq trace) into ``path``;
    yields a function returning the round trips seen so far (frontend Query + Sync)."""
    from psycopg.pq import Trace

    engine.dispose()
    fh = path.open("w")

    def on_connect(dbapi_conn: Any, record: Any) -> None:
        dbapi_conn.pgconn.trace(fh.fileno())
        dbapi_conn.pgconn.set_trace_flags(Trace.SUPPRESS_TIMESTAMPS)

    event.listen(engine, "connect", on_connect)

    libc = ctypes.CDLL(None)

    def round_trips() -> int:
        # libpq writes the trace through a C stdio stream: flush every C stream first
        libc.fflush(None)
        fh.flush()
        with path.open() as reader:
            n = 0
            for line in reader:
                parts = line.split("\t", 3)
                if len(parts) >= 3 and parts[0] == "F" and parts[2].strip() in ("Query", "Sync"):
                    n += 1
            return n

    try:
        yield round_trips
    finally:
        engine.dispose()
        event.remove(engine, "connect", on_connect)
        fh.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
