"""Deprecated: the operator API's first module name. Import from :mod:`celery_lease`
(``admin``, ``Admin``, ``Stats``) or :mod:`celery_lease.operations`."""

from __future__ import annotations

import warnings
from typing import Any

from . import operations
from .exceptions import CeleryLeaseDeprecationWarning


def __getattr__(name: str) -> Any:
    if name not in operations.__all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"celery_lease.admin is deprecated: import {name} from celery_lease.operations "
        "(admin, Admin and Stats also from celery_lease)",
        CeleryLeaseDeprecationWarning,
        stacklevel=2,
    )
    return getattr(operations, name)
