"""Flower integration: show lease fields on Flower's task pages.

celery-lease sends Celery task events for the transitions Celery cannot see
(``task-timeout``, ``task-wait-manual``, ``task-cancelled``, ...; see
:mod:`celery_lease.notify`). Flower shows their state as is (``TIMEOUT``,
``WAIT-MANUAL``, ``CANCELLED``) and the lease fields as a JSON object in the task's
*Result*. Put this in ``flowerconfig.py`` to get one row per lease field on the task
page, the lease's state name, and a one-line summary as the result::

    from celery_lease.contrib.flower import format_task

No import of Flower is needed: the helper only reads and sets attributes.
"""

from __future__ import annotations

import json
from typing import Any

#: Lease fields carried by celery-lease's task events, in display order.
LEASE_FIELDS = (
    "lease_state",
    "lease_reason",
    "lease_attempt",
    "lease_actor",
    "lease_from",
    "lease_hint",
)

#: Flower shows an event type's upper-cased suffix as the state; the lease's own name
#: reads better (``task-wait-manual`` -> ``WAIT-MANUAL`` -> ``WAIT_MANUAL``).
_STATE_NAMES = {"WAIT-MANUAL": "WAIT_MANUAL"}
#: States Flower shows from celery-lease's own events.
_LEASE_STATES = frozenset({"TIMEOUT", "WAIT-MANUAL", "WAIT_MANUAL", "CANCELLED"})


def lease_fields(task: Any) -> dict[str, Any] | None:
    """The lease fields of a Flower task: its ``lease_*`` attributes (a task straight
    from ``celery.events.state.State``) or the JSON object celery-lease put in its
    result (Flower's copy of it). ``None`` for a task without lease events."""
    if getattr(task, "lease_state", None) is not None:
        return {f: getattr(task, f, None) for f in (*LEASE_FIELDS, "lease_at")}
    return _from_json(getattr(task, "result", None))


def _from_json(result: Any) -> dict[str, Any] | None:
    if isinstance(result, str) and result.startswith('{"lease_state"'):
        try:
            data = json.loads(result)
        except ValueError:
            return None
        if isinstance(data, dict):
            return data
    return None


def format_task(task: Any) -> Any:
    """Flower's ``format_task`` hook: add the lease fields of ``task`` to its page.

    Flower passes a copy of a :class:`celery.events.state.Task`; the copy gets a row
    per lease field (appended to its ``_fields``, which the task page lists), the
    lease's state name, and a one-line summary as its result (the task list shows that
    column). Tasks without lease events are returned as they are.
    """
    lease = lease_fields(task)
    if lease is None or not lease.get("lease_state"):
        return task
    for name in LEASE_FIELDS:
        setattr(task, name, lease.get(name))
    state = getattr(task, "state", None)
    if isinstance(state, str) and state in _STATE_NAMES:
        task.state = _STATE_NAMES[state]
    elif state not in _LEASE_STATES and _newer(lease.get("lease_at"), task):
        # Celery's state precedence keeps FAILURE (reported by a worker without the
        # lease's service) over any later custom state; the lease's decision came after it
        task.state = lease["lease_state"]
    fields = tuple(getattr(task, "_fields", ()))
    task._fields = fields + tuple(f for f in LEASE_FIELDS if f not in fields)
    result = getattr(task, "result", None)
    if result is None or _from_json(result) is not None:
        task.result = summary(lease)
    return task


def _newer(lease_at: Any, task: Any) -> bool:
    timestamp = getattr(task, "timestamp", None)
    try:
        return lease_at is not None and (timestamp is None or float(lease_at) > float(timestamp))
    except (TypeError, ValueError):
        return False


def summary(lease: dict[str, Any]) -> str:
    """``"WAIT_MANUAL: outcome of step 'charge' unknown (attempt 2) -- celery -A ..."``."""
    text = f"{lease.get('lease_state')}: {lease.get('lease_reason') or 'no reason given'}"
    attempt = lease.get("lease_attempt")
    if attempt is not None:
        text += f" (attempt {attempt})"
    hint = lease.get("lease_hint")
    if hint:
        text += f" -- {hint}"
    return text


__all__ = ["LEASE_FIELDS", "format_task", "lease_fields", "summary"]
