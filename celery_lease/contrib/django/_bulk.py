"""Operator actions over every task the changelist's filters select.

When Django's "Select all N leased tasks" is chosen (``select_across``), an action
is not run on the rows of the page but through the operator API's bulk action
(``admin(app).bulk``), with the list's filters as its filters: state, task name,
worker, reason text, age. It shows a dry run first (what would change, and where it
would stop), asks for a reason, then moves the tasks oldest first in batched
transactions; the first task the transition table refuses stops it cleanly, and the
messages say what changed and where and why it stopped.

A list narrowed by something the bulk action cannot select by (a search, a lookup
typed into the URL) is refused rather than widened: an action over "all matching"
must not take more than the list shows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.views.main import (
    ALL_VAR,
    ERROR_FLAG,
    IS_POPUP_VAR,
    ORDER_VAR,
    PAGE_VAR,
    SEARCH_VAR,
    TO_FIELD_VAR,
)
from django.template.response import TemplateResponse

from ..._incident import BulkResult
from ...exceptions import StoreError
from ._actions import LeaseAction, LeaseActionForm, summary
from ._display import badge
from ._filters import AGES, parse_age
from ._guard import api

#: Tasks one action over "all matching" takes at most (the CLI has no such cap).
MAX_ALL_MATCHING = 10_000
#: Rows of the dry run the confirmation page lists.
SHOWN = 200

#: The changelist's query parameters that are bulk filters, and which.
PARAMETERS = {
    "state__exact": "state",
    "state": "state",
    "name": "name",
    "name__exact": "name",
    "worker": "worker",
    "reason": "reason_contains",
    "older_than": "older_than",
}
#: Parameters that say how the list is shown, not what it holds (``_facets``: Django 5's
#: facet counts, a name Django 4.2 does not export).
_DISPLAY = frozenset(
    {ALL_VAR, ORDER_VAR, PAGE_VAR, ERROR_FLAG, "_facets", IS_POPUP_VAR, TO_FIELD_VAR}
)
_LABELS = {
    "state": "state",
    "name": "task name",
    "worker": "worker",
    "reason_contains": "reason containing",
    "older_than": "submitted more than",
}


class NotSelectable(ValueError):
    """The list's filters are not ones a bulk action can select by."""


def select_across(request: Any) -> bool:
    """Whether the action was chosen for all matching tasks (as Django's action form
    reads its hidden ``select_across`` field)."""
    value = forms.BooleanField(required=False).to_python(request.POST.get("select_across"))
    return bool(value)


def bulk_filters(params: Any) -> dict[str, Any]:
    """The bulk action's filters from the changelist's query parameters (``request.GET``).

    Raises :class:`NotSelectable` for a search, an unknown lookup, a parameter given
    twice, or no filter at all (a bulk action never takes the whole table)."""
    out: dict[str, Any] = {}
    for key in params:
        values = params.getlist(key) if hasattr(params, "getlist") else [params[key]]
        if key in _DISPLAY:
            continue
        if key == SEARCH_VAR:
            if any(v.strip() for v in values):
                raise NotSelectable(
                    "a search cannot select all matching tasks (bulk actions select by "
                    "state, task name, worker, reason and age): clear the search, or "
                    "select the tasks on the page"
                )
            continue
        target = PARAMETERS.get(key)
        if target is None:
            raise NotSelectable(
                f"the list is filtered by {key!r}, which bulk actions cannot select by "
                "(state, task name, worker, reason, age): remove it, or select the "
                "tasks on the page"
            )
        if len(values) != 1 or target in out:
            raise NotSelectable(f"the filter {key!r} is given more than once")
        value = values[0]
        if value == "":
            continue
        out[target] = parse_age(value) if target == "older_than" else value
    if not out:
        raise NotSelectable(
            "all matching tasks needs at least one filter (state, task name, worker, "
            "reason, age): an action never takes the whole table"
        )
    return out


def describe(filters: Mapping[str, Any]) -> str:
    """The filters as a person reads them."""
    parts = []
    for key, value in filters.items():
        if key == "older_than":
            label = next((name for s, name in AGES if float(s) == value), f"{value:g} s")
            parts.append(f"{_LABELS[key]} {label} ago")
        elif key == "reason_contains":
            parts.append(f"{_LABELS[key]} {value!r}")
        else:
            parts.append(f"{_LABELS[key]} {value}")
    return ", ".join(parts)


class BulkActionForm(LeaseActionForm):
    """An action over all matching tasks: a reason always, and how many at most."""

    limit = forms.IntegerField(
        min_value=1,
        max_value=MAX_ALL_MATCHING,
        initial=MAX_ALL_MATCHING,
        help_text=f"Take at most this many tasks, oldest first (up to {MAX_ALL_MATCHING}).",
    )
    batch = forms.IntegerField(
        min_value=1, max_value=1000, initial=100, help_text="Tasks per transaction."
    )

    def __init__(self, *args: Any, action: LeaseAction, **kwargs: Any) -> None:
        super().__init__(*args, action=action, **kwargs)
        # bulk actions record why, always (the operator API requires it)
        self.fields["reason"].required = True


