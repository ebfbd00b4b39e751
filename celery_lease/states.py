"""Task states and the one transition table.

Every state change the library makes is checked against :data:`TRANSITIONS`
before it is written. The table mirrors the design contract: a pair missing
here cannot happen, whoever asks for it.
"""

from __future__ import annotations

import enum


class State(str, enum.Enum):
    """Lifecycle state of a leased task (stored as its name)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    RETRY_WAIT = "RETRY_WAIT"
    TIMEOUT = "TIMEOUT"
    WAIT_MANUAL = "WAIT_MANUAL"
    CANCELLED = "CANCELLED"

    def __str__(self) -> str:
        return self.value


#: States that never change again; a redelivered message for them is dropped.
TERMINAL: frozenset[State] = frozenset({State.SUCCEEDED, State.CANCELLED})

#: States an operator may cancel directly (RUNNING is cancelled cooperatively).
CANCELLABLE: frozenset[State] = frozenset(
    {State.PENDING, State.RETRY_WAIT, State.TIMEOUT, State.WAIT_MANUAL, State.FAILED}
)

#: States an operator may send back to PENDING.
RETRYABLE: frozenset[State] = frozenset({State.WAIT_MANUAL, State.FAILED, State.TIMEOUT})

#: A recorded step's state: STARTED until its call returned (then its outcome is
#: unknown to a re-run), DONE once its result is stored.
STEP_STARTED = "STARTED"
STEP_DONE = "DONE"

_S = State

#: (from, to) -> who may make that change. ``None`` as *from* is the row's creation.
TRANSITIONS: dict[tuple[State | None, State], str] = {
    (None, _S.PENDING): "producer submits (or a worker adopts a message without a row)",
    (_S.PENDING, _S.RUNNING): "worker claim: compare-and-set, attempt += 1",
    (_S.PENDING, _S.CANCELLED): "operator cancel",
    (_S.RETRY_WAIT, _S.CANCELLED): "operator cancel",
    (_S.TIMEOUT, _S.CANCELLED): "operator cancel",
    (_S.WAIT_MANUAL, _S.CANCELLED): "operator cancel",
    (_S.FAILED, _S.CANCELLED): "operator cancel",
    (_S.RUNNING, _S.SUCCEEDED): "task outcome (fenced by attempt)",
    (_S.RUNNING, _S.FAILED): "task outcome (fenced by attempt)",
    (_S.RUNNING, _S.RETRY_WAIT): "retryable error or self.retry()",
    (_S.RUNNING, _S.CANCELLED): "cooperative cancel acknowledged by the task",
    (_S.RUNNING, _S.TIMEOUT): "reaper or worker: lease expired",
    (_S.RUNNING, _S.WAIT_MANUAL): "reaper: over max_runtime; policy on failure",
    (_S.TIMEOUT, _S.RETRY_WAIT): "policy: safe to retry",
    (_S.TIMEOUT, _S.WAIT_MANUAL): "policy: unsafe or poison",
    (_S.RETRY_WAIT, _S.PENDING): "due: re-published",
    (_S.WAIT_MANUAL, _S.PENDING): "operator retry",
    (_S.FAILED, _S.PENDING): "operator retry",
    (_S.TIMEOUT, _S.PENDING): "operator retry",
    (_S.WAIT_MANUAL, _S.FAILED): "operator fail, or the still-running owner finishing",
    (_S.WAIT_MANUAL, _S.SUCCEEDED): "operator resolve, or the still-running owner finishing",
}


def is_legal(from_state: State | None, to_state: State) -> bool:
    """Whether the transition table allows ``from_state -> to_state``."""
    return (from_state, to_state) in TRANSITIONS


def check(from_state: State | None, to_state: State, task_id: str | None = None) -> None:
    """Raise :class:`~celery_lease.IllegalTransition` unless the table allows the change."""
    if not is_legal(from_state, to_state):
        from .exceptions import IllegalTransition

        raise IllegalTransition(task_id, from_state, to_state)
