"""The leased tasks' list filters beyond Django's own: worker, reason text, age.

With the state and task-name filters they are the filters of the operator API's bulk
actions (``admin(app).bulk``), so an action over "all matching" tasks acts on what
the list shows (see :mod:`._bulk`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib import admin
from django.contrib.admin.options import IncorrectLookupParameters
from django.utils import timezone

from .models import Worker

#: The ages the age filter offers (seconds, label); any other number of seconds works too.
AGES = (
    ("300", "5 minutes"),
    ("3600", "1 hour"),
    ("86400", "1 day"),
    ("604800", "7 days"),
)


class WorkerFilter(admin.SimpleListFilter):
    """Tasks whose latest attempt ran on a worker node (any incarnation of it)."""

    title = "worker"
    parameter_name = "worker"

    def lookups(self, request: Any, model_admin: Any) -> list[tuple[str, str]]:
        names = (
            Worker.objects.order_by("nodename").values_list("nodename", flat=True).distinct()[:200]
        )
        return [(name, name) for name in names]

    def queryset(self, request: Any, queryset: Any) -> Any:
        value = self.value()
        if not value:
            return queryset
        return queryset.filter(owner__in=Worker.objects.filter(nodename=value).values("id"))


class ReasonFilter(admin.SimpleListFilter):
    """Tasks whose last reason contains a text (case-sensitive, as the bulk actions'
    ``reason_contains``): a text box instead of a list of choices."""

    title = "reason containing"
    parameter_name = "reason"
    template = "admin/celery_lease/task/text_filter.html"

    def lookups(self, request: Any, model_admin: Any) -> list[tuple[str, str]]:
        return []

    def has_output(self) -> bool:
        return True

    def choices(self, changelist: Any) -> Any:
        # the other filters, the search and the ordering stay as they are
        hidden = [
            (key, str(value))
            for key, value in changelist.params.items()
            if key != self.parameter_name
        ]
        yield {
            "parameter": self.parameter_name,
            "value": self.value() or "",
            "hidden": hidden,
            "clear_url": changelist.get_query_string(remove=[self.parameter_name]),
        }

    def queryset(self, request: Any, queryset: Any) -> Any:
        value = self.value()
        if not value:
            return queryset
        return queryset.filter(reason__contains=value)


def parse_age(value: str) -> float:
    """Seconds from the age filter's parameter (``ValueError`` if not a number >= 0)."""
    seconds = float(value)
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"not a number of seconds >= 0: {value!r}")
    return seconds


class AgeFilter(admin.SimpleListFilter):
    """Tasks submitted at least this long ago (the list compares with this process's
    clock; a bulk action selects again, in database time)."""

    title = "submitted more than"
    parameter_name = "older_than"

    def lookups(self, request: Any, model_admin: Any) -> tuple[tuple[str, str], ...]:
        return tuple((seconds, f"{label} ago") for seconds, label in AGES)

    def queryset(self, request: Any, queryset: Any) -> Any:
        value = self.value()
        if not value:
            return queryset
        try:
            seconds = parse_age(value)
        except ValueError as error:
            raise IncorrectLookupParameters(str(error)) from error
        return queryset.filter(created_at__lt=timezone.now() - timedelta(seconds=seconds))
