"""Polling with a deadline: the one way the kit (and its users' tests) wait."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T | None],
    timeout: float = 10.0,
    interval: float = 0.05,
    message: str = "condition not met",
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Call ``predicate`` until it returns a truthy value, and return that value.

    Args:
        predicate: called again every ``interval`` seconds.
        timeout: seconds to wait before giving up.
        interval: seconds between calls.
        message: what was awaited, for the error.
        ignore: exceptions that count as "not yet"; any other propagates at once.

    Raises:
        AssertionError: ``timeout`` passed first; names ``message`` and the last value
            (or the last ignored exception).
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            value = predicate()
        except ignore as exc:
            last = exc
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{message} (waited {timeout:g} s; last value: {last!r})")
        time.sleep(interval)
