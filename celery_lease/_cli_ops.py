"""What the operations commands print (``lease stats`` per task; pause; bulk actions),
kept apart from the command definitions: plain rows, no click."""

from __future__ import annotations

from collections.abc import Sequence

from .health import TaskHealth

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


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1:
        return f"{value * 1000:.0f}ms"
    if value < 120:
        return f"{value:.1f}s"
    if value < 7200:
        return f"{value / 60:.1f}m"
    return f"{value / 3600:.1f}h"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def task_rows(tasks: Sequence[TaskHealth]) -> list[tuple[str, ...]]:
    """One row per task name: finished, failure and cancel rates, run-time percentiles
    next to the task's limits, backlog."""
    return [
        (
            t.name,
            str(t.finished),
            _rate(t.failure_rate),
            _rate(t.cancel_rate),
            _seconds(t.run_p50),
            _seconds(t.run_p95),
            _seconds(t.run_p99),
            _seconds(t.max_runtime),
            _seconds(t.lease_ttl),
            str(t.pending),
            _seconds(t.oldest_pending_age),
        )
        for t in tasks
    ]
