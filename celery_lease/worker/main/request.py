"""The request of a leased task as the worker's main process sees it.

A pool child that dies, or hits its hard time limit, while it runs a leased task is
reported to its request in the main process; :class:`LeasedRequest` hands that loss to
the worker's service, which expires the lease at once (no TTL wait).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery.exceptions import Terminated, TimeLimitExceeded, WorkerLostError
from celery.worker.request import Request
from celery.worker.state import task_ready

from ...exceptions import StoreError
from ..pool.execution import StoreDownDuringTask
from .service import WorkerService, services

logger = logging.getLogger("celery_lease.worker")


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
        return services.get(self.task.app)

    def lease_lost(self, reason: str, attempt: int | None = None) -> bool:
        """Tell the lease, once per request, that its execution is lost (the pool's
        report and the service's backstop may both see it): ``False`` if told before.
        Told twice, the second expiry could hit the task's next execution.
        ``attempt``: the attempt the execution had claimed, when the pool process said."""
        with _lost_lock:
            if getattr(self, "_lease_told", False):
                return False
            self._lease_told = True
        task_ready(self)
        service = self._service()
        if service is not None:
            service.child_lost(self.id, reason, attempt)
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
            why, attempt = None, None
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
                attempt = getattr(exc, "attempt", None)
            if why is not None:
                try:
                    return super().on_failure(
                        exc_info, send_failed_event=send_failed_event, return_ok=return_ok
                    )
                finally:
                    self.lease_lost(why, attempt)
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


__all__ = ["LeasedRequest"]
