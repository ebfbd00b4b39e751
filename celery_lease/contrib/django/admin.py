"""Django admin for leased tasks: list, filters, the audit trail, and operator actions.

Everything is read-only except the actions retry / fail / resolve / cancel, which call
the operator API (``celery_lease.admin(app)``) with ``request.user`` as the actor and
need the permissions ``celery_lease.retry_task`` / ``fail_task`` / ``resolve_task`` /
``cancel_task``. A refused action shows an error and changes nothing. On the selected
tasks an action runs once per task; on "all matching" tasks (Django's "Select all")
it is the operator API's bulk action over the list's filters (``_bulk.py``). The pauses
page and its history are in ``_pauses.py``; every page ends within ``lease_db_timeout``
when the database does not answer (``_guard.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.db.models import OuterRef, Subquery
from django.http import Http404, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse

from ...exceptions import IllegalTransition, StoreError, TaskNotFound
from ...records import WorkerRecord
from ...states import State
from ._actions import ACTIONS, LeaseAction, LeaseActionForm, refusal, summary
from ._bulk import all_matching, select_across
from ._display import as_json, badge, display, html, timestamp, when
from ._filters import AgeFilter, ReasonFilter, WorkerFilter
from ._guard import GuardedAdmin, api, guard
from ._inlines import StepInline, TransitionInline
from ._pauses import PauseAdmin, PauseEventAdmin
from .models import Pause, PauseEvent, Task, Worker

#: Selected tasks one changelist action may touch (all matching ones: ``_bulk.py``).
MAX_SELECTED = 500

__all__ = ["PauseAdmin", "PauseEventAdmin", "TaskAdmin", "WorkerAdmin", "api"]

admin.site.register(Pause, PauseAdmin)
admin.site.register(PauseEvent, PauseEventAdmin)


# -- tasks --------------------------------------------------------------------------------


def _changelist_action(spec: LeaseAction) -> Any:
    def action(modeladmin: TaskAdmin, request: Any, queryset: Any) -> Any:
        return modeladmin.run_changelist_action(request, spec, queryset)

    action.__name__ = f"lease_{spec.name}"
    return admin.action(description=f"{spec.verb} selected leased tasks", permissions=[spec.name])(
        action
    )


@admin.register(Task)
class TaskAdmin(GuardedAdmin):
    """Leased tasks: read-only, with operator actions."""

    list_display = (
        "short_id",
        "name",
        "state_badge",
        "attempt",
        "recoveries",
        "worker_name",
        "created_list",
        "short_reason",
    )
    list_display_links = ("short_id",)
    list_filter = ("state", "name", WorkerFilter, ReasonFilter, AgeFilter)
    search_fields = ("^id", "=dedup_key")
    search_help_text = "Task id (or its start) or exact dedup key."
    ordering = ("-created_at",)
    list_per_page = 50
    # COUNT(*) over a large tasks table on every page view is not worth it
    show_full_result_count = False
    actions = tuple(_changelist_action(a) for a in ACTIONS.values())
    inlines = (TransitionInline, StepInline)
    change_form_template = "admin/celery_lease/task/change_form.html"
    fieldsets = (
        # state and reason lead the page in the decision panel (change_form.html)
        (None, {"fields": ("id", ("name", "dedup_key"))}),
        (
            "Execution",
            {
                "fields": (
                    ("attempt", "recoveries", "retries"),
                    ("worker_node", "worker_heartbeat"),
                    ("lease_ttl", "max_runtime", "max_retries", "max_recoveries"),
                    ("on_timeout", "on_exhausted"),
                )
            },
        ),
        (
            "Times",
            {
                "fields": (
                    "created",
                    ("published", "publish_count"),
                    "eta_shown",
                    "started",
                    "last_progress",
                    "next_retry",
                    "finished",
                    "updated",
                ),
                "classes": ("collapse",),
            },
        ),
        (
            "Payload",
            {
                "fields": (
                    "args_json",
                    "kwargs_json",
                    "options_json",
                    "progress_json",
                    "result_json",
                    "error_text",
                ),
                "classes": ("collapse",),
            },
        ),
        (
            "Cancel request",
            {
                "fields": ("cancel_requested", "cancel_actor", "cancel_reason"),
                "classes": ("collapse",),
            },
        ),
    )
    readonly_fields = (
        "id",
        "name",
        "state_badge",
        "reason",
        "dedup_key",
        "attempt",
        "recoveries",
        "retries",
        "worker_node",
        "worker_heartbeat",
        "lease_ttl",
        "max_runtime",
        "max_retries",
        "max_recoveries",
        "on_timeout",
        "on_exhausted",
        "created",
        "published",
        "publish_count",
        "eta_shown",
        "started",
        "last_progress",
        "next_retry",
        "finished",
        "updated",
        "args_json",
        "kwargs_json",
        "options_json",
        "progress_json",
        "result_json",
        "error_text",
        "cancel_requested",
        "cancel_actor",
        "cancel_reason",
    )

    created = timestamp("created_at", "created")
    created_list = timestamp("created_at", "created", precise=False)
    published = timestamp("published_at", "published")
    eta_shown = timestamp("eta", "ETA")
    started = timestamp("started_at", "started (latest attempt)")
    last_progress = timestamp("progress_at", "last progress")
    next_retry = timestamp("next_retry_at", "next retry")
    finished = timestamp("finished_at", "finished")
    updated = timestamp("updated_at", "updated")
    cancel_requested = timestamp("cancel_requested_at", "cancel requested")

    # -- permissions: rows change only through the operator API -----------------------

    def has_lease_permission(self, request: Any, spec: LeaseAction) -> bool:
        return bool(request.user.has_perm(spec.permission))

    def has_retry_permission(self, request: Any) -> bool:
        return self.has_lease_permission(request, ACTIONS["retry"])

    def has_fail_permission(self, request: Any) -> bool:
        return self.has_lease_permission(request, ACTIONS["fail"])

    def has_resolve_permission(self, request: Any) -> bool:
        return self.has_lease_permission(request, ACTIONS["resolve"])

    def has_cancel_permission(self, request: Any) -> bool:
        return self.has_lease_permission(request, ACTIONS["cancel"])

    # -- reading ----------------------------------------------------------------------

    def get_queryset(self, request: Any) -> Any:
        node = Worker.objects.filter(id=OuterRef("owner")).values("nodename")[:1]
        return super().get_queryset(request).annotate(_worker_node=Subquery(node))

    @display(description="state", ordering="state")
    def state_badge(self, obj: Task) -> str:
        return badge(obj.state)

    @display(description="worker", ordering="_worker_node")
    def worker_node(self, obj: Task) -> str:
        node = getattr(obj, "_worker_node", None)
        if obj.owner is None:
            return "-"
        return f"{node} ({obj.owner})" if node else str(obj.owner)

    @display(description="worker", ordering="_worker_node")
    def worker_name(self, obj: Task) -> str:
        return str(getattr(obj, "_worker_node", None) or obj.owner or "-")

    @display(description="task", ordering="id")
    def short_id(self, obj: Task) -> str:
        text = str(obj.id)
        return text if len(text) <= 13 else text[:8] + "…"

    @display(description="owner's last heartbeat")
    def worker_heartbeat(self, obj: Task) -> str:
        if obj.owner is None:
            return "-"
        worker = Worker.objects.filter(id=obj.owner).first()
        if worker is None:
            return "- (no row for this worker)"
        note = f"; stopped: {worker.stop_reason}" if worker.stopped_at is not None else ""
        return f"{when(worker.heartbeat_at)}{note}"

    @display(description="reason")
    def short_reason(self, obj: Task) -> str:
        text = obj.reason or ""
        return text if len(text) <= 60 else text[:57] + "..."

    @display(description="args")
    def args_json(self, obj: Task) -> str:
        return as_json(obj.args)

    @display(description="kwargs")
    def kwargs_json(self, obj: Task) -> str:
        return as_json(obj.kwargs)

    @display(description="options")
    def options_json(self, obj: Task) -> str:
        return as_json(obj.options)

    @display(description="progress")
    def progress_json(self, obj: Task) -> str:
        return as_json(obj.progress)

    @display(description="result")
    def result_json(self, obj: Task) -> str:
        return as_json(obj.result)

    @display(description="error")
    def error_text(self, obj: Task) -> str:
        return (
            html('<pre style="margin:0;white-space:pre-wrap">{}</pre>', obj.error)
            if obj.error
            else "-"
        )

    # -- the detail page: decision panel and action buttons ---------------------------

    def available_actions(self, request: Any, obj: Task) -> list[dict[str, Any]]:
        """Actions this user may take on this task in its current state, with their URLs."""
        out = []
        for spec in ACTIONS.values():
            if State(obj.state) in spec.sources and self.has_lease_permission(request, spec):
                url = reverse(
                    f"admin:{self.opts.app_label}_{self.opts.model_name}_lease_action",
                    args=[quote(obj.pk), spec.name],
                )
                out.append({"spec": spec, "url": url})
        return out

    def render_change_form(
        self,
        request: Any,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Any = None,
    ) -> Any:
        if obj is not None:
            context["lease_actions"] = self.available_actions(request, obj)
            context["lease_task"] = obj
            context["lease_state_badge"] = badge(obj.state)
        return super().render_change_form(request, context, add, change, form_url, obj)

    def get_urls(self) -> list[Any]:
        info = self.opts.app_label, self.opts.model_name
        custom = [
            path(
                "<path:object_id>/lease/<str:action>/",
                self.admin_site.admin_view(guard(self, self.lease_action_view)),
                name="{}_{}_lease_action".format(*info),
            )
        ]
        return custom + list(super().get_urls())

    # -- acting -----------------------------------------------------------------------

    def lease_action_view(self, request: Any, object_id: str, action: str) -> Any:
        """One action on one task, from its detail page (confirm, then act)."""
        spec = ACTIONS.get(action)
        if spec is None:
            raise Http404(f"unknown action {action!r}")
        if not (self.has_view_permission(request) and self.has_lease_permission(request, spec)):
            raise PermissionDenied
        task_id = unquote(object_id)
        obj = self.get_object(request, task_id)
        if obj is None:
            return self._get_obj_does_not_exist_redirect(request, self.opts, task_id)
        change_url = reverse(
            f"admin:{self.opts.app_label}_{self.opts.model_name}_change", args=[quote(obj.pk)]
        )
        if request.method == "POST":
            form = LeaseActionForm(request.POST, action=spec)
            if form.is_valid():
                self.perform(request, spec, [obj.pk], form.cleaned_data)
                return HttpResponseRedirect(change_url)
        else:
            form = LeaseActionForm(action=spec)
        return self.render_confirmation(request, spec, [obj], form, cancel_url=change_url)

    def run_changelist_action(self, request: Any, spec: LeaseAction, queryset: Any) -> Any:
        """A changelist action: a confirmation page first, then the operator API per task;
        over all matching tasks, the operator API's bulk action (:mod:`._bulk`)."""
        if select_across(request):
            return all_matching(self, request, spec)
        tasks = list(queryset.order_by("-created_at")[: MAX_SELECTED + 1])
        if len(tasks) > MAX_SELECTED:
            self.message_user(
                request,
                f"Select at most {MAX_SELECTED} tasks per action, or all matching tasks "
                "(the action then goes through the bulk operator API). Nothing was changed.",
                messages.ERROR,
            )
            return None
        if request.POST.get("lease_confirm"):
            form = LeaseActionForm(request.POST, action=spec)
            if form.is_valid():
                self.perform(request, spec, [t.pk for t in tasks], form.cleaned_data)
                return None  # back to the changelist, with the messages
        else:
            form = LeaseActionForm(action=spec)
        return self.render_confirmation(request, spec, tasks, form, changelist_action=True)

    def render_confirmation(
        self,
        request: Any,
        spec: LeaseAction,
        tasks: Sequence[Task],
        form: LeaseActionForm,
        *,
        changelist_action: bool = False,
        cancel_url: str | None = None,
    ) -> TemplateResponse:
        context = {
            **self.admin_site.each_context(request),
            "title": f"{spec.verb} {len(tasks)} leased task{'s' if len(tasks) != 1 else ''}",
            "opts": self.opts,
            "spec": spec,
            "tasks": [(t, badge(t.state), State(t.state) in spec.sources) for t in tasks],
            "form": form,
            "changelist_action": changelist_action,
            "action_name": f"lease_{spec.name}",
            "action_checkbox_name": admin.helpers.ACTION_CHECKBOX_NAME,
            "cancel_url": cancel_url,
        }
        return TemplateResponse(request, "admin/celery_lease/task/lease_action.html", context)

    def perform(
        self, request: Any, spec: LeaseAction, task_ids: Sequence[str], data: dict[str, Any]
    ) -> list[str]:
        """Run ``spec`` on each task through the operator API; report per task. Returns
        the ids it was applied to."""
        operator = api()
        actor = str(request.user.get_username())
        reason = (data.get("reason") or "").strip()
        done: list[str] = []
        for task_id in task_ids:
            try:
                note = spec.run(
                    operator, task_id, actor=actor, reason=reason, result=data.get("result")
                )
            except (IllegalTransition, TaskNotFound, ValueError) as error:
                self.message_user(request, refusal(spec, task_id, error), messages.ERROR)
                continue
            except StoreError as error:
                self.message_user(
                    request,
                    f"The lease store failed; task {task_id} and the rest were not "
                    f"{spec.past}: {error}",
                    messages.ERROR,
                )
                break
            done.append(task_id)
            if note:
                self.message_user(request, note, messages.INFO)
        if done:
            self.message_user(request, summary(spec, done), messages.SUCCESS)
        return done


