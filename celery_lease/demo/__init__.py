"""``python -m celery_lease.demo``: watch celery-lease recover from real crashes.

The project is a real module, :mod:`celery_lease.demo.app`; the scenario and its
report are in :mod:`celery_lease.demo._run`. The workers are started, killed and
watched with celery-lease's testing kit (:mod:`celery_lease.testing`).
"""

from ._run import main

__all__ = ["main"]
