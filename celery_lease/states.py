"""Task states and the one transition table.

Every state change the library makes is checked against :data:`RULES` (seen as
:data:`TRANSITIONS`) before it is written. The table mirrors the design contract:
a pair missing here cannot happen, whoever asks for it. Each entry says who may
make the change; every list of who may do what (what an operator may cancel or
retry, the sources of a task's own outcome, the operator actions offered by the
CLI and the Django admin, what Celery reports by itself) is derived from it.
"""

from __future__ import annotations

import dataclasses
import enum

from ._state import State
from .exceptions import IllegalTransition

#: States that never change again; a redelivered message for them is dropped.
TERMINAL: frozenset[State] = frozenset({State.SUCCEEDED, State.CANCELLED})

#: A recorded step's state: STARTED until its call returned (then its outcome is
#: unknown to a re-run), DONE once its result is stored.
STEP_STARTED = "STARTED"
STEP_DONE = "DONE"


class Actor(str, enum.Enum):
    """Who takes a transition (a role, not the audit row's actor string)."""

    #: The code that submits a task (``apply_async``, the outboxes).
    PRODUCER = "producer"
    #: A worker's own machinery: the claim, adopting a message, a child's death.
    WORKER = "worker"
    #: The task's execution reporting its own outcome (fenced by attempt and token).
    TASK = "task"
    #: The reaper's sweeps: expiry, overrun, due retries.
    REAPER = "reaper"
    #: A person, through the operator API (``admin(app)``, the CLI, the Django admin).
    OPERATOR = "operator"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class Rule:
    """One entry of the transition table: who may take it, and why it exists."""

    #: Who may make the change.
    actors: frozenset[Actor]
    #: What the change means (the design's words).
    note: str
    #: Who may ask for it without making it (the ``actors`` then do).
    requested_by: frozenset[Actor] = frozenset()
    #: Celery reports it itself (result backend, task events), or it is no news.
    celery_reports: bool = False


_S = State
_A = Actor


def _rule(
    *actors: Actor, note: str, requested_by: tuple[Actor, ...] = (), celery: bool = False
) -> Rule:
    return Rule(frozenset(actors), note, frozenset(requested_by), celery)


_OPERATOR_CANCEL = _rule(_A.OPERATOR, note="operator cancel")
_OPERATOR_RETRY = _rule(_A.OPERATOR, note="operator retry")

#: (from, to) -> the rule of that change. ``None`` as *from* is the row's creation.
#: The one table: every other list of who may do what is derived from it below.
RULES: dict[tuple[State | None, State], Rule] = {
    (None, _S.PENDING): _rule(
        _A.PRODUCER,
        _A.WORKER,
        note="producer submits (or a worker adopts a message without a row)",
        celery=True,
    ),
    (_S.PENDING, _S.RUNNING): _rule(
        _A.WORKER, note="worker claim: compare-and-set, attempt += 1", celery=True
    ),
    (_S.PENDING, _S.CANCELLED): _OPERATOR_CANCEL,
    (_S.RETRY_WAIT, _S.CANCELLED): _OPERATOR_CANCEL,
    (_S.TIMEOUT, _S.CANCELLED): _OPERATOR_CANCEL,
    (_S.WAIT_MANUAL, _S.CANCELLED): _OPERATOR_CANCEL,
    (_S.FAILED, _S.CANCELLED): _OPERATOR_CANCEL,
    (_S.RUNNING, _S.SUCCEEDED): _rule(
        _A.TASK, note="task outcome (fenced by attempt)", celery=True
    ),
    (_S.RUNNING, _S.FAILED): _rule(_A.TASK, note="task outcome (fenced by attempt)", celery=True),
    (_S.RUNNING, _S.RETRY_WAIT): _rule(
        _A.TASK, note="retryable error or self.retry()", celery=True
    ),
    (_S.RUNNING, _S.CANCELLED): _rule(
        _A.TASK,
        note="cooperative cancel acknowledged by the task",
        requested_by=(_A.OPERATOR,),
    ),
    (_S.RUNNING, _S.TIMEOUT): _rule(_A.REAPER, _A.WORKER, note="reaper or worker: lease expired"),
    (_S.RUNNING, _S.WAIT_MANUAL): _rule(
        _A.REAPER, _A.TASK, note="reaper: over max_runtime; policy on failure"
    ),
    (_S.TIMEOUT, _S.RETRY_WAIT): _rule(_A.REAPER, _A.WORKER, note="policy: safe to retry"),
    (_S.TIMEOUT, _S.WAIT_MANUAL): _rule(_A.REAPER, _A.WORKER, note="policy: unsafe or poison"),
    (_S.RETRY_WAIT, _S.PENDING): _rule(_A.REAPER, note="due: re-published", celery=True),
    (_S.WAIT_MANUAL, _S.PENDING): _OPERATOR_RETRY,
    (_S.FAILED, _S.PENDING): _OPERATOR_RETRY,
    (_S.TIMEOUT, _S.PENDING): _OPERATOR_RETRY,
    (_S.WAIT_MANUAL, _S.FAILED): _rule(
        _A.OPERATOR, _A.TASK, note="operator fail, or the still-running owner finishing"
    ),
    (_S.WAIT_MANUAL, _S.SUCCEEDED): _rule(
        _A.OPERATOR, _A.TASK, note="operator resolve, or the still-running owner finishing"
    ),
}

