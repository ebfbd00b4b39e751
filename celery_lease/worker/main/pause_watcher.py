"""Paused queues as a worker's main process follows them: its consumers of a paused
queue are cancelled, and added back on resume (see :mod:`celery_lease.pause`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from ..._runtime import Runtime
from ...exceptions import StoreError
from ...store import Store

logger = logging.getLogger("celery_lease.pause")
#: The worker's own logger, for what it does at start.
worker_logger = logging.getLogger("celery_lease.worker")


class QueueWatcher:
    """In a worker's main process: follow the paused queues among those the worker
    consumes, cancelling and adding back its consumers (a thread of its own).

    It also stops every consumer while the worker is self-fenced (its heartbeat not
    renewed for a TTL) and adds them back once the heartbeat is restored: a fenced
    worker would only take deliveries to drop them, each drop putting the row's next
    publication further out, while healthy workers could run them.
    """

    def __init__(
        self,
        store: Store,
        interval: float,
        queues: Iterable[str],
    ) -> None:
        self.store = store
        self.interval = interval
        #: The queues this worker was started to consume (only those are added back).
        self.queues = frozenset(queues)
        self._cancel: Callable[[str], None] | None = None
        self._add: Callable[[str], None] | None = None
        self.paused: set[str] = set()
        #: Whether every consumer is stopped because the worker is self-fenced.
        self.fenced = False
        self._is_fenced: Callable[[], bool] = lambda: False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="celery-lease-pauses", daemon=True)

    def paused_now(self) -> set[str]:
        """Which of this worker's queues are paused now (raises StoreError)."""
        return {p.target for p in self.store.pauses() if p.kind == "queue"} & self.queues

    def apply(self, paused: set[str]) -> None:
        """Cancel consumers of newly paused queues, add back resumed ones (while fenced
        only the record changes: no queue is consumed then)."""
        assert self._cancel is not None and self._add is not None, "start() first"
        for queue in sorted(paused - self.paused):
            logger.warning("celery-lease: queue %s is paused: no longer consumed", queue)
            if not self.fenced:
                self._cancel(queue)
        for queue in sorted(self.paused - paused):
            logger.warning("celery-lease: queue %s was resumed: consumed again", queue)
            if not self.fenced:
                self._add(queue)
        self.paused = set(paused)

    def fence(self, fenced: bool) -> None:
        """Stop every consumer of a queue not paused when the worker self-fences; add
        them back when its heartbeat is restored."""
        assert self._cancel is not None and self._add is not None, "start() first"
        if fenced == self.fenced:
            return
        self.fenced = fenced
        if fenced:
            logger.error(
                "celery-lease: worker self-fenced: no queue consumed until its heartbeat "
                "is restored"
            )
        else:
            logger.warning("celery-lease: heartbeat restored: queues consumed again")
        for queue in sorted(self.queues - self.paused):
            (self._cancel if fenced else self._add)(queue)

    def start(
        self,
        cancel: Callable[[str], None],
        add: Callable[[str], None],
        *,
        fenced: Callable[[], bool] | None = None,
    ) -> None:
        """Follow the pauses, cancelling (``cancel(queue)``) and adding back
        (``add(queue)``) this worker's consumers of the queues concerned; with
        ``fenced`` (the worker's fence flag), all of them while it is raised."""
        self._cancel, self._add = cancel, add
        if fenced is not None:
            self._is_fenced = fenced
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                # the fence first: a fenced worker's database is often unreachable
                self.fence(self._is_fenced())
                self.apply(self.paused_now())
            except StoreError as error:
                logger.info("celery-lease: pauses not read (%s): queues left as they are", error)
            except Exception:
                logger.exception("celery-lease: following paused queues failed (continuing)")


def consumer_controls(worker: Any) -> tuple[Callable[[str], None], Callable[[str], None]]:
    """``(cancel, add)`` for ``worker``'s task consumer, each run inside the consumer's
    own event loop: through the hub when the pool has one (prefork, the default), else
    as a remote-control command addressed to this worker only (its consumer runs
    those in its loop too)."""
    consumer = worker.consumer
    hub = getattr(worker, "hub", None)
    if hub is not None:

        def cancel(queue: str) -> None:
            hub.call_soon(consumer.cancel_task_queue, queue)

        def add(queue: str) -> None:
            hub.call_soon(consumer.add_task_queue, queue)

        return cancel, add
    control = worker.app.control
    destination = [worker.hostname]

    def cancel_remote(queue: str) -> None:
        control.cancel_consumer(queue, destination=destination)

    def add_remote(queue: str) -> None:
        control.add_consumer(queue, destination=destination)

    return cancel_remote, add_remote


def watch_paused_queues(rt: Runtime, worker: Any) -> QueueWatcher:
    """Before the consumer starts: leave out the queues paused now (a worker started
    during a pause does not consume them), and follow pauses from then on."""
    queues = worker.app.amqp.queues
    names = list(queues.consume_from)
    watcher = QueueWatcher(rt.store, rt.config.heartbeat_interval, names)
    try:
        paused = watcher.paused_now()
    except StoreError as error:
        worker_logger.warning("celery-lease: paused queues not read at start (%s)", error)
        paused = set()
    if paused:
        queues.deselect(sorted(paused))
        worker_logger.warning(
            "celery-lease: worker %s starts without the paused queues %s",
            worker.hostname,
            ", ".join(sorted(paused)),
        )
    watcher.paused = paused
    return watcher


__all__ = ["QueueWatcher", "consumer_controls", "watch_paused_queues"]
