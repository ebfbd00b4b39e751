"""Talking to the broker in bounded time, and asking it whether a queue still holds
messages, for the reaper's re-publish decision.

**Every publish is bounded.** The row is the outbox: a message that cannot be sent now
is sent later by the reaper, so no caller (``apply_async``, the reaper, a worker's fast
path) need wait for a broker that accepted the connection and stopped answering. A
Redis connection waits for ever by default (kombu's ``socket_timeout`` is ``None``), so
:func:`bound_sockets` gives the app's broker connections ``socket_timeout`` and
``socket_connect_timeout`` of a third of ``lease_db_timeout`` (at least
:data:`MIN_SOCKET_TIMEOUT`), unless ``broker_transport_options`` sets them already; and
every publish of a leased task's message retries once (:data:`PUBLISH_RETRY`, for a
pooled connection left stale by a broker restart), not for as long as
``task_publish_retry_policy`` allows; the reaper's publishes retry only a failure that
came at once (a stale connection, :func:`timed_out` tells), never a broker that did
not answer (its next sweep does). A publish that gets no answer so gives up after
about ``lease_db_timeout`` (the reaper's after one socket timeout) and leaves the row
for the reaper. RabbitMQ connections are
opened within ``broker_connection_timeout`` and a publish writes without waiting for an
answer (with publisher confirms, the wait is bounded by the same ``timeout``).

Age alone cannot tell a lost message from a queued one: in a backlog longer than
``lease_republish_after`` every waiting row looks lost, and re-publishing them
multiplies the backlog. So before re-publishing a row that *was* published, the
reaper asks its queue's depth (a passive ``queue_declare`` through kombu: RabbitMQ
answers with the queue's ready messages, and kombu's Redis transport with the length
of the queue's lists). A queue that holds messages, or held some less than
``lease_republish_after`` ago, may still hold this row's message: the row is left
alone and looked at again later. Once the queue has been empty that long, a row
still PENDING lost its message and is published again. A broker that cannot answer
(another transport, a connection error) leaves the decision to age, as before.

Rows never marked published (their producer died before publishing) are not held
back: their message never reached any queue.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from celery import Celery

from ._apps import AppRegistry

if TYPE_CHECKING:
    from .store import Publishable, Store

logger = logging.getLogger("celery_lease.broker")

#: Smallest socket timeout given to Redis connections: above kombu's ``brpop_timeout``
#: (1 s), so a consumer's blocking BRPOP is never cut short.
MIN_SOCKET_TIMEOUT = 2.0

#: kombu's retry policy for publishing a leased task's message: one more try on a fresh
#: connection, at once (the row is the outbox: the reaper sends what this does not).
PUBLISH_RETRY: dict[str, Any] = {
    "max_retries": 1,
    "interval_start": 0,
    "interval_step": 0.2,
    "interval_max": 0.2,
}


def timed_out(error: BaseException) -> bool:
    """Whether a failed publish waited for a broker that did not answer (a socket or
    confirm timeout, whichever transport raised it), rather than failing at once (a
    pooled connection reset by a broker restart, a refused connection)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        # builtin TimeoutError (socket.timeout), redis-py's and amqp's own TimeoutErrors
        if any(cls.__name__ == "TimeoutError" for cls in type(current).__mro__):
            return True
        current = current.__cause__ or current.__context__
    return False


def socket_timeout(db_timeout: float) -> float:
    """The socket timeout of a broker connection, for a bound of ``db_timeout``: a
    publish that retries waits on at most three sockets (the stale one, the new
    connection's first command, the publish again)."""
    return max(MIN_SOCKET_TIMEOUT, db_timeout / 3)


def publish_options(db_timeout: float, *, retry: bool = True) -> dict[str, Any]:
    """``Producer.publish`` keywords that keep a publish within about ``db_timeout``
    (``timeout``/``confirm_timeout``: RabbitMQ's wait for a publisher confirm).

    ``retry=False``: one try (the reaper's: its next sweep is the retry)."""
    return {
        "retry": retry,
        "retry_policy": dict(PUBLISH_RETRY),
        "timeout": db_timeout,
        "confirm_timeout": db_timeout,
    }


def bound_sockets(app: Celery, db_timeout: float) -> None:
    """Give the app's Redis broker connections socket timeouts (see the module
    docstring), unless ``broker_transport_options`` sets them. Called when celery-lease
    is installed in a configured app, before its connections are made."""
    from kombu import Connection

    url = app.conf.broker_write_url or app.conf.broker_url
    try:
        driver = Connection(url, transport=app.conf.broker_transport).transport.driver_type
    except Exception:  # an unknown transport: Celery says so itself when it connects
        logger.debug("broker transport not resolved; sockets left as configured", exc_info=True)
        return
    if driver != "redis":
        return
    options = dict(app.conf.broker_transport_options or {})
    wait = socket_timeout(db_timeout)
    changed = False
    for key in ("socket_timeout", "socket_connect_timeout"):
        if key not in options:
            options[key] = wait
            changed = True
    if changed:
        app.conf.broker_transport_options = options


