"""celery-lease: crash-safe Celery tasks.

Add ``@app.task(base=LeasedTask)`` and each task gets a durable state row, an
optional dedup key, per-step checkpoints and a heartbeat lease; a reaper moves
tasks whose lease expired to a retry or to a person (WAIT_MANUAL).
"""

# the deprecated submodule ``admin`` first: importing it binds ``celery_lease.admin`` to
# the module, and the function must be bound after that, here, not by a later import
from . import admin as _first_name_of_operations  # noqa: F401
from ._runtime import install
from .exceptions import (
    ArgumentsTooLarge,
    CeleryLeaseDeprecationWarning,
    CeleryLeaseError,
    ConfigurationError,
    DuplicateStep,
    DuplicateSubmission,
    IllegalTransition,
    InvalidSubmission,
    InvalidSubmissionType,
    InvalidSubmissionValue,
    LeaseError,
    LeaseLost,
    MissingDependencyError,
    NotSerializable,
    SchemaOutOfDate,
    StoreDataError,
    StoreError,
    StoreUnavailable,
    SubmissionOutcomeUnknown,
    TaskCancelled,
    TaskFailed,
    TaskNotFound,
)
from .operations import Admin, Stats, admin
from .producer.submission import Submitted, bulk
from .reaper import ReapReport, reap
from .records import StepRecord, TaskRecord, TransitionRecord, WorkerRecord
from .states import TRANSITIONS, State
from .store import outbox_transaction
from .task import LeasedTask

__version__ = "0.1.0"

__all__ = [
    "TRANSITIONS",
    "Admin",
    "ArgumentsTooLarge",
    "CeleryLeaseDeprecationWarning",
    "CeleryLeaseError",
    "ConfigurationError",
    "DuplicateStep",
    "DuplicateSubmission",
    "IllegalTransition",
    "InvalidSubmission",
    "InvalidSubmissionType",
    "InvalidSubmissionValue",
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
    "StoreDataError",
    "StoreError",
    "StoreUnavailable",
    "SubmissionOutcomeUnknown",
    "Submitted",
    "TaskCancelled",
    "TaskFailed",
    "TaskNotFound",
    "TaskRecord",
    "TransitionRecord",
    "WorkerRecord",
    "__version__",
    "admin",
    "bulk",
    "install",
    "outbox_transaction",
    "reap",
]
