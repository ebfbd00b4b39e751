"""The polling helper every timing-dependent test relies on."""

from __future__ import annotations

import itertools
import time

import pytest

from ..helpers import wait_until


def test_returns_the_first_truthy_value():
    counter = itertools.count()
    assert wait_until(lambda: next(counter) >= 3 and "done", interval=0.001) == "done"


def test_raises_with_the_message_and_the_last_value_at_the_deadline():
    values = iter(range(1000))
    started = time.monotonic()
    with pytest.raises(AssertionError) as info:
        wait_until(
            lambda: [] if next(values) < 10**6 else True,
            timeout=0.2,
            interval=0.01,
            message="queue drained",
        )
    assert time.monotonic() - started >= 0.2
    assert "queue drained" in str(info.value) and "last value: []" in str(info.value)


def test_ignored_exceptions_count_as_not_yet():
    calls = itertools.count()

    def flaky() -> bool:
        if next(calls) < 3:
            raise ConnectionError("not up yet")
        return True

    assert wait_until(flaky, interval=0.001, ignore=(ConnectionError,)) is True
    with pytest.raises(AssertionError, match="ConnectionError"):
        wait_until(
            lambda: (_ for _ in ()).throw(ConnectionError("down")),
            timeout=0.05,
            ignore=(ConnectionError,),
        )


def test_other_exceptions_propagate_at_once():
    with pytest.raises(KeyError):
        wait_until(lambda: {}["missing"], timeout=5)
