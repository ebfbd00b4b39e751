"""celery-lease in a Celery worker, laid out by the process each part runs in.

``main/`` runs in the worker's main process, ``pool/`` in a pool process, and
:mod:`celery_lease.worker.protocol` is what they hand each other. A pool-process
module never imports a main-process one.

The worker's public names are handed on from ``main/`` on first use, so that
importing a pool-process module does not load the main process's machinery.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any


def __getattr__(name: str) -> Any:
    module: ModuleType
    if name in ("BEAT_ENTRY", "LeaseStep", "install"):
        from .main import bootstep as module
    elif name == "LeasedRequest":
        from .main import request as module
    elif name == "WorkerService":
        from .main import service as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(module, name)


__all__ = ["BEAT_ENTRY", "LeaseStep", "LeasedRequest", "WorkerService", "install"]
