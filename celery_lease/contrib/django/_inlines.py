"""The task page's read-only inlines: the audit trail and the recorded steps."""

from __future__ import annotations

from typing import Any

from django.contrib import admin

from ._display import as_json, badge, display, timestamp
from .models import Step, Transition


class _ReadOnlyInline(admin.TabularInline):
    extra = 0
    max_num = 0
    can_delete = False
    show_change_link = False

    def has_add_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_view_permission(self, request: Any, obj: Any = None) -> bool:
        # whoever may see a task may see its trail and steps
        return bool(request.user.has_perm("celery_lease.view_task"))


class TransitionInline(_ReadOnlyInline):
    """The audit trail, oldest first."""

    model = Transition
    fields = ("at_shown", "from_state_badge", "to_state_badge", "actor", "attempt", "reason")
    readonly_fields = fields
    verbose_name = "transition"
    verbose_name_plural = "audit trail"

    at_shown = timestamp("at", "at")

    @display(description="from")
    def from_state_badge(self, obj: Transition) -> str:
        return badge(obj.from_state) if obj.from_state else "(created)"

    @display(description="to")
    def to_state_badge(self, obj: Transition) -> str:
        return badge(obj.to_state)


class StepInline(_ReadOnlyInline):
    """Recorded steps, in the order they started."""

    model = Step
    fields = (
        "name",
        "state",
        "idempotent",
        "checkable",
        "attempt",
        "result_json",
        "started",
        "finished",
    )
    readonly_fields = fields

    started = timestamp("started_at", "started")
    finished = timestamp("finished_at", "finished")

    @display(description="result")
    def result_json(self, obj: Step) -> str:
        return as_json(obj.result)
