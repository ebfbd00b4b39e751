"""The operator API under its first name: see :mod:`celery_lease.operations`."""

from .operations import (
    CANCELLABLE,
    PURGEABLE,
    PURGEABLE_DEFAULT,
    STATS_WINDOW,
    Admin,
    Stats,
    TaskHealth,
    admin,
    parse_state,
    percentile,
)

__all__ = [
    "CANCELLABLE",
    "PURGEABLE",
    "PURGEABLE_DEFAULT",
    "STATS_WINDOW",
    "Admin",
    "Stats",
    "TaskHealth",
    "admin",
    "parse_state",
    "percentile",
]
