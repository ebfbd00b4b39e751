"""A deadline for every store call, kept even by a database that never answers.

PostgreSQL's ``statement_timeout`` and ``lock_timeout`` end a slow statement, and
TCP keepalives and ``tcp_user_timeout`` notice a peer that stopped acknowledging,
but neither helps when the server (or a proxy, a NAT, a load balancer in between)
accepts the connection and then never answers: psycopg waits on the socket for as
long as it stays open. So each store call runs under a deadline, and a watchdog
thread shuts down the socket of a connection that is still in use when its
deadline passes. The blocked driver call then fails at once as a lost connection
(SQLAlchemy invalidates it, the pool opens a fresh one next time) and the store
raises :class:`~celery_lease.exceptions.StoreUnavailable`.

The connections are watched from the pool's ``connect`` and ``checkout`` events,
so the session settings sent at connect and the idle ping at checkout are bounded
too; a new connection's handshake is bounded by libpq's ``connect_timeout``, which
the engine sets per connection to what remains of the deadline.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any


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

    @contextlib.contextmanager
    def armed(self, deadline: float) -> Iterator[None]:
        """:meth:`arm` and :meth:`disarm` as a context manager."""
        outer = self.arm(deadline)
        try:
            yield
        finally:
            self.disarm(outer)

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
