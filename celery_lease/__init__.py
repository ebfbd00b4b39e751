"""celery-lease: crash-safe Celery tasks.

Add ``@app.task(base=LeasedTask)`` and each task gets a durable state row, an
optional dedup key, per-step checkpoints and a heartbeat lease; a reaper moves
tasks whose lease expired to a retry or to a person (WAIT_MANUAL).
"""

from ._execution import DuplicateStep
from ._outbox import outbox_transaction
from .admin import Admin, Stats, admin
from .exceptions import (
    CeleryLeaseError,
    ConfigurationError,
    IllegalTransition,
    LeaseError,
    LeaseLost,
    MissingDependencyError,
    NotSerializable,
    SchemaOutOfDate,
    StoreError,
    StoreUnavailable,
    TaskCancelled,
    TaskFailed,
    TaskNotFound,
)
from .reaper import ReapReport, reap
from .records import StepRecord, TaskRecord, TransitionRecord, WorkerRecord
from .states import TRANSITIONS, State
from .task import LeasedTask
from .worker import install

__version__ = "0.1.0"

__all__ = [
    "TRANSITIONS",
    "Admin",
    "CeleryLeaseError",
    "ConfigurationError",
    "DuplicateStep",
    "IllegalTransition",
    "LeaseError",
    "LeaseLost",
    "LeasedTask",
    "MissingDependencyError",
    "NotSerializable",
    "ReapReport",
    "SchemaOutOfDate",
    "State",
    "Stats",
    "StepRecord",
    "StoreError",
    "StoreUnavailable",
    "TaskCancelled",
    "TaskFailed",
    "TaskNotFound",
    "TaskRecord",
    "TransitionRecord",
    "WorkerRecord",
    "__version__",
    "admin",
    "install",
    "outbox_transaction",
    "reap",
]