#: (from, to) -> who may make that change, in words (derived from :data:`RULES`).
TRANSITIONS: dict[tuple[State | None, State], str] = {
    pair: rule.note for pair, rule in RULES.items()
}


def sources(to: State, actor: Actor, *, requests: bool = False) -> frozenset[State]:
    """The states from which ``actor`` may move a task to ``to`` (with ``requests``,
    also those from which it may only ask for the move)."""
    return frozenset(
        frm
        for (frm, dest), rule in RULES.items()
        if dest is to
        and frm is not None
        and (actor in rule.actors or (requests and actor in rule.requested_by))
    )


#: States an operator may cancel directly (RUNNING is cancelled cooperatively).
CANCELLABLE: frozenset[State] = sources(State.CANCELLED, Actor.OPERATOR)

#: States an operator may send back to PENDING.
RETRYABLE: frozenset[State] = sources(State.PENDING, Actor.OPERATOR)

#: The operator's actions by name, each with the state it moves a task to.
OPERATOR_ACTIONS: dict[str, State] = {
    "retry": State.PENDING,
    "resolve": State.SUCCEEDED,
    "fail": State.FAILED,
    "cancel": State.CANCELLED,
}


def action_sources(action: str) -> frozenset[State]:
    """The states in which the operator action ``action`` (a key of
    :data:`OPERATOR_ACTIONS`) applies: made at once, or asked for (a RUNNING cancel)."""
    return sources(OPERATOR_ACTIONS[action], Actor.OPERATOR, requests=True)


#: Transitions Celery itself reports (result backend, task events) or that are no news.
CELERY_REPORTS: frozenset[tuple[State | None, State]] = frozenset(
    pair for pair, rule in RULES.items() if rule.celery_reports
)


def is_legal(from_state: State | None, to_state: State) -> bool:
    """Whether the transition table allows ``from_state -> to_state``."""
    return (from_state, to_state) in TRANSITIONS


def parse_state(value: State | str) -> State:
    """A :class:`State` from its name (any case); ``ValueError`` names the valid ones."""
    if isinstance(value, State):
        return value
    try:
        return State(value.strip().upper())
    except ValueError:
        raise ValueError(
            f"unknown state {value!r}: one of {', '.join(s.value for s in State)}"
        ) from None


def check(from_state: State | None, to_state: State, task_id: str | None = None) -> None:
    """Raise :class:`~celery_lease.IllegalTransition` unless the table allows the change."""
    if not is_legal(from_state, to_state):
        raise IllegalTransition(task_id, from_state, to_state)


__all__ = [
    "CANCELLABLE",
    "CELERY_REPORTS",
    "OPERATOR_ACTIONS",
    "RETRYABLE",
    "RULES",
    "STEP_DONE",
    "STEP_STARTED",
    "TERMINAL",
    "TRANSITIONS",
    "Actor",
    "Rule",
    "State",
    "action_sources",
    "check",
    "is_legal",
    "parse_state",
    "sources",
]
