"""Durable pauses: a queue or a task name stops running until it is resumed.

``admin(app).pause(queue=...)`` / ``pause(task=...)`` (``celery lease pause``) write a
row that every worker reads at most once per ``lease_heartbeat_interval``:

- **A paused queue** is no longer consumed: each worker's main process cancels its
  consumer of that queue (Celery's ``Consumer.cancel_task_queue``, run in the
  consumer's own event loop: :mod:`celery_lease.worker.main.pause_watcher`) and adds
  it back on resume. A worker that starts while the queue is paused does not consume
  it at all. Its messages stay in the broker.
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

from .exceptions import StoreError
from .store import PAUSE_KINDS as KINDS
from .store import Pause, PauseEvent, Store

logger = logging.getLogger("celery_lease.pause")

__all__ = ["KINDS", "Pause", "PauseCache", "PauseEvent"]


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
