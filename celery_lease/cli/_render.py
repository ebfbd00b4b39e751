"""How ``celery lease`` prints: JSON for scripts, padded tables and short durations
for people, state names in colour on a terminal."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from enum import Enum
from typing import Any

import click

from ..health import TaskHealth
from ..states import State

STATE_COLORS: dict[State, str] = {
    State.PENDING: "blue",
    State.RUNNING: "cyan",
    State.SUCCEEDED: "green",
    State.FAILED: "red",
    State.RETRY_WAIT: "yellow",
    State.TIMEOUT: "magenta",
    State.WAIT_MANUAL: "red",
    State.CANCELLED: "white",
}


def color_of(ctx: click.Context) -> bool | None:
    """``None``: colour when the stream is a terminal (click strips it otherwise)."""
    return False if getattr(ctx.find_root().obj, "no_color", False) else None


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(_jsonable(k)): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Enum):
        return value.value
    return value


def _print_json(value: Any) -> None:
    click.echo(json.dumps(_jsonable(value), indent=2, sort_keys=False))


def ago(then: datetime | None, now: datetime) -> str:
    """``"12s ago"``, ``"5m ago"``, ``"3h ago"``, ``"2d ago"`` (``"-"`` for none)."""
    if then is None:
        return "-"
    return f"{span((now - then).total_seconds())} ago"


#: The steps of :func:`span`: (below this many seconds, seconds per unit, unit, decimals).
_COMPACT = ((10.0, 1.0, "s", 1), (120.0, 1.0, "s", 0), (7200.0, 60.0, "m", 0))
_FIXED = ((1.0, 0.001, "ms", 0), (120.0, 1.0, "s", 1), (7200.0, 60.0, "m", 1))


def span(seconds: float | None, *, fixed: bool = False) -> str:
    """A short human duration: ``0.4s``, ``12s``, ``5m``, ``3h05m``, ``2d4h`` (``"-"`` for
    none). ``fixed``: one decimal in a single unit, for columns of figures side by side
    (``400ms``, ``20.0s``, ``5.5m``, ``3.1h``)."""
    if seconds is None:
        return "-"
    s = seconds if fixed else max(0.0, seconds)
    for below, per_unit, unit, decimals in _FIXED if fixed else _COMPACT:
        if s < below:
            return f"{s / per_unit:.{decimals}f}{unit}"
    if fixed:
        return f"{s / 3600:.1f}h"
    if s < 172800:
        return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
    return f"{int(s // 86400)}d{int(s % 86400 // 3600)}h"


def rate(value: float | None) -> str:
    """A fraction as a percentage: ``8.3%`` (``"-"`` for none)."""
    return "-" if value is None else f"{value:.1%}"


#: Columns of the per-task table of ``lease stats``.
TASK_HEADERS = (
    "TASK",
    "DONE",
    "FAILED",
    "CANCELLED",
    "P50",
    "P95",
    "P99",
    "MAX_RUNTIME",
    "LEASE_TTL",
    "PENDING",
    "OLDEST",
)


def task_rows(tasks: Sequence[TaskHealth]) -> list[tuple[str, ...]]:
    """One row per task name of ``lease stats``: finished, failure and cancel rates,
    run-time percentiles next to the task's limits, backlog."""
    return [
        (
            t.name,
            str(t.finished),
            rate(t.failure_rate),
            rate(t.cancel_rate),
            span(t.run_p50, fixed=True),
            span(t.run_p95, fixed=True),
            span(t.run_p99, fixed=True),
            span(t.max_runtime, fixed=True),
            span(t.lease_ttl, fixed=True),
            str(t.pending),
            span(t.oldest_pending_age, fixed=True),
        )
        for t in tasks
    ]


class Table:
    """Columns padded to width; the last column is cut to the terminal width on a tty."""

    def __init__(
        self, headers: Sequence[str], paint: dict[int, Callable[[str], str]], indent: int = 0
    ) -> None:
        self.headers = list(headers)
        self.rows: list[list[str]] = []
        self.paint = paint
        self.indent = indent

    def add(self, *cells: Any) -> None:
        self.rows.append(["-" if c is None or c == "" else str(c) for c in cells])

    def render(self, color: bool | None) -> None:
        widths = [len(h) for h in self.headers]
        for row in self.rows:
            widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
        last = None
        if sys.stdout.isatty():
            room = (
                shutil.get_terminal_size((120, 24)).columns
                - self.indent
                - sum(widths[:-1])
                - 2 * (len(widths) - 1)
            )
            last = max(room, len(self.headers[-1]), 12)

        def line(cells: list[str], header: bool) -> str:
            out = []
            for i, cell in enumerate(cells):
                if i == len(cells) - 1:
                    text = cell if last is None or len(cell) <= last else cell[: last - 1] + "…"
                else:
                    text = cell.ljust(widths[i])
                if header:
                    text = click.style(text, bold=True)
                elif i in self.paint:
                    text = self.paint[i](text)
                out.append(text)
            return " " * self.indent + "  ".join(out).rstrip()

        click.echo(line(self.headers, True), color=color)
        for row in self.rows:
            click.echo(line(row, False), color=color)


def _paint_state(text: str) -> str:
    try:
        state = State(text.strip())
    except ValueError:
        return text
    return click.style(text, fg=STATE_COLORS[state], bold=state is State.WAIT_MANUAL)
