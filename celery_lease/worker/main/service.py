"""The worker's service in its main process: the incarnation, and a thread of its own.

The main process owns the incarnation row and renews it (the heartbeat's thread), forks
the lease agent that claims (:mod:`.agent`), writes the outcomes pool processes hand
over (the outcome writer's thread), and runs the service's thread: the events the
worker's own threads send it (a pool child lost, a delivery revoked), a backstop for
pool children whose death the pool never reported, the reconciliation of the rows it
owns with the tasks it has in hand (:mod:`.reconcile`: a lost outcome), and the
embedded reaper (behind a database lock). Started by the bootstep (:mod:`.bootstep`),
with retries while the database cannot be reached yet.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import socket
import threading
import time
import uuid
from typing import Any

from celery.worker import state as worker_state

from ..._apps import AppRegistry
from ..._runtime import Incarnation, Runtime
from ...exceptions import ConfigurationError, StoreError, StoreUnavailable
from ...producer import publisher as _publisher
from ...reaper import Reaper
from ...store import Store
from .agent import LeaseAgent
from .heartbeat import Heartbeat, renewal_config
from .node_names import dead_predecessors, pid_gone
from .outcome_writer import OutcomeWriter, writer_config
from .reconcile import ROUND_EVERY, Reconciler

logger = logging.getLogger("celery_lease.worker")

#: The service of each app's worker main process (none in its pool children's use).
services: AppRegistry[WorkerService] = AppRegistry()


@dataclasses.dataclass(frozen=True)
class Event:
    """What the main process tells the service thread about one task."""

    kind: str  # "lost" (its execution ended without an outcome) or "revoked"
    task_id: str
    reason: str
    #: The worker's fence recoveries when it was raised (see ``_expire_own``).
    recoveries: int
    #: The attempt that was lost, when the pool process knew it (it had claimed).
    attempt: int | None = None
    tries: int = 0
    #: When the main process learned of it (``time.monotonic()``): with no attempt, the
    #: lost execution's claim is known to be older than this (see ``_handle_one``).
    seen_at: float = dataclasses.field(default_factory=time.monotonic)


#: Tries of an event that fails with something other than a database error.
_EVENT_TRIES = 3
#: Seconds a pool child may be gone, its task unreported by the pool, before the lease
#: is told (the pool's own check of its children runs every 5 s).
UNREPORTED_LOSS_AFTER = 10.0


class WorkerService:
    """Everything celery-lease runs in a worker's main process."""

    def __init__(self, rt: Runtime, nodename: str) -> None:
        self.rt = rt
        cfg = rt.config
        self.store = store = rt.store
        inc = Incarnation(uuid.uuid4().hex, nodename, socket.gethostname(), os.getpid())
        ttl = rt.shortest_ttl()
        store.register_worker(inc.id, inc.nodename, inc.hostname, inc.pid, supersede=False)
        inc.registered_at = store.worker_started_at(inc.id)
        try:
            predecessors = dead_predecessors(store, inc, ttl, cfg.heartbeat_interval)
        except ConfigurationError as error:
            store.stop_worker(inc.id, f"refused to start: {error}")
            raise
        store.supersede(predecessors, inc.id)
        # set before the pool forks: children inherit the incarnation and its flags
        rt.incarnation = self.incarnation = inc
        # before the pool forks too: the children inherit the hand-over socket
        self.outcomes = (
            None
            if cfg.outcome_write_through
            else OutcomeWriter(rt.app, store, inc.actor, **writer_config(cfg))
        )
        self.reaper = Reaper(rt.app, actor=f"reaper:{nodename}", store=store)
        #: The rows this worker owns against the tasks it has in hand (:mod:`.reconcile`).
        self.reconciler = Reconciler(store, inc)
        #: The lease agent (claims in batches), forked by the bootstep before the pool.
        self.agent: LeaseAgent | None = None
        self._events: queue.Queue[Event] = queue.Queue()
        #: Times the worker recovered from a self-fence (each expired all it held).
        self._fence_recoveries = 0
        self._gone_since: dict[Any, float] = {}
        self._stopping = threading.Event()
        self.heartbeat = Heartbeat(
            Store(renewal_config(cfg, ttl)),
            inc,
            interval=cfg.heartbeat_interval,
            ttl=ttl,
            on_recovered=self._expire_own,
        )
        self._thread = threading.Thread(target=self._loop, name="celery-lease-reaper", daemon=True)
        if predecessors:
            expired = store.expire(
                actor=inc.actor,
                reason=f"worker {nodename} restarted: its previous incarnation is gone",
                owners=predecessors,
                only_expired=False,
                limit=10_000,
            )
            self.reaper.publish_due()
            if expired:
                logger.warning(
                    "worker %s: expired %d leases held by its dead predecessor",
                    nodename,
                    len(expired),
                )
        logger.info(
            "celery-lease: worker %s incarnation %s (store %s)", nodename, inc.id, store.url
        )

    def start(self) -> None:
        if self.outcomes is not None:
            self.outcomes.start()
        self.heartbeat.start()
        self._thread.start()

    # -- events from the main process (never block its event loop) ---------------------

    def child_lost(self, task_id: str, reason: str, attempt: int | None = None) -> None:
        """An execution of ``task_id`` ended without an outcome (its pool child died, hit
        its hard time limit, or lost the database); ``attempt`` if it had claimed."""
        self._events.put(Event("lost", task_id, reason, self._fence_recoveries, attempt))

    def revoked(self, task_id: str, reason: str) -> None:
        """The worker discarded ``task_id`` (revoked or expired) before running it."""
        self._events.put(Event("revoked", task_id, reason, self._fence_recoveries))

    def _handle(self, events: list[Event]) -> None:
        """Handle the events in order. A database error stops at the event it hit:
        that one and the rest are kept for the next round, the ones handled before it
        are not (handled again, a lost child's event would expire the task's next
        execution). The one it hit may have committed its expiry already: handled
        again, its expiry is fenced (attempt, or claim's age) and misses an execution
        claimed since. Any other error is logged and the event kept for a few rounds."""
        for i, event in enumerate(events):
            try:
                self._handle_one(event)
            except StoreError:
                for kept in events[i:]:
                    self._events.put(kept)
                raise
            except Exception:
                if event.tries + 1 < _EVENT_TRIES:
                    logger.exception(
                        "celery-lease: %s event of task %s not handled yet (trying again)",
                        event.kind,
                        event.task_id,
                    )
                    self._events.put(dataclasses.replace(event, tries=event.tries + 1))
                else:
                    logger.exception(
                        "celery-lease: %s event of task %s not handled after %d tries: "
                        "the reaper decides once its lease expires",
                        event.kind,
                        event.task_id,
                        _EVENT_TRIES,
                    )
        self.reaper.publish_due()

    def _handle_one(self, event: Event) -> None:
        kind, task_id, reason = event.kind, event.task_id, event.reason
        inc = self.incarnation
        if kind == "lost":
            if self.outcomes is not None:
                # the child may have handed its outcome over just before it died
                self.outcomes.flush()
            if event.recoveries == self._fence_recoveries:
                # Kept while the database was away, or handled late, the event may come
                # after this task was recovered and claimed again by this very worker:
                # that next execution must not be cut short (the task would run twice).
                # Fenced by the attempt when the pool process knew it; otherwise (a
                # pool child killed, a hard time limit: the main process never learns
                # the attempt, and telling it would cost every task a message) by the
                # claim's age: only a claim made before the loss was seen, by the
                # database's clock (``started_at``), is the lost execution's.
                self.store.expire(
                    actor=inc.actor,
                    reason=reason,
                    task_ids=[task_id],
                    owners=[inc.id],
                    attempt=event.attempt,
                    claimed_before=event.seen_at if event.attempt is None else None,
                    only_expired=False,
                )
            else:
                # raised before the worker recovered from a self-fence (the event was
                # kept while the database was away): that recovery expired every lease
                # the worker held, this one with them, and the task may run again here
                # by now; expiring "its" RUNNING row would cut that next execution short
                logger.info(
                    "task %s: lost before worker %s recovered from its fence, which "
                    "expired that lease already",
                    task_id,
                    inc.nodename,
                )
            # a child lost before its claim leaves a PENDING row whose message is gone
            _publisher.publish(self.rt.app, self.store, self.store.take_pending([task_id]))
        elif kind == "revoked":
            try:
                # a revoke sent by the lease's own cancel keeps that request (who, why)
                self.store.request_cancel(
                    task_id, actor=inc.actor, reason=reason, keep_earlier=True
                )
            except Exception as error:
                logger.info("task %s: revoke not recorded: %s", task_id, error)

    def _watch_children(self) -> None:
        """Backstop for a pool child whose death the pool never reported.

        The pool reports a child that dies while it runs a task (``WorkerLostError``),
        which expires that lease at once. Should that report never come, the task's
        row would stay RUNNING under this worker's live heartbeat, and no TTL would
        ever expire it. So every round, the tasks this worker accepted are checked
        against their pool child: one whose child has been gone for
        ``UNREPORTED_LOSS_AFTER`` seconds (well past the pool's own checks) is handed
        to the lease as lost, once.
        """
        now = time.monotonic()
        me = os.getpid()
        gone: dict[Any, float] = {}
        for req in set(worker_state.active_requests):
            # a LeasedRequest (:mod:`.request`, which sits above this module)
            if not hasattr(req, "lease_lost") or req.task.app is not self.rt.app:
                continue
            pid = req.worker_pid
            if not isinstance(pid, int) or pid == me or not pid_gone(pid):
                continue
            since = gone[req] = self._gone_since.get(req, now)
            if now - since >= UNREPORTED_LOSS_AFTER:
                logger.error(
                    "task %s[%s]: its pool child (pid %s) exited %.0f s ago and the pool "
                    "did not report it; the lease decides now",
                    req.name,
                    req.id,
                    pid,
                    now - since,
                )
                req.lease_lost(
                    f"pool child (pid {pid}) lost while running the task (its exit was not "
                    "reported by the pool)"
                )
                del gone[req]
        self._gone_since = gone

    def _loop(self) -> None:
        cfg = self.rt.config
        next_sweep = time.monotonic() + cfg.reaper_interval
        lock_ttl = max(cfg.reaper_interval * 3, 1.0)
        watch_interval = min(cfg.reaper_interval, 1.0)
        next_watch = time.monotonic() + watch_interval
        reconcile_interval = cfg.heartbeat_interval * ROUND_EVERY
        next_reconcile = time.monotonic() + reconcile_interval
        while not self._stopping.is_set():
            events: list[Event] = []
            try:
                wake = min(next_sweep, next_watch, next_reconcile)
                events.append(self._events.get(timeout=max(0.0, wake - time.monotonic())))
                while True:
                    events.append(self._events.get_nowait())
            except queue.Empty:
                pass
            try:
                if events:
                    self._handle(events)
                if time.monotonic() >= next_watch:
                    next_watch = time.monotonic() + watch_interval
                    self._watch_children()
                    if self.agent is not None and self.agent.check():
                        self.agent.report_held()
                if time.monotonic() >= next_reconcile:
                    next_reconcile = time.monotonic() + reconcile_interval
                    if self.reconciler.round(self.outcomes, self.agent):
                        self.reaper.publish_due()
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + cfg.reaper_interval
                    if cfg.embedded_reaper and self.store.try_lock(
                        self.store.reaper_lock(), self.incarnation.id, lock_ttl
                    ):
                        self.reaper.sweep()
            except StoreError as error:
                # the fast-path events not handled yet are kept until the database answers
                logger.warning("celery-lease reaper: %s", error)
                self._stopping.wait(min(1.0, cfg.reaper_interval))
            except Exception:
                logger.exception("celery-lease reaper: unexpected error (continuing)")
                self._stopping.wait(min(1.0, cfg.reaper_interval))

    def _expire_own(self, reason: str) -> None:
        """Expire every lease this worker holds (its heartbeat lapsed past the TTL).
        Counted first: a lost-execution event raised before this point is covered by
        it and must not expire a later execution of the same task."""
        inc = self.incarnation
        self._fence_recoveries += 1
        self.store.expire(
            actor=inc.actor, reason=reason, owners=[inc.id], only_expired=False, limit=10_000
        )

    def shutdown(self, reason: str) -> None:
        """Claim no more, write the buffered outcomes, then mark the incarnation
        stopped; leases it still holds expire at once."""
        if self.agent is not None:
            self.agent.stop()
        if self.outcomes is not None:
            self.outcomes.close()
        self._stopping.set()
        # a sweep under way ends first (each of its store calls is bounded by
        # lease_db_timeout): a lease it expires is then due, and published below with
        # the rest, not left RETRY_WAIT for another worker's reaper
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.rt.config.db_timeout)
        self.heartbeat.stop()
        self.heartbeat.store.dispose()
        inc = self.incarnation
        try:
            self.store.stop_worker(inc.id, reason)
            leftover = self.store.expire(
                actor=inc.actor,
                reason=f"worker {inc.nodename} stopped ({reason}) while the task ran",
                owners=[inc.id],
                only_expired=False,
                limit=10_000,
            )
            self.reaper.publish_due()
            self.store.release_lock(self.store.reaper_lock(), inc.id)
            if leftover:
                logger.warning(
                    "worker %s: %d leases expired at shutdown", inc.nodename, len(leftover)
                )
        except StoreError as error:
            logger.error(
                "worker %s: could not record shutdown (%s): its leases expire after their TTL",
                inc.nodename,
                error,
            )


