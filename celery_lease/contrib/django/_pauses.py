"""Pausing and resuming queues and task names from the admin, and the pauses' history.

**Pauses** (``/admin/celery_lease/pause/``) is one page: what is paused now (by whom,
why, since when), a form to pause a queue or a task name, a resume button per pause,
and the latest pauses and resumes. It reads and acts only through the operator API
(``admin(app).pause`` / ``resume`` / ``pauses`` / ``pause_history``), with
``request.user`` as the actor and a required reason, so the pauses' audit log records
both. Pausing needs ``celery_lease.pause_task``, resuming ``celery_lease.resume_task``
(named like the task actions' ``retry_task``...), seeing the page ``view_pause``.

**Pause history** (``/admin/celery_lease/pauseevent/``) lists every pause and resume,
newest first, read-only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from django import forms
from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import HttpResponseBadRequest, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse

from ._actions import codename
from ._display import display, timestamp, when
from ._guard import GuardedAdmin, api, guarded
from .models import PAUSE_KINDS, PauseEvent

#: Pauses and resumes the pauses page shows (the history page has them all).
HISTORY_SHOWN = 20


@dataclasses.dataclass(frozen=True)
class PauseAction:
    """Pause or resume, as the admin offers it."""

    name: str
    verb: str

    @property
    def permission(self) -> str:
        return f"celery_lease.{codename(self.name)}"


PAUSE_ACTIONS = {
    a.name: a for a in (PauseAction("pause", "Pause"), PauseAction("resume", "Resume"))
}


class PauseForm(forms.Form):
    """What to pause or resume, and why (recorded with your user name)."""

    kind = forms.ChoiceField(choices=PAUSE_KINDS, initial="task")
    target = forms.CharField(
        max_length=255,
        label="Name",
        help_text="The queue's name, or the task's name (e.g. shop.export).",
    )
    reason = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 2, "cols": 60}),
        max_length=4000,
        help_text="Required: recorded in the pauses' history with your user name.",
    )

    def clean_target(self) -> str:
        text = str(self.cleaned_data["target"]).strip()
        if not text:
            raise forms.ValidationError("a name is required")
        return text

    def clean_reason(self) -> str:
        text = str(self.cleaned_data["reason"]).strip()
        if not text:
            raise forms.ValidationError("a reason is required: say why")
        return text


def _label(kind: str, target: str) -> str:
    return f"{'Queue' if kind == 'queue' else 'Task name'} {target}"


class PauseAdmin(GuardedAdmin):
    """The pauses page (see the module docstring); nothing here is a Django form over
    the table: rows change only through the operator API."""

    def may(self, request: Any, action: str) -> bool:
        return bool(request.user.has_perm(PAUSE_ACTIONS[action].permission))

    def get_urls(self) -> list[Any]:
        # one page: the table's key is (kind, target), so there is no page per row
        info = self.opts.app_label, self.opts.model_name
        view = self.admin_site.admin_view(self.changelist_view)
        return [path("", view, name="{}_{}_changelist".format(*info))]

    def changelist_view(self, request: Any, extra_context: dict[str, Any] | None = None) -> Any:
        return guarded(request, self, self.pauses_view)

    def pauses_view(self, request: Any) -> Any:
        if not self.has_view_permission(request):
            raise PermissionDenied
        form = PauseForm()
        if request.method == "POST":
            spec = PAUSE_ACTIONS.get(str(request.POST.get("op", "")))
            if spec is None:
                return HttpResponseBadRequest("op must be pause or resume")
            if not self.may(request, spec.name):
                raise PermissionDenied
            bound = PauseForm(request.POST)
            if bound.is_valid():
                self.act(request, spec, bound.cleaned_data)
                return HttpResponseRedirect(request.path)
            if spec.name == "pause":
                form = bound  # the form again, with its errors
            else:
                for errors in bound.errors.values():
                    for error in errors:
                        self.message_user(request, f"Not resumed: {error}.", messages.ERROR)
        return self.render_pauses(request, form)

    def act(self, request: Any, spec: PauseAction, data: dict[str, Any]) -> None:
        kind, target, reason = data["kind"], data["target"], data["reason"]
        actor = str(request.user.get_username())
        label = _label(kind, target)
        target_kw = {"queue": target} if kind == "queue" else {"task": target}
        try:
            if spec.name == "pause":
                changed = api().pause(**target_kw, reason=reason, actor=actor)
            else:
                changed = api().resume(**target_kw, reason=reason, actor=actor)
        except ValueError as error:
            self.message_user(request, f"{label} was not {spec.name}d: {error}.", messages.ERROR)
            return
        if not changed:
            state = "already paused" if spec.name == "pause" else "not paused"
            self.message_user(request, f"{label} was {state}: nothing changed.", messages.WARNING)
        elif spec.name == "pause" and kind == "queue":
            self.message_user(
                request,
                f"{label} paused: workers stop consuming it within a heartbeat interval; "
                "its messages wait in the broker.",
                messages.SUCCESS,
            )
        elif spec.name == "pause":
            self.message_user(
                request,
                f"{label} paused: within a heartbeat interval its deliveries are no longer "
                "run; they wait, PENDING, and are published again on resume.",
                messages.SUCCESS,
            )
        else:
            held = "; the deliveries it held are published again" if kind == "task" else ""
            self.message_user(request, f"{label} resumed{held}.", messages.SUCCESS)

    def render_pauses(self, request: Any, form: PauseForm) -> TemplateResponse:
        operator = api()
        history_url = None
        if request.user.has_perm("celery_lease.view_pauseevent"):
            history_url = reverse("admin:celery_lease_pauseevent_changelist")
        context = {
            **self.admin_site.each_context(request),
            "title": "Pauses",
            "opts": self.opts,
            "pauses": [(p, when(p.paused_at)) for p in operator.pauses()],
            "history": [(e, when(e.at)) for e in operator.pause_history(limit=HISTORY_SHOWN)],
            "history_url": history_url,
            "form": form,
            "can_pause": self.may(request, "pause"),
            "can_resume": self.may(request, "resume"),
        }
        return TemplateResponse(request, "admin/celery_lease/pause/change_list.html", context)


class PauseEventAdmin(GuardedAdmin):
    """Every pause and resume, newest first: read-only."""

    list_display = ("at_shown", "action", "kind", "target", "actor", "reason_shown")
    list_display_links = None
    list_filter = ("action", "kind")
    search_fields = ("target", "actor", "reason")
    search_help_text = "Queue or task name, actor, or text of the reason."
    show_full_result_count = False
    list_per_page = 100

    at_shown = timestamp("at", "when")

    @display(description="reason")
    def reason_shown(self, obj: PauseEvent) -> str:
        return str(obj.reason)
