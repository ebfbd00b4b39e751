"""celery-lease in a Celery worker, laid out by the process each part runs in.

``main/`` runs in the worker's main process, ``pool/`` in a pool process, and
:mod:`celery_lease.worker.protocol` is what they hand each other. A pool-process
module never imports a main-process one.

The worker's public names are handed on from :mod:`.main.bootstep` on first use, so
that importing a pool-process module does not start the main process's machinery.
"""

from __future__ import annotations

from typing import Any

_PUBLIC = ("BEAT_ENTRY", "LeaseStep", "LeasedRequest", "WorkerService", "install")


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        from .main import bootstep

        return getattr(bootstep, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_PUBLIC)
