"""Stalls of a test process, noted for the report of a test that fails.

A store call is cut off at its deadline (``lease_db_timeout``). When one fails in CI,
the question is who stalled: the database (its log, see ``pg_log_since`` in
``conftest.py``), or the test process itself. :class:`StallWatch` answers the second:
it times the process's garbage collections (``gc.callbacks``), and a thread of its own
asks to wake every :data:`PERIOD` and notes how late it woke (a collection, a C call
that holds the GIL, or the whole machine not running this process all make it late).
Only what lasts :data:`NOTED` or more is noted.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

#: How often the watching thread asks to wake (seconds).
PERIOD = 0.1
#: A collection or a late wake this long is noted (seconds).
NOTED = 1.0


class StallWatch:
    def __init__(self) -> None:
        #: The test running now (its node id), named in what is noted.
        self.current = "(between tests)"
        #: (wall-clock time, what, seconds, test): everything noted so far.
        self.noted: list[tuple[float, str, float, str]] = []
        self._gc_started = 0.0
        self._started = False

    def start(self) -> StallWatch:
        if not self._started:
            self._started = True
            gc.callbacks.append(self._gc)
            threading.Thread(target=self._run, name="test-stall-watch", daemon=True).start()
        return self

    def _gc(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._gc_started = now
        elif self._gc_started and now - self._gc_started >= NOTED:
            generation = info.get("generation")
            self._note(f"garbage collection of generation {generation}", now - self._gc_started)

    def _run(self) -> None:
        while True:
            before = time.monotonic()
            time.sleep(PERIOD)
            late = time.monotonic() - before - PERIOD
            if late >= NOTED:
                self._note("this process did not run (its stall watch woke late)", late)

    def _note(self, what: str, seconds: float) -> None:
        self.noted.append((time.time() - seconds, what, seconds, self.current))

    def since(self, index: int) -> list[str]:
        """What was noted after the first ``index`` notes, as lines."""
        return [describe(n) for n in self.noted[index:]]


def describe(noted: tuple[float, str, float, str] | list[Any]) -> str:
    at, what, seconds, test = noted
    stamp = time.strftime("%H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1000):03d} UTC"
    return f"{stamp}: {what} for {seconds:.1f} s, during {test}"


#: This process's watch (each xdist worker has its own).
WATCH = StallWatch()
