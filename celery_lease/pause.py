"""Durable pauses: a queue or a task name stops running until it is resumed.

``admin(app).pause(queue=...)`` / ``pause(task=...)`` (``celery lease pause``) write a
row that every worker reads at most once per ``lease_heartbeat_interval``:

- **A paused queue** is no longer consumed: each worker's main process cancels its
  consumer of that queue (Celery's ``Consumer.cancel_task_queue``, run in the
  consumer's own event loop) and adds it back on resume. A worker that starts while
  the queue is paused does not consume it at all. Its messages stay in the broker.
- **A paused task name** is not run: a delivery of it (one already prefetched, or
  one from a queue still consumed) is dropped before the claim, its row left PENDING
  and marked for publishing again; the reaper leaves such rows alone while the pause
  lasts and publishes them again once it ends. A delivery from a paused queue that
  was already prefetched is treated the same way.

Both survive worker restarts (they are rows in the database), and every pause and
resume is logged with who and why (``admin(app).pause_history()``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from .exceptions import StoreError
from .store import PAUSE_KINDS as KINDS
from .store import Pause, PauseEvent, Store

logger = logging.getLogger("celery_lease.pause")

__all__ = ["KINDS", "Pause", "PauseCache", "PauseEvent", "QueueWatcher"]


class PauseCache:
    """What is paused, read from the store at most once per ``interval`` seconds.

    Used by the process that runs tasks, before each claim. When the store does not
    answer, the last answer stands (a claim would fail the same way anyway)."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._lock = threading.Lock()
        self._read_at = float("-inf")
        self._tasks: dict[str, Pause] = {}
        self._queues: dict[str, Pause] = {}

    def _refresh(self, store: Store) -> None:
        now = time.monotonic()
        if now - self._read_at < self.interval:
            return
        with self._lock:
            if now - self._read_at < self.interval:
                return
            try:
                pauses = store.pauses()
            except StoreError as error:
                logger.debug("pauses not read: %s", error)
                return
            self._tasks = {p.target: p for p in pauses if p.kind == "task"}
            self._queues = {p.target: p for p in pauses if p.kind == "queue"}
            self._read_at = now

    def match(self, store: Store, name: str, queue: str | None) -> Pause | None:
        """The pause that holds a delivery of task ``name`` from ``queue``, if any."""
        self._refresh(store)
        found = self._tasks.get(name)
        if found is None and queue is not None:
            found = self._queues.get(queue)
        return found


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
