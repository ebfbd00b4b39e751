"""Recording "published" off the producer's hot path.

After a producer hands a message to the broker it records ``published_at`` on the
row, so that the reaper does not publish it again after ``lease_publish_grace``. That
record is bookkeeping, not a decision: a row left unmarked is re-published by the
reaper and the extra message is dropped at claim (the row is no longer PENDING, or its
claim refuses a second copy). So instead of one statement per task, the ids wait here
and are recorded in bulk: inside the process's next submit statement (no round trip
of its own), or by a background thread once the oldest id has waited ``delay``, when
``batch`` ids are waiting, and at interpreter exit. A producer that dies leaves at
most these few rows unmarked.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence

from ..exceptions import StoreError

logger = logging.getLogger("celery_lease.store")

_LIVE: weakref.WeakSet[PublishedMarks] = weakref.WeakSet()


class PublishedMarks:
    """The ids of one store whose messages were published but not yet recorded."""

    def __init__(
        self, record: Callable[[Sequence[str]], None], *, delay: float = 0.005, batch: int = 500
    ) -> None:
        self._record = record
        self.delay = delay
        self.batch = batch
        self._reset()
        _LIVE.add(self)
        ref = weakref.ref(self)

        def after_fork() -> None:
            marks = ref()
            if marks is not None:
                marks._reset()  # the parent records its own ids; the child starts empty

        os.register_at_fork(after_in_child=after_fork)

    def _reset(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._ids: list[str] = []
        self._since = 0.0
        self._thread: threading.Thread | None = None
        #: Held while ids taken by :meth:`flush` are being recorded: a flush at exit
        #: waits for the background thread's, or the interpreter would end it midway.
        self._flushing = threading.Lock()

    def add(self, task_id: str) -> None:
        """Record ``task_id`` as published soon."""
        with self._cond:
            if not self._ids:
                self._since = time.monotonic()
                self._cond.notify()
            self._ids.append(task_id)
            if len(self._ids) >= self.batch:
                self._cond.notify()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="celery-lease-published", daemon=True
                )
                self._thread.start()

    def take(self) -> list[str]:
        """Every waiting id, for the caller to record in a statement it sends anyway."""
        with self._cond:
            ids, self._ids = self._ids, []
        return ids

    def put_back(self, ids: Sequence[str]) -> None:
        """Ids taken with :meth:`take` whose statement failed."""
        if not ids:
            return
        with self._cond:
            if not self._ids:
                self._since = time.monotonic()
                self._cond.notify()
            self._ids[:0] = ids

    def flush(self) -> None:
        """Record every waiting id now (after any flush already under way)."""
        with self._flushing:
            ids = self.take()
            if not ids:
                return
            try:
                self._record(ids)
            except StoreError as error:
                # harmless: re-published after lease_publish_grace, dropped at claim
                logger.warning(
                    "celery-lease: could not mark %d rows published: %s", len(ids), error
                )

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._ids:
                    self._cond.wait()
                wait = self._since + self.delay - time.monotonic()
                if wait > 0 and len(self._ids) < self.batch:
                    self._cond.wait(wait)
                    continue
            self.flush()


@atexit.register
def _flush_all() -> None:
    for marks in list(_LIVE):
        marks.flush()
