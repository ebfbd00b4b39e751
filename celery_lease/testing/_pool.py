"""Celery's prefork pool, looking for dead pool processes every half second.

Celery notices a pool process that died only when its pool maintenance runs, every
5 s, so each crash a test causes would cost up to 5 s of waiting. This pool is
Celery's own (same class, same behaviour) with a shorter maintenance interval; the
kit's workers use it when asked for ``prefork``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery.concurrency.asynpool import AsynPool
from celery.concurrency.prefork import TaskPool as PreforkTaskPool

#: Seconds between two pool maintenance rounds (Celery's default: 5).
MAINTAIN_INTERVAL = 0.5

#: ``CELERY_CUSTOM_WORKER_POOL`` of a ``prefork`` worker the kit starts (``-P custom``).
PREFORK = "celery_lease.testing._pool:TaskPool"


class _AsynPool(AsynPool):
    @property
    def timers(self) -> dict[Callable[..., Any], float]:
        return {self.maintain_pool: MAINTAIN_INTERVAL}


class TaskPool(PreforkTaskPool):
    """The prefork pool with :data:`MAINTAIN_INTERVAL`."""

    Pool = _AsynPool
