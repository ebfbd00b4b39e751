"""The operator actions the admin offers, run through ``celery_lease.admin(app)``.

The admin never writes the lease tables itself: each action is a call to the operator
API, which checks the transition table, records the actor and reason in the audit
trail, and changes nothing when the request is illegal.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from django import forms

from ...exceptions import IllegalTransition, TaskNotFound
from ...operations import Admin
from ...states import State, action_sources


def codename(action: str) -> str:
    """The permission codename of an operator action: ``<action>_task`` (retry_task,
    pause_task, ...), checked as ``celery_lease.<codename>``."""
    return f"{action}_task"


@dataclasses.dataclass(frozen=True)
class LeaseAction:
    """One operator action as the admin shows it."""

    name: str
    verb: str
    past: str
    explanation: str
    #: States from which the action applies (for buttons; the operator API decides).
    sources: frozenset[State]
    reason_required: bool
    takes_result: bool = False

    @property
    def codename(self) -> str:
        """The permission codename (``celery_lease.<codename>``)."""
        return codename(self.name)

    @property
    def permission(self) -> str:
        return f"celery_lease.{self.codename}"

    @property
    def applies_to(self) -> str:
        return ", ".join(sorted(s.value for s in self.sources))

    def run(
        self, api: Admin, task_id: str, *, actor: str, reason: str, result: Any = None
    ) -> str | None:
        """Perform the action on one task; returns a note for the operator, if any.

        Raises :class:`IllegalTransition` or :class:`TaskNotFound` (nothing changed).
        """
        if self.name == "retry":
            api.retry(task_id, actor=actor, reason=reason or None)
        elif self.name == "fail":
            api.fail(task_id, actor=actor, reason=reason)
        elif self.name == "resolve":
            api.resolve(task_id, actor=actor, reason=reason, result=result)
        elif self.name == "cancel":
            found = api.cancel(task_id, actor=actor, reason=reason or None)
            if found is State.RUNNING:
                return f"{task_id} is RUNNING: it stops at its next step boundary"
        else:  # pragma: no cover - ACTIONS is closed
            raise AssertionError(self.name)
        return None


ACTIONS: dict[str, LeaseAction] = {
    a.name: a
    for a in (
        LeaseAction(
            "retry",
            "Retry",
            "retried",
            "Back to PENDING and published again. Completed steps are kept, so the run "
            "resumes after them; a step whose outcome was unknown runs again.",
            action_sources("retry"),
            reason_required=False,
        ),
        LeaseAction(
            "fail",
            "Fail",
            "failed",
            "Mark FAILED: the task will not complete.",
            action_sources("fail"),
            reason_required=True,
        ),
        LeaseAction(
            "resolve",
            "Resolve",
            "resolved",
            "Mark SUCCEEDED: the work was finished by hand. The result (JSON) is stored "
            "as the task's result.",
            action_sources("resolve"),
            reason_required=True,
            takes_result=True,
        ),
        LeaseAction(
            "cancel",
            "Cancel",
            "cancelled",
            "PENDING, RETRY_WAIT, TIMEOUT, WAIT_MANUAL and FAILED tasks become CANCELLED at "
            "once; a RUNNING task is asked to stop and does so at its next step boundary.",
            action_sources("cancel"),
            reason_required=False,
        ),
    )
}


class LeaseActionForm(forms.Form):
    """Reason (and, for resolve, a JSON result) for an operator action."""

    reason = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 3, "cols": 70}),
        required=False,
        max_length=4000,
        help_text="Recorded in the audit trail with your user name.",
    )
    result = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 3, "cols": 70}),
        required=False,
        help_text="JSON, stored as the task's result (empty: null).",
    )

    def __init__(self, *args: Any, action: LeaseAction, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.action = action
        self.fields["reason"].required = action.reason_required
        if not action.takes_result:
            del self.fields["result"]

    def clean_result(self) -> Any:
        text = self.cleaned_data.get("result") or ""
        if not text.strip():
            return None
        try:
            return json.loads(text)
        except ValueError as error:
            raise forms.ValidationError(f"not valid JSON: {error}") from error


def refusal(action: LeaseAction, task_id: str, error: Exception) -> str:
    """The message shown when the operator API refused an action (nothing changed)."""
    if isinstance(error, TaskNotFound):
        return f"Task {task_id} was not {action.past}: no leased task has this id."
    if isinstance(error, IllegalTransition) and error.from_state not in action.sources:
        state = error.from_state.value if error.from_state else "new"
        return (
            f"Task {task_id} was not {action.past}: it is {state}, and {action.name} "
            f"applies to {action.applies_to}. Nothing was changed."
        )
    return f"Task {task_id} was not {action.past}: {error}. Nothing was changed."


def summary(action: LeaseAction, done: Sequence[str], limit: int = 10) -> str:
    shown = ", ".join(done[:limit]) + (
        f" and {len(done) - limit} more" if len(done) > limit else ""
    )
    noun = "task" if len(done) == 1 else "tasks"
    return f"{action.past.capitalize()} {len(done)} {noun}: {shown}."
