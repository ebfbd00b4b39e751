"""Pure decisions the reaper and workers apply (no I/O)."""

from __future__ import annotations

import random

from .states import State


def after_timeout(
    *,
    on_timeout: str,
    recoveries: int,
    max_recoveries: int,
    age: float,
    max_age: float | None,
    inflight_step: str | None,
    cancel_requested: bool = False,
) -> tuple[State, str]:
    """What a TIMEOUT row becomes: RETRY_WAIT when known safe, CANCELLED when a cancel
    was requested, else WAIT_MANUAL with a reason.

    ``recoveries`` already counts the expiry being decided.
    """
    if inflight_step is not None:
        return State.WAIT_MANUAL, (
            f"outcome of step {inflight_step!r} unknown: it started, and its end was never recorded"
        )
    if cancel_requested:
        return State.CANCELLED, "cancel requested and the execution stopped"
    if on_timeout == "manual":
        return State.WAIT_MANUAL, "lease expired and the task's on_timeout is 'manual'"
    if recoveries > max_recoveries:
        return (
            State.WAIT_MANUAL,
            f"poison task: lease expired {recoveries} times, more than max_recoveries "
            f"({max_recoveries}) allows",
        )
    if max_age is not None and age > max_age:
        return (
            State.WAIT_MANUAL,
            f"too old to recover automatically: submitted {age:.0f} s ago, over the max age "
            f"of {max_age:.0f} s",
        )
    return State.RETRY_WAIT, "lease expired: safe to retry, no step's outcome is unknown"


def retry_delay(
    *,
    retries: int,
    countdown: float | None,
    default_delay: float,
    backoff: bool | float,
    backoff_max: float,
    jitter: bool,
    rng: random.Random | None = None,
) -> float:
    """Seconds to wait before retry number ``retries + 1``.

    An explicit ``countdown`` wins; with ``retry_backoff`` the delay grows as
    ``factor * 2**retries`` capped at ``retry_backoff_max``, with full jitter
    when ``retry_jitter`` is set (Celery's own semantics); otherwise
    ``default_retry_delay``.
    """
    if countdown is not None:
        return max(0.0, float(countdown))
    if backoff:
        factor = 1.0 if backoff is True else float(backoff)
        delay: float = min(float(backoff_max), factor * float(2**retries))
        if jitter:
            delay = float((rng or random).uniform(0, delay))
        return max(0.0, delay)
    return max(0.0, float(default_delay))
