"""The worker incarnation's heartbeat: one row per worker, renewed from its own thread."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ._incarnation import Incarnation
from .exceptions import StoreError
from .store import Store

logger = logging.getLogger("celery_lease.heartbeat")


class Heartbeat(threading.Thread):
    """Renews the incarnation row every ``interval`` seconds: one statement per worker,
    however many tasks it runs.

    If renewal fails for a whole ``ttl`` (database unreachable, or this process was
    frozen), the worker treats its leases as lost: it raises the shared fence flag so
    every running task stops at its next step boundary, and once the database answers
    again ``on_recovered`` expires the rows it still holds. Each renewal also moves the
    shared deadline (``flags.deadline``) one TTL ahead, so tasks see the fence on time
    even when this thread is stuck in a renewal or its process is frozen.
    """

    def __init__(
        self,
        store: Store,
        incarnation: Incarnation,
        *,
        interval: float,
        ttl: float,
        on_recovered: Callable[[str], None],
    ) -> None:
        super().__init__(name="celery-lease-heartbeat", daemon=True)
        self.store = store
        self.incarnation = incarnation
        self.interval = interval
        self.ttl = ttl
        self.on_recovered = on_recovered
        self.renewals = 0
        self._stop_event = threading.Event()
        self._last_ok = time.monotonic()
        incarnation.flags.deadline = self._last_ok + ttl

    def stop(self) -> None:
        self._stop_event.set()

    def beat(self) -> bool:
        """Renew once; returns whether the renewal was recorded."""
        inc = self.incarnation
        # A gap longer than the TTL means others may already have expired our leases:
        # whatever we still hold is lost, even if this renewal succeeds.
        gap = time.monotonic() - self._last_ok
        if gap >= self.ttl and not inc.flags.raised:
            logger.error(
                "worker %s: heartbeat not renewed for %.1f s (TTL %.1f s): "
                "treating its leases as lost",
                inc.nodename,
                gap,
                self.ttl,
            )
            inc.flags.fenced = True
        sent = time.monotonic()  # the row's heartbeat is no earlier than this
        try:
            renewed = self.store.renew(inc.id)
            if not renewed:
                # someone marked this incarnation stopped (a restart under the same node
                # name elsewhere, or an operator): its leases were expired; fence what
                # still runs here and carry on heartbeating for new work
                logger.error(
                    "worker %s: incarnation %s was marked stopped by someone else "
                    "(duplicate node name?); re-registering",
                    inc.nodename,
                    inc.id,
                )
                inc.flags.fenced = True
                self.store.reactivate_worker(inc.id)
        except StoreError as error:
            logger.warning("worker %s: heartbeat failed: %s", inc.nodename, error)
            return False
        self._last_ok = sent
        self.renewals += 1
        if inc.flags.fenced:
            # past the deadline without a word from this thread (a renewal stuck in a
            # connect timeout): the leases are lost all the same
            inc.flags.fenced = True
            try:
                self.on_recovered(
                    f"worker {inc.nodename} self-fenced: heartbeat lapsed for {gap:.1f} s"
                )
            except StoreError as error:
                logger.warning(
                    "worker %s: could not expire fenced leases yet: %s", inc.nodename, error
                )
                return True
            inc.flags.deadline = self._last_ok + self.ttl
            inc.flags.fenced = False
            logger.warning("worker %s: heartbeat restored; fenced leases expired", inc.nodename)
            return True
        inc.flags.deadline = self._last_ok + self.ttl
        return True

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self.beat()
