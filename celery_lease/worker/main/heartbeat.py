"""The worker incarnation's heartbeat: one row per worker, renewed from its own thread."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from ..._incarnation import Incarnation
from ...config import LeaseConfig
from ...exceptions import StoreError
from ...store import Store

logger = logging.getLogger("celery_lease.heartbeat")


def renewal_config(config: LeaseConfig, ttl: float) -> LeaseConfig:
    """Settings of the heartbeat's own store: a renewal gives up within half the TTL.

    The heartbeat renews through an engine of its own (one connection, a tighter
    bound): it never waits behind the reaper or the outcome writer for a pooled
    connection, and a database that stops answering costs it at most
    ``min(lease_db_timeout, ttl / 2)`` per renewal (a new connection's handshake at
    least libpq's 2 s), so it reports the outage and tries again well within the TTL.
    """
    bound = min(config.db_timeout, ttl / 2)
    own = dataclasses.replace(config, db_timeout=bound, pool_size=1)
    return own.tuned(
        **{
            **dataclasses.asdict(config.tuning),
            "db_connect_timeout": min(config.db_connect_timeout, bound),
            "sqlite_busy_timeout": min(config.sqlite_busy_timeout, bound),
        }
    )


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
        #: A later incarnation under the same node name superseded this one (see
        #: ``_renew``): the worker stays fenced.
        self.superseded = False
        self._stop_event = threading.Event()
        self._last_ok = time.monotonic()
        incarnation.flags.ttl = ttl
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
        # the deadline a renewal gives must leave time for the next one to land
        margin = min(self.interval, self.ttl / 2)
        for _ in range(3):
            sent = time.monotonic()  # the row's heartbeat is no earlier than this
            if not self._renew():
                return False
            took = time.monotonic() - sent
            if took < self.ttl - margin:
                break
            # the renewal hung (a lock, a stalled connection): the row was renewed at
            # some moment of it, so only ``sent`` is certain, and ``sent + ttl`` is past
            # or about to pass. Lifting a fence on it (or keeping a deadline on it)
            # would fence the worker again at the next beat: renew again now instead.
            logger.warning(
                "worker %s: heartbeat renewal took %.1f s (TTL %.1f s); renewing again",
                inc.nodename,
                took,
                self.ttl,
            )
            if took >= self.ttl:
                inc.flags.fenced = True  # others may have seen the row expired meanwhile
        else:
            return False
        lapsed = sent - self._last_ok  # from the last renewal known good to this one
        self._last_ok = sent
        self.renewals += 1
        if inc.flags.fenced:
            # past the deadline without a word from this thread (a renewal stuck in a
            # connect timeout): the leases are lost all the same
            inc.flags.fenced = True
            try:
                self.on_recovered(
                    f"worker {inc.nodename} self-fenced: heartbeat lapsed for {lapsed:.1f} s "
                    f"(TTL {self.ttl:g} s)"
                )
            except StoreError as error:
                logger.warning(
                    "worker %s: could not expire fenced leases yet: %s", inc.nodename, error
                )
                return True
            inc.flags.deadline = self._last_ok + self.ttl
            inc.flags.fenced = False
            logger.warning(
                "worker %s: heartbeat restored; fenced leases expired (lapsed for %.1f s)",
                inc.nodename,
                lapsed,
            )
            return True
        inc.flags.deadline = self._last_ok + self.ttl
        return True

    def _renew(self) -> bool:
        """One renewal statement; ``False`` if the database did not record it."""
        inc = self.incarnation
        try:
            renewed = self.store.renew(inc.id)
            if not renewed:
                # someone marked this incarnation stopped (an operator, or a worker that
                # took it for a dead predecessor), or its row is gone (a failover to a
                # replica the registration had not reached): its leases were expired,
                # or could be (an unknown owner's lease is expired). Fence what still
                # runs here, and register again for new work, unless a later
                # incarnation under this name superseded this one
                if not self.superseded:
                    logger.error(
                        "worker %s: incarnation %s was marked stopped by someone else "
                        "(duplicate node name?) or its row is missing (database "
                        "failover?); re-registering",
                        inc.nodename,
                        inc.id,
                    )
                inc.flags.fenced = True
                if not self.store.reactivate_worker(
                    inc.id, inc.nodename, inc.hostname, inc.pid, inc.registered_at
                ):
                    # stays fenced: claims nothing, consumes nothing, expires nothing
                    # more; the later incarnation runs the name's tasks
                    if not self.superseded:
                        logger.critical(
                            "worker %s: incarnation %s was superseded by a later one "
                            "under the same node name: it stays stopped and fenced "
                            "(stop this worker; give each worker a unique name)",
                            inc.nodename,
                            inc.id,
                        )
                    self.superseded = True
                    return False
                self.superseded = False
        except StoreError as error:
            logger.warning("worker %s: heartbeat failed: %s", inc.nodename, error)
            return False
        return True

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self.beat()
