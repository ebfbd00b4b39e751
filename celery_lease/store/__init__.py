"""Storage: the lease tables and the operations on them (SQLAlchemy Core)."""

from ._base import Listener, TransitionEvent, dumps
from ._bulk import Filter
from ._deadline import bounded_connection
from ._executor import Executor, Rows
from ._joined import JoinedTransaction, join_transaction, outbox_transaction
from ._outcomes import Outcome
from ._pauses import KINDS as PAUSE_KINDS
from ._pauses import Pause, PauseEvent
from ._producer import REOPENABLE, REPLACED, RESUBMITTED, JoinedSubmission
from ._reads import InvariantPage
from ._redact import redact
from ._retention import DUPLICATES_DROPPED, PURGED, REPUBLISHED
from ._steps import RecordedStep
from ._store import Store
from ._totals import Fold, Totals
from ._types import (
    Claim,
    Expiry,
    FenceResult,
    FollowUps,
    Lease,
    LeaseOptions,
    NewTask,
    Publishable,
    Refusal,
)
from .schema import SCHEMA_VERSION, Tables, build

__all__ = [
    "DUPLICATES_DROPPED",
    "PAUSE_KINDS",
    "PURGED",
    "REOPENABLE",
    "REPLACED",
    "REPUBLISHED",
    "RESUBMITTED",
    "SCHEMA_VERSION",
    "Claim",
    "Executor",
    "Expiry",
    "FenceResult",
    "Filter",
    "Fold",
    "FollowUps",
    "InvariantPage",
    "JoinedSubmission",
    "JoinedTransaction",
    "Lease",
    "LeaseOptions",
    "Listener",
    "NewTask",
    "Outcome",
    "Pause",
    "PauseEvent",
    "Publishable",
    "RecordedStep",
    "Refusal",
    "Rows",
    "Store",
    "Tables",
    "Totals",
    "TransitionEvent",
    "bounded_connection",
    "build",
    "dumps",
    "join_transaction",
    "outbox_transaction",
    "redact",
]
