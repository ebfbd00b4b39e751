"""The :class:`State` enum on its own, below the exception hierarchy.

:class:`~celery_lease.IllegalTransition` names the states it was refused between, and
:mod:`celery_lease.states` raises it: both import the enum from here, so neither
imports the other's module back. Import it from :mod:`celery_lease.states`.
"""

from __future__ import annotations

import enum


class State(str, enum.Enum):
    """Lifecycle state of a leased task (stored as its name)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    RETRY_WAIT = "RETRY_WAIT"
    TIMEOUT = "TIMEOUT"
    WAIT_MANUAL = "WAIT_MANUAL"
    CANCELLED = "CANCELLED"

    def __str__(self) -> str:
        return self.value