# -- workers ------------------------------------------------------------------------------


@admin.register(Worker)
class WorkerAdmin(GuardedAdmin):
    """Worker incarnations: who holds leases, and whether they are alive."""

    search_fields = ("nodename", "=id", "hostname")
    list_filter = ("nodename",)
    show_full_result_count = False
    readonly_fields = (
        "id",
        "nodename",
        "hostname",
        "pid",
        "started_at",
        "heartbeat_at",
        "stopped_at",
        "stop_reason",
    )

    def get_list_display(self, request: Any) -> Sequence[Any]:
        # liveness is judged by the store, in database time, once per page
        records: dict[str, WorkerRecord] | None = None

        def record(obj: Worker) -> WorkerRecord | None:
            nonlocal records
            if records is None:
                records = {w.id: w for w in api().workers()}
            return records.get(obj.id)

        @display(boolean=True, description="alive")
        def alive(obj: Worker) -> bool | None:
            found = record(obj)
            return None if found is None else found.alive

        @display(description="running tasks")
        def running(obj: Worker) -> str:
            found = record(obj)
            count = 0 if found is None else found.running
            query = urlencode({"state__exact": State.RUNNING.value, "worker": obj.nodename})
            url = reverse("admin:celery_lease_task_changelist")
            return html('<a href="{}?{}">{}</a>', url, query, count)

        return (
            "nodename",
            "id",
            "hostname",
            "pid",
            alive,
            running,
            "started_at",
            "heartbeat_at",
            "stopped_at",
            "stop_reason",
        )
