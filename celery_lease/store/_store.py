"""The store: domain operations on the lease tables.

Every state change goes through :meth:`Store._move`: one conditional UPDATE
(compare-and-set on the current state, plus the caller's fence) and the audit
rows, in one transaction. Zero rows updated is a result the caller handles.

The operations live in one mixin per job; this module assembles them.
"""

from __future__ import annotations

from ._backlog import BacklogMixin
from ._base import StoreBase
from ._bulk import BulkMixin
from ._claim import ClaimMixin
from ._claim_many import ClaimManyMixin
from ._expiry import ExpiryMixin
from ._follow_ups import FollowUpsMixin
from ._health import HealthMixin
from ._operator import OperatorMixin
from ._outcome import OutcomeMixin
from ._outcomes import OutcomesMixin
from ._pauses import PausesMixin
from ._producer import ProducerMixin
from ._publishing import PublishingMixin
from ._retention import RetentionMixin
from ._setup import SetupMixin
from ._steps import StepsMixin
from ._submit_many import SubmitManyMixin
from ._totals import TotalsMixin
from ._workers import WorkersMixin


class Store(
    OutcomesMixin,
    PublishingMixin,
    ExpiryMixin,
    FollowUpsMixin,
    OutcomeMixin,
    ClaimManyMixin,
    ClaimMixin,
    SubmitManyMixin,
    ProducerMixin,
    SetupMixin,
    StepsMixin,
    WorkersMixin,
    BulkMixin,
    OperatorMixin,
    RetentionMixin,
    HealthMixin,
    PausesMixin,
    BacklogMixin,
    TotalsMixin,
    StoreBase,
):
    """Domain operations on the lease tables of one database (thread-safe; fork-safe)."""
