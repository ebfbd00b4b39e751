"""Pure decisions the reaper and workers apply (no I/O)."""

from __future__ import annotations

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
