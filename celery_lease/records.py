"""Read-only records returned by the operator API."""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from kombu.utils.json import loads as json_loads

from .states import State


@dataclasses.dataclass(frozen=True)
class TaskRecord:
    """One leased task as stored (``admin(app).get(task_id)``)."""

    id: str
    name: str
    state: State
    attempt: int
    recoveries: int
    retries: int
    dedup_key: str | None
    #: Incarnation id of the worker that ran (or runs) the latest attempt.
    owner: str | None
    created_at: datetime
    started_at: datetime | None
    #: Last heartbeat of the owner's worker (leases are renewed per worker, not per task).
    heartbeat_at: datetime | None
    finished_at: datetime | None
    next_retry_at: datetime | None
    result: Any
    error: str | None
    reason: str | None = None
    args: Any = None
    kwargs: Any = None
    options: Any = None
    eta: datetime | None = None
    published_at: datetime | None = None
    progress_at: datetime | None = None
    progress: Any = None
    lease_ttl: float | None = None
    max_runtime: float | None = None
    max_retries: int | None = None
    on_timeout: str | None = None
    on_exhausted: str | None = None
    max_recoveries: int | None = None
    owner_node: str | None = None
    cancel_requested_at: datetime | None = None
    cancel_actor: str | None = None
    cancel_reason: str | None = None
    #: The message Celery built for the task, as stored (JSON text).
    message: str | None = None
    #: A SUCCEEDED task's follow-ups (chain, ``link`` callbacks, chord part-return) were
    #: recorded with its outcome and are not yet published: since when (``None``: none
    #: left; the reaper publishes them after ``lease_publish_grace``).
    follow_ups_at: datetime | None = None

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict (times as ISO 8601)."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, datetime):
                value = value.isoformat()
            elif isinstance(value, State):
                value = value.value
            out[field.name] = value
        return out


@dataclasses.dataclass(frozen=True)
class TransitionRecord:
    """One audit row: a state change with who made it and why."""

    from_state: State | None
    to_state: State
    reason: str | None
    actor: str
    attempt: int
    at: datetime


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One recorded step of a task."""

    name: str
    state: str
    idempotent: bool
    attempt: int
    result: Any
    started_at: datetime
    finished_at: datetime | None


@dataclasses.dataclass(frozen=True)
class WorkerRecord:
    """One worker incarnation (a fresh id per start)."""

    id: str
    nodename: str
    hostname: str
    pid: int
    started_at: datetime
    heartbeat_at: datetime
    stopped_at: datetime | None
    stop_reason: str | None
    alive: bool
    running: int


def loads(value: str | None) -> Any:
    """Decode a stored JSON column (``None`` stays ``None``); arguments written by
    Celery's JSON encoder come back typed (datetimes, UUIDs, decimals, bytes)."""
    return None if value is None else json_loads(value)
