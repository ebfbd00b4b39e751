"""Storage: the lease tables and the operations on them (SQLAlchemy Core)."""

from ._base import Listener, TransitionEvent, dumps
from ._outcomes import Outcome
from ._pauses import KINDS as PAUSE_KINDS
from ._pauses import Pause, PauseEvent
from ._reads import InvariantPage
from ._retention import DUPLICATES_DROPPED, PURGED, REPUBLISHED
from ._steps import RecordedStep
from ._store import Store
from ._totals import Fold, Totals
from ._types import Claim, Expiry, FenceResult, Lease, NewTask, Publishable, Refusal
from .schema import SCHEMA_VERSION, Tables, build

__all__ = [
    "DUPLICATES_DROPPED",
    "PAUSE_KINDS",
    "PURGED",
    "REPUBLISHED",
    "SCHEMA_VERSION",
    "Claim",
    "Expiry",
    "FenceResult",
    "Fold",
    "InvariantPage",
    "Lease",
    "Listener",
    "NewTask",
    "Outcome",
    "Pause",
    "PauseEvent",
    "Publishable",
    "RecordedStep",
    "Refusal",
    "Store",
    "Tables",
    "Totals",
    "TransitionEvent",
    "build",
    "dumps",
]