def all_matching(model_admin: admin.ModelAdmin, request: Any, spec: LeaseAction) -> Any:
    """The changelist action ``spec`` over all matching tasks: the dry run and its
    confirmation page, then the bulk action (``None``: back to the list, with messages)."""
    try:
        filters = bulk_filters(request.GET)
    except ValueError as error:  # NotSelectable, or an age that is not a number
        model_admin.message_user(
            request, f"{spec.verb} all matching: {error}. Nothing was changed.", messages.ERROR
        )
        return None
    confirming = bool(request.POST.get("lease_confirm"))
    form = BulkActionForm(request.POST if confirming else None, action=spec)
    if confirming and form.is_valid():
        _run(model_admin, request, spec, filters, form.cleaned_data)
        return None
    limit = MAX_ALL_MATCHING
    if form.is_bound and "limit" not in form.errors and form.cleaned_data.get("limit"):
        limit = int(form.cleaned_data["limit"])
    try:
        # nothing is written in a dry run, so the reason is not recorded anywhere
        preview = api().bulk(spec.name, reason="dry run", dry_run=True, limit=limit, **filters)
    except ValueError as error:  # a state that is not one, ...
        model_admin.message_user(
            request, f"{spec.verb} all matching: {error}. Nothing was changed.", messages.ERROR
        )
        return None
    return _confirmation(model_admin, request, spec, filters, preview, form, limit)


def _confirmation(
    model_admin: admin.ModelAdmin,
    request: Any,
    spec: LeaseAction,
    filters: dict[str, Any],
    preview: BulkResult,
    form: BulkActionForm,
    limit: int,
) -> TemplateResponse:
    opts = model_admin.opts
    refused = preview.refused
    context = {
        **model_admin.admin_site.each_context(request),
        "title": f"{spec.verb} all matching leased tasks",
        "opts": opts,
        "spec": spec,
        "described": describe(filters),
        "changes": [
            (c, badge(c.from_state.value), badge(c.to_state.value)) for c in preview.changed[:SHOWN]
        ],
        "count": len(preview.changed),
        "not_shown": max(0, len(preview.changed) - SHOWN),
        "at_limit": refused is None and len(preview.changed) >= limit,
        "limit": limit,
        "refused": refused,
        "refused_badge": badge(refused.state.value if refused and refused.state else None),
        "form": form,
        "action_name": f"lease_{spec.name}",
        "action_checkbox_name": admin.helpers.ACTION_CHECKBOX_NAME,
        "selected": request.POST.getlist(admin.helpers.ACTION_CHECKBOX_NAME),
    }
    return TemplateResponse(request, "admin/celery_lease/task/lease_bulk.html", context)


def _run(
    model_admin: admin.ModelAdmin,
    request: Any,
    spec: LeaseAction,
    filters: dict[str, Any],
    data: dict[str, Any],
) -> None:
    described = describe(filters)
    try:
        done = api().bulk(
            spec.name,
            reason=data["reason"].strip(),
            actor=str(request.user.get_username()),
            result=data.get("result"),
            batch=int(data["batch"]),
            limit=int(data["limit"]),
            **filters,
        )
    except StoreError as error:
        model_admin.message_user(
            request,
            f"The lease store failed during {spec.name} of all tasks matching {described}: "
            f"{error}. Transactions committed before the failure stay done; the list shows "
            "what is left.",
            messages.ERROR,
        )
        return
    except ValueError as error:
        model_admin.message_user(
            request, f"{spec.verb} all matching: {error}. Nothing was changed.", messages.ERROR
        )
        return
    report(model_admin, request, spec, described, done, int(data["limit"]))


def report(
    model_admin: admin.ModelAdmin,
    request: Any,
    spec: LeaseAction,
    described: str,
    done: BulkResult,
    limit: int,
) -> None:
    """Messages for a bulk action: what changed, and where and why it stopped."""
    say = model_admin.message_user
    changed = [c.id for c in done.changed]
    if changed:
        text = summary(spec, changed)
        say(
            request,
            f"{text[:-1]} (all matching {described}, in {done.batches} transaction(s)).",
            messages.SUCCESS,
        )
        asked = sum(1 for c in done.changed if c.requested)
        if asked:
            say(
                request,
                f"{asked} of them RUNNING: asked to stop, they do so at their next step boundary.",
                messages.INFO,
            )
    refused = done.refused
    if refused is not None:
        state = refused.state.value if refused.state is not None else "missing"
        say(
            request,
            f"{spec.verb} stopped at task {refused.id} ({refused.name}, {state}): "
            f"{refused.why}. It and the tasks after it were left as they are"
            + ("." if changed else "; nothing was changed."),
            messages.ERROR,
        )
    elif not changed:
        say(request, f"No task matches {described}: nothing was changed.", messages.WARNING)
    elif len(changed) >= limit:
        say(
            request,
            f"{spec.verb} took its limit of {limit} tasks; more may match: run it again.",
            messages.WARNING,
        )