class QueueDepths:
    """Depths of queues, read through the app's broker connection."""

    def __init__(self, app: Celery) -> None:
        self.app = app

    def depth(self, queues: Sequence[str]) -> dict[str, int | None]:
        """Messages waiting in each queue (``None``: the broker could not tell)."""
        from kombu.exceptions import ChannelError, OperationalError

        out: dict[str, int | None] = dict.fromkeys(queues)
        if not queues:
            return out
        try:
            with self.app.connection_for_read() as conn:
                # a fresh connection, tried once: a broker that does not answer costs
                # one socket timeout (see above), and age decides this time
                conn.ensure_connection(max_retries=0)
                for queue in queues:
                    channel: Any = conn.channel()
                    try:
                        out[queue] = int(channel.queue_declare(queue, passive=True).message_count)
                    except ChannelError:
                        out[queue] = 0  # no such queue (Redis: an empty one): nothing waits
                    finally:
                        try:
                            channel.close()
                        except Exception:  # the channel is gone with its error
                            logger.debug("channel close failed", exc_info=True)
        except (OperationalError, ConnectionError, OSError) as error:
            logger.info("celery-lease: broker queue depths not read (%s): age decides", error)
        return out


class BacklogGuard:
    """The reaper's memory of which queues held messages, and when last.

    ``clock`` is this process's monotonic time: the guard's memory is its own (an
    embedded reaper that takes over from another starts with none, and then decides
    by what it sees)."""

    def __init__(
        self,
        app: Celery,
        republish_after: float,
        depths: QueueDepths | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.republish_after = republish_after
        self.depths = depths or QueueDepths(app)
        self.clock = clock
        #: Queue name -> when it was last seen holding messages.
        self.busy_at: dict[str, float] = {}
        self._routes: dict[tuple[str, str | None], str] = {}

    def queue_of(self, name: str, options: str | None) -> str:
        """The queue a task's message goes to: its own ``queue`` option, else Celery's
        router (``task_routes``, then ``task_default_queue``)."""
        opts: dict[str, Any] = {}
        if options:
            try:
                loaded = json.loads(options)
                opts = loaded if isinstance(loaded, dict) else {}
            except ValueError:
                opts = {}
        explicit = opts.get("queue")
        if isinstance(explicit, str) and explicit:
            return explicit
        key = (name, None)
        found = self._routes.get(key)
        if found is None:
            route = self.app.amqp.router.route({}, name)
            queue = route.get("queue")
            found = getattr(queue, "name", None) or str(queue or self.app.conf.task_default_queue)
            self._routes[key] = found
        return found

    def still_queued(self, rows: Sequence[tuple[str, str, str | None]]) -> set[str]:
        """Of ``rows`` (task id, name, options) that were published, the ids whose
        queue holds messages, or did less than ``republish_after`` ago."""
        by_queue: dict[str, list[str]] = {}
        for task_id, name, options in rows:
            by_queue.setdefault(self.queue_of(name, options), []).append(task_id)
        depths = self.depths.depth(sorted(by_queue))
        now = self.clock()
        held: set[str] = set()
        for queue, ids in by_queue.items():
            depth = depths.get(queue)
            if depth is None:
                continue  # the broker cannot tell: age decides
            if depth > 0:
                self.busy_at[queue] = now
            last = self.busy_at.get(queue)
            if last is not None and now - last < self.republish_after:
                held.update(ids)
        return held

    def filter(self, store: Store, rows: Sequence[Publishable]) -> tuple[list[Publishable], int]:
        """Of ``rows`` (just reserved by ``take_unpublished``), those to publish now, and
        how many were held back because their queue still holds messages (and no task
        submitted after them to that queue was claimed yet: :meth:`Store.overtaken`)."""
        if not rows:
            return list(rows), 0
        queued = self.still_queued([(r.id, r.name, r.options) for r in rows])
        if queued:
            # a busy queue may hold the message, unless later tasks of its queue were
            # already handed out: then it is not in there any more
            queued -= store.overtaken(sorted(queued))
        if not queued:
            return list(rows), 0
        skip = set(store.hold_published([r.id for r in rows if r.id in queued]))
        return [r for r in rows if r.id not in skip], len(skip)


_guards: AppRegistry[BacklogGuard] = AppRegistry()
_guards_lock = threading.Lock()


def backlog_guard(app: Celery, republish_after: float) -> BacklogGuard:
    """This process's guard for ``app`` (its memory of busy queues outlives a sweep)."""
    with _guards_lock:
        guard = _guards.get(app)
        if guard is None or guard.republish_after != republish_after:
            guard = _guards[app] = BacklogGuard(app, republish_after)
        return guard