#: Start-up failures that say the database answered and refused us: waiting will not
#: help (libpq gives these without a SQLSTATE, so they are known by their text).
_REFUSED_AT_CONNECT = (
    "does not exist",
    "authentication failed",
    "no pg_hba.conf entry",
    "permission denied",
)


def start_service(rt: Runtime, nodename: str) -> WorkerService:
    """Start the worker's service, waiting for a database that cannot be reached yet.

    Like Celery's ``broker_connection_retry_on_startup``: a database restarting (or
    not up yet) when the worker starts is retried with backoff for up to
    ``lease_db_startup_timeout``; a configuration error (a bad URL, a missing driver,
    an out-of-date schema, a database or role that does not exist, a live worker under
    the same name) ends the start at once.
    """
    cfg = rt.config
    give_up = time.monotonic() + cfg.db_startup_timeout
    pause = 0.5
    while True:
        try:
            return WorkerService(rt, nodename)
        except StoreUnavailable as error:
            cause = str(error.__cause__ or "")
            if any(text in cause for text in _REFUSED_AT_CONNECT):
                raise StoreError(str(error)) from error
            left = give_up - time.monotonic()
            if not cfg.db_retry_on_startup or left <= 0:
                raise
            wait = min(pause, left)
            logger.warning(
                "celery-lease: worker %s: %s; retrying in %.1f s (giving up in %.0f s, "
                "lease_db_startup_timeout)",
                nodename,
                error,
                wait,
                left,
            )
            time.sleep(wait)
            pause = min(pause * 2, 10.0)


__all__ = ["UNREPORTED_LOSS_AFTER", "WorkerService", "services", "start_service"]
