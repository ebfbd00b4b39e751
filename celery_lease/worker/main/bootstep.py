"""The worker bootstep and the worker signals celery-lease answers.

The bootstep starts the worker's service (:mod:`.service`) and forks its lease agent
(:mod:`.agent`) before the pool forks, and starts the service's threads and the pause
watcher once the worker starts; a cold shutdown, and Celery's ``worker_shutdown`` after
a warm one, stop it. An in-process worker whose bootstep never ran starts the service on
its first delivery.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import Celery, bootsteps, signals

from ..._runtime import BEAT_ENTRY, Incarnation, Runtime, install, runtime
from ...exceptions import CeleryLeaseError
from . import agent as _agent
from . import stores as _stores  # noqa: F401  (registers the lease_store remote-control command)
from .pause_watcher import consumer_controls, watch_paused_queues
from .service import WorkerService, services, start_service

logger = logging.getLogger("celery_lease.worker")

#: Serializes a service started on first use in an in-process worker (its threads).
_start_lock = threading.Lock()


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
        if rt.app not in services:
            service = start_service(rt, nodename)
            service.start()
            services[rt.app] = service
    return rt.incarnation


class LeaseStep(bootsteps.StartStopStep):
    """Worker bootstep: register the incarnation before the pool forks, then start the
    heartbeat and embedded reaper threads. Shutdown is handled on ``worker_shutdown``,
    which is sent after the pool has drained (a warm shutdown keeps renewing until then)."""

    label = "celery-lease"

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        try:
            service = start_service(runtime(worker.app), worker.hostname)
        except CeleryLeaseError as error:
            # refuse to start rather than run tasks without leases
            logger.critical("celery-lease: worker %s cannot start: %s", worker.hostname, error)
            raise SystemExit(78) from error  # EX_CONFIG
        self.service = services[worker.app] = service
        # forked before the pool: the pool processes inherit its address
        try:
            service.agent = _agent.LeaseAgent(
                service.rt, service.incarnation, worker.concurrency or 1
            )
        except OSError as error:
            logger.warning(
                "celery-lease: worker %s: no lease agent (%s): each pool process claims "
                "its deliveries itself",
                worker.hostname,
                error,
            )
        self.watcher = watch_paused_queues(runtime(worker.app), worker)

    def start(self, worker: Any) -> None:
        self.service.start()
        inc = self.service.incarnation
        if self.service.agent is not None:
            _agent.start_for(worker, self.service.agent)
        self.watcher.start(*consumer_controls(worker), fenced=lambda: inc.flags.fenced)

    def stop(self, worker: Any) -> None:
        self.watcher.stop()

    def terminate(self, worker: Any) -> None:
        """Cold shutdown. Celery sends no ``worker_shutdown`` then (only a warm shutdown
        does), so record it here: the incarnation is marked stopped and the leases it
        holds expire at once, before the pool kills the children running them."""
        _shutdown(worker.app, "cold shutdown")


def _shutdown(app: Celery, reason: str) -> None:
    service = services.pop(app, None)
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
    service = services.get(task.app)
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
    if service.agent is not None:
        service.agent.dropped(request.id, reason)


__all__ = ["BEAT_ENTRY", "LeaseStep", "WorkerService", "install", "start_in_process"]
