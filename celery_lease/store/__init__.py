"""Storage: the lease tables and the operations on them (SQLAlchemy Core)."""

from ._base import Listener, TransitionEvent, dumps
from ._reads import InvariantPage, TransitionCounts
from ._retention import DUPLICATES_DROPPED, PURGED, REPUBLISHED
from ._steps import RecordedStep
from ._store import Store
from ._types import Claim, Expiry, FenceResult, Lease, NewTask, Publishable, Refusal
from .schema import SCHEMA_VERSION, Tables, build

__all__ = [
    "DUPLICATES_DROPPED",
    "PURGED",
    "REPUBLISHED",
    "SCHEMA_VERSION",
    "Claim",
    "Expiry",
    "FenceResult",
    "InvariantPage",
    "Lease",
    "Listener",
    "NewTask",
    "Publishable",
    "RecordedStep",
    "Refusal",
    "Store",
    "Tables",
    "TransitionCounts",
    "TransitionEvent",
    "build",
    "dumps",
]
