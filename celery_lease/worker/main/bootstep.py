"""Hooks into the Celery worker: bootstep, signals and the parent-side Request.

The worker's main process owns the incarnation row and renews it (heartbeat
thread), runs the embedded reaper (its own thread, behind a database lock), and
sees pool children die or hit hard time limits, which expires their leases at once.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
import uuid
from typing import Any

from celery import Celery, bootsteps, signals
from celery.exceptions import Terminated, TimeLimitExceeded, WorkerLostError
from celery.worker import state as worker_state
from celery.worker.request import Request
from celery.worker.state import task_ready

from ..._apps import AppRegistry
from ..._runtime import BEAT_ENTRY, Incarnation, Runtime, install, runtime
from ...exceptions import CeleryLeaseError, ConfigurationError, StoreError, StoreUnavailable
from ...producer import publisher as _publisher
from ...reaper import Reaper
from ...store import Store
from ..pool.execution import StoreDownDuringTask
from . import claimer as _claimer
from . import stores as _stores  # noqa: F401  (registers the lease_store remote-control command)
from .heartbeat import Heartbeat, renewal_config
from .node_names import dead_predecessors, pid_gone
from .outcome_writer import OutcomeWriter, writer_config
from .pause_watcher import consumer_controls, watch_paused_queues

logger = logging.getLogger("celery_lease.worker")

#: The service of each app's worker main process (none in its pool children's use).
_services: AppRegistry[WorkerService] = AppRegistry()
#: Serializes a service started on first use in an in-process worker (its threads).
_start_lock = threading.Lock()

#: An event for the service thread: (kind, task id, reason, tries so far).
Event = tuple[str, str, str, int]
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
        #: Claims ahead in batches (``lease_claim_ahead``), started with the worker.
        self.claimer: _claimer.Claimer | None = None
        self._events: queue.Queue[Event] = queue.Queue()
        self._gone_since: dict[LeasedRequest, float] = {}
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

    def child_lost(self, task_id: str, reason: str) -> None:
        """A pool child died or hit its hard time limit while running ``task_id``."""
        self._events.put(("lost", task_id, reason, 0))

    def revoked(self, task_id: str, reason: str) -> None:
        """The worker discarded ``task_id`` (revoked or expired) before running it."""
        self._events.put(("revoked", task_id, reason, 0))

    def _handle(self, events: list[Event]) -> None:
        """Handle the events in order. A database error stops at the event it hit:
        that one and the rest are kept for the next round, the ones handled before it
        are not (handled again, a lost child's event would expire the task's next
        execution). Any other error is logged and the event kept for a few rounds."""
        for i, event in enumerate(events):
            try:
                self._handle_one(event)
            except StoreError:
                for kept in events[i:]:
                    self._events.put(kept)
                raise
            except Exception:
                kind, task_id, reason, tries = event
                if tries + 1 < _EVENT_TRIES:
                    logger.exception(
                        "celery-lease: %s event of task %s not handled yet (trying again)",
                        kind,
                        task_id,
                    )
                    self._events.put((kind, task_id, reason, tries + 1))
                else:
                    logger.exception(
                        "celery-lease: %s event of task %s not handled after %d tries: "
                        "the reaper decides once its lease expires",
                        kind,
                        task_id,
                        _EVENT_TRIES,
                    )
        self.reaper.publish_due()

    def _handle_one(self, event: Event) -> None:
        kind, task_id, reason, _ = event
        inc = self.incarnation
        if kind == "lost":
            if self.outcomes is not None:
                # the child may have handed its outcome over just before it died
                self.outcomes.flush()
            self.store.expire(
                actor=inc.actor,
                reason=reason,
                task_ids=[task_id],
                owners=[inc.id],
                only_expired=False,
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
        gone: dict[LeasedRequest, float] = {}
        for req in set(worker_state.active_requests):
            if not isinstance(req, LeasedRequest) or req.task.app is not self.rt.app:
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
        while not self._stopping.is_set():
            events: list[Event] = []
            try:
                wake = min(next_sweep, next_watch)
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
        inc = self.incarnation
        self.store.expire(
            actor=inc.actor, reason=reason, owners=[inc.id], only_expired=False, limit=10_000
        )

    def shutdown(self, reason: str) -> None:
        """Claim no more, write the buffered outcomes, then mark the incarnation
        stopped; leases it still holds expire at once."""
        if self.claimer is not None:
            self.claimer.stop()
        if self.outcomes is not None:
            self.outcomes.close()
        self._stopping.set()
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


def _start_service(rt: Runtime, nodename: str) -> WorkerService:
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


def start_in_process(rt: Runtime, nodename: str | None) -> Incarnation | None:
    """Start the worker service inside a worker whose bootstep never ran: an in-process
    worker (solo or threads pool) started before a leased task was bound to its app,
    such as ``celery.contrib.pytest``'s ``celery_worker`` with the task defined in the
    test. ``None`` in a prefork child or outside a worker."""
    from billiard.process import current_process

    # a prefork pool child is a billiard Process; the solo and threads pools run in
    # the worker's main process, which billiard calls "MainProcess"
    if not nodename or current_process().name != "MainProcess":
        return None
    with _start_lock:
        if rt.app not in _services:
            service = _start_service(rt, nodename)
            service.start()
            _services[rt.app] = service
    return rt.incarnation


class LeaseStep(bootsteps.StartStopStep):
    """Worker bootstep: register the incarnation before the pool forks, then start the
    heartbeat and embedded reaper threads. Shutdown is handled on ``worker_shutdown``,
    which is sent after the pool has drained (a warm shutdown keeps renewing until then)."""

    label = "celery-lease"

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        try:
            service = _start_service(runtime(worker.app), worker.hostname)
        except CeleryLeaseError as error:
            # refuse to start rather than run tasks without leases
            logger.critical("celery-lease: worker %s cannot start: %s", worker.hostname, error)
            raise SystemExit(78) from error  # EX_CONFIG
        self.service = _services[worker.app] = service
        self.watcher = watch_paused_queues(runtime(worker.app), worker)

    def start(self, worker: Any) -> None:
        self.service.start()
        inc = self.service.incarnation
        self.service.claimer = _claimer.start_for(worker, self.service.rt, inc)
        self.watcher.start(*consumer_controls(worker), fenced=lambda: inc.flags.fenced)

    def stop(self, worker: Any) -> None:
        self.watcher.stop()

    def terminate(self, worker: Any) -> None:
        """Cold shutdown. Celery sends no ``worker_shutdown`` then (only a warm shutdown
        does), so record it here: the incarnation is marked stopped and the leases it
        holds expire at once, before the pool kills the children running them."""
        _shutdown(worker.app, "cold shutdown")


def _shutdown(app: Celery, reason: str) -> None:
    service = _services.pop(app, None)
    if service is not None and runtime(app).incarnation is not None:
        service.shutdown(reason)


@signals.worker_shutdown.connect(weak=False)
def _on_worker_shutdown(sender: Any = None, **kwargs: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None:
        return
    _shutdown(app, "shutdown")


@signals.task_revoked.connect(weak=False)
def _on_task_revoked(
    sender: Any = None,
    request: Any = None,
    terminated: bool = False,
    expired: bool = False,
    **kwargs: Any,
) -> None:
    task = sender
    if request is None or not getattr(task, "Request", "").startswith("celery_lease."):
        return
    service = _services.get(task.app)
    if service is None:
        return
    if terminated:
        # recorded as a cancel request before the child's death is handled as a lost
        # child (same queue, in order): the expiry then ends CANCELLED, not a retry
        reason = "revoked with terminate"
    elif expired:
        reason = "expired before it ran (its expires option passed)"
    else:
        reason = "revoked before it ran"
    service.revoked(request.id, reason)
    if service.claimer is not None:
        service.claimer.dropped(request.id, reason)  # after the cancel request: same queue


_lost_lock = threading.Lock()


class LeasedRequest(Request):
    """Request seen by the worker's main process: expires the lease at once when the
    pool child running it dies or hits its hard time limit (no TTL wait).

    Those deaths are the lease's to decide (retry, or a person), so Celery's own
    handling, which would report FAILURE (result backend, ``task-failed`` event,
    ``link_error``, a chord's error) for a task that then runs again, is skipped:
    callers see the lease's state until the row's final one.
    """

    def _service(self) -> WorkerService | None:
        return _services.get(self.task.app)

    def lease_lost(self, reason: str) -> bool:
        """Tell the lease, once per request, that its execution is lost (the pool's
        report and the service's backstop may both see it): ``False`` if told before.
        Told twice, the second expiry could hit the task's next execution."""
        with _lost_lock:
            if getattr(self, "_lease_told", False):
                return False
            self._lease_told = True
        task_ready(self)
        service = self._service()
        if service is not None:
            service.child_lost(self.id, reason)
        return True

    def _lease_decides(self, reason: str, *, worker_lost: bool = False) -> None:
        """Hand a lost execution to the lease: the lease is expired at once by the main
        process, which then re-publishes the row if the policy retries it. The message
        is acknowledged, or requeued as Celery would (``reject_on_worker_lost``): a
        redelivery is dropped at claim unless the row is waiting for it."""
        if self.task.acks_late and not self.acknowledged:
            if worker_lost and self.task.reject_on_worker_lost:
                self.reject(requeue=True)
            else:
                self.acknowledge()
        self.lease_lost(reason)

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> Any:
        exc = exc_info.exception
        exc = getattr(exc, "exc", exc)  # billiard's ExceptionWithTraceback wrapper
        lost = None
        if self._service() is None:
            pass  # not a leased worker (the bootstep is not running): Celery decides
        elif isinstance(exc, WorkerLostError):
            lost = f"pool child lost while running the task: {exc}"
        elif isinstance(exc, TimeLimitExceeded):
            lost = f"hard time limit exceeded: {exc}"
        elif isinstance(exc, (SystemExit, KeyboardInterrupt)) and not (
            getattr(self, "_already_cancelled", False) or getattr(self, "_already_revoked", False)
        ):
            lost = f"pool child terminated while running the task: {exc!r}"
        else:
            why = None
            if isinstance(exc, Terminated):
                # revoked with terminate: Celery reports REVOKED; the cancel request was
                # recorded first (same queue, in order), so the expiry ends CANCELLED
                why = f"pool child terminated while running the task: {exc!r}"
            elif isinstance(exc, (StoreError, StoreDownDuringTask)) or isinstance(
                getattr(exc, "reason", None), StoreError
            ):
                # the execution stopped on a database error: its lease must not outlive
                # it (the heartbeat is alive), and a claim that failed left its message
                # consumed: expire / re-publish at once, retried until the database answers
                why = f"lease store unavailable while the task ran: {getattr(exc, 'reason', exc)}"
            if why is not None:
                try:
                    return super().on_failure(
                        exc_info, send_failed_event=send_failed_event, return_ok=return_ok
                    )
                finally:
                    self.lease_lost(why)
        if lost is not None:
            return self._lease_decides(lost, worker_lost=not isinstance(exc, TimeLimitExceeded))
        return super().on_failure(
            exc_info, send_failed_event=send_failed_event, return_ok=return_ok
        )

    def on_timeout(self, soft: bool, timeout: float) -> Any:
        if soft or self._service() is None:
            return super().on_timeout(soft, timeout)
        logger.error(
            "task %s[%s]: hard time limit (%s s) exceeded; the lease decides what happens next",
            self.name,
            self.id,
            timeout,
        )
        return self._lease_decides(
            f"hard time limit of {timeout} s exceeded: the pool child was killed"
        )


__all__ = ["BEAT_ENTRY", "LeaseStep", "LeasedRequest", "WorkerService", "install"]
