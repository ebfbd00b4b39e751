"""How the admin shows lease data: state badges, JSON payloads, precise timestamps."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from django.contrib import admin
from django.utils import timezone
from django.utils.html import format_html

from ...states import State

_STATE_COLOURS = {
    State.PENDING: "#5a6b7b",
    State.RUNNING: "#1f6fb2",
    State.SUCCEEDED: "#2e7d32",
    State.FAILED: "#c62828",
    State.RETRY_WAIT: "#b26a00",
    State.TIMEOUT: "#d84315",
    State.WAIT_MANUAL: "#6a1b9a",
    State.CANCELLED: "#616161",
}

#: Longest JSON payload shown on a page.
_MAX_SHOWN = 20_000


F = TypeVar("F", bound=Callable[..., Any])


def display(**kwargs: Any) -> Callable[[F], F]:
    """``admin.display`` with its type kept (Django ships no type hints)."""
    decorator: Callable[[F], F] = admin.display(**kwargs)
    return decorator


def html(template: str, *args: Any) -> str:
    """``format_html`` (a safe string) typed as ``str``."""
    out: str = format_html(template, *args)
    return out


def badge(state: str | None) -> str:
    if not state:
        return "-"
    try:
        colour = _STATE_COLOURS[State(state)]
    except ValueError:
        colour = "#000"
    return html(
        '<span class="lease-state" style="color:#fff;background:{};padding:1px 7px;'
        'border-radius:9px;font-weight:600;white-space:nowrap">{}</span>',
        colour,
        state,
    )


def as_json(text: str | None) -> str:
    if text is None:
        return "-"
    try:
        shown = json.dumps(json.loads(text), indent=2, sort_keys=True)
    except ValueError:
        shown = text
    if len(shown) > _MAX_SHOWN:
        shown = shown[:_MAX_SHOWN] + f"\n... ({len(shown) - _MAX_SHOWN} more characters)"
    return html('<pre style="margin:0;white-space:pre-wrap">{}</pre>', shown)


def when(value: datetime | None, *, precise: bool = True) -> str:
    """A timestamp in the current time zone: to the millisecond, with the zone, when
    ``precise`` (audit trails need more than Django's default minutes); else to the
    second (list columns)."""
    if value is None:
        return "-"
    local: datetime = timezone.localtime(value)
    if not precise:
        return f"{local:%Y-%m-%d %H:%M:%S}"
    return f"{local:%Y-%m-%d %H:%M:%S}.{local.microsecond // 1000:03d} {local:%Z}"


def timestamp(field: str, description: str, *, precise: bool = True) -> Callable[[Any, Any], str]:
    """An admin column showing the model field ``field`` with :func:`when`."""

    @display(description=description, ordering=field)
    def show(self: Any, obj: Any) -> str:
        shown = when(getattr(obj, field), precise=precise)
        return html('<span style="white-space:nowrap">{}</span>', shown)

    return show
