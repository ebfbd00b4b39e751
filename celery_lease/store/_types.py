"""The values the store and its callers exchange: plain, frozen, no I/O.

What a caller hands in (a row to insert, a lease, an outcome, a filter) and what it
gets back (a claim or a refusal, rows to publish, expiries, records of the health
figures, totals), and the executor protocol a caller's own connection implements.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import Executable, Row

from ..states import State


@dataclasses.dataclass(frozen=True)
class TransitionEvent:
    """A committed state change, handed to the store's listeners after the commit."""

    task_id: str
    name: str | None
    from_state: State | None
    to_state: State
    reason: str
    actor: str
    attempt: int


#: Called once per committed transaction with the transitions it made.
Listener = Callable[[Sequence[TransitionEvent]], None]


@dataclasses.dataclass(frozen=True)
class LeaseOptions:
    """A task's lease options with the app's defaults applied and checked (one value
    per task class and configuration, reused by every submission and delivery)."""

    lease_ttl: float
    max_recoveries: int
    max_runtime: float | None = None
    max_retries: int | None = None
    on_timeout: str = "retry"
    on_exhausted: str = "fail"
    #: At most this many attempts RUNNING at once across all workers (per concurrency
    #: key when the task has one); ``0``: a ``global_rate_limit`` only; ``None``: no
    #: limit of either kind (the claim may then be made ahead).
    concurrency_limit: int | None = None


@dataclasses.dataclass(frozen=True)
class Slot:
    """What a limited task's claim counts under: its task name, its concurrency key
    (``""``: the task's one global limit), the limit its code gives (``0``: no
    concurrency limit, a rate limit only) and the seconds between two starts its
    ``global_rate_limit`` gives (``None``: no rate limit)."""

    name: str
    key: str
    limit: int
    interval: float | None = None

    def label(self) -> str:
        """``send_report[tenant=42]``, or the name alone for a global limit."""
        return f"{self.name}[{self.key}]" if self.key else self.name


@dataclasses.dataclass(frozen=True)
class SlotUsage:
    """One limited task and key: its limit (as its last claim gave it), the slots in
    use (``running``: RUNNING rows and overruns still running; ``granted``: rows granted
    a slot, not claimed yet), the rows waiting, and since when the oldest has been
    submitted (database time)."""

    name: str
    key: str
    limit: int
    running: int
    granted: int
    waiting: int
    oldest_waiting_at: datetime | None
    #: Seconds since the oldest waiting row was submitted (database time).
    oldest_waiting_age: float | None

    def label(self) -> str:
        return f"{self.name}[{self.key}]" if self.key else self.name


@dataclasses.dataclass(frozen=True)
class Waiting:
    """A PENDING row waiting for a concurrency slot (``lease list --waiting``)."""

    id: str
    name: str
    key: str
    created_at: datetime
    reason: str | None


@dataclasses.dataclass(frozen=True)
class NewTask:
    """A row to insert when a task is submitted (JSON columns already encoded)."""

    id: str
    name: str
    args: str | None
    kwargs: str | None
    options: str | None
    lease_ttl: float
    max_recoveries: int
    dedup_key: str | None = None
    countdown: float | None = None
    eta: datetime | None = None
    max_runtime: float | None = None
    max_retries: int | None = None
    on_timeout: str = "retry"
    on_exhausted: str = "fail"
    #: The message Celery built for the task (see ``celery_lease.producer.message``).
    message: str | None = None
    #: A second publication of a message already submitted once (a follow-up sent
    #: again after a crash), not a new submission: a row with its id, even finished,
    #: is this task (see ``Store.submit``).
    resend: bool = False
    #: Written and not published: its ETA is far ahead (``lease_hold_eta_after``); the
    #: reaper publishes the stored message when it is due.
    held: bool = False

    @classmethod
    def of(
        cls,
        lease: LeaseOptions,
        *,
        id: str,
        name: str,
        args: str | None,
        kwargs: str | None,
        options: str | None,
        dedup_key: str | None = None,
        countdown: float | None = None,
        eta: datetime | None = None,
        message: str | None = None,
        resend: bool = False,
        held: bool = False,
    ) -> NewTask:
        """The row of a task submitted with ``lease`` options."""
        return cls(
            id=id,
            name=name,
            args=args,
            kwargs=kwargs,
            options=options,
            lease_ttl=lease.lease_ttl,
            max_recoveries=lease.max_recoveries,
            dedup_key=dedup_key,
            countdown=countdown,
            eta=eta,
            max_runtime=lease.max_runtime,
            max_retries=lease.max_retries,
            on_timeout=lease.on_timeout,
            on_exhausted=lease.on_exhausted,
            message=message,
            resend=resend,
            held=held,
        )


#: What a submission whose ``dedup_key`` is held does (``Unique.on_conflict``).
ON_CONFLICT = ("return", "raise", "replace")


@dataclasses.dataclass(frozen=True)
class Unique:
    """When a submission's ``dedup_key`` deduplicates, and what a duplicate does.

    The row holding the key deduplicates while it was created less than ``unique_for``
    seconds ago (database time; ``None``: for ever) and its state is one of
    ``unique_while`` (``None``: any). Otherwise the key is taken from it (its
    ``dedup_key`` set to NULL, in the transaction that inserts the new row).
    """

    unique_for: float | None = None
    unique_while: frozenset[State] | None = None
    on_conflict: str = "return"

    @property
    def plain(self) -> bool:
        """Today's dedup key: held until the row is purged, a duplicate returned."""
        return (
            self.unique_for is None and self.unique_while is None and self.on_conflict == "return"
        )


@dataclasses.dataclass(frozen=True)
class Replacement:
    """What ``on_conflict="replace"`` writes into the PENDING row it replaces: the new
    submission's arguments and a message built for the existing task id, carrying
    ``revision`` (a message without it, sent before, is refused at claim)."""

    args: str | None
    kwargs: str | None
    options: str | None
    message: str | None
    revision: str
    countdown: float | None = None
    eta: datetime | None = None


@dataclasses.dataclass(frozen=True)
class UniqueAnswer:
    """What a submission with uniqueness options became."""

    #: The new task's id, or the existing one's.
    task_id: str
    #: ``"created"``, ``"duplicate"`` (the existing task holds the key; nothing written)
    #: or ``"replaced"`` (the existing PENDING task now has the new arguments).
    outcome: str
    #: The existing task's state, for a duplicate.
    state: State | None = None


@dataclasses.dataclass(frozen=True)
class Lease:
    """One execution's hold on a task: every later write of it is fenced by these."""

    task_id: str
    attempt: int
    token: str


@dataclasses.dataclass(frozen=True)
class Claim:
    """A successful claim: the caller now runs attempt ``lease.attempt``."""

    lease: Lease
    retries: int
    recoveries: int
    #: Steps may exist from an earlier attempt (or the row was adopted).
    resumed: bool
    cancel_requested: bool


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A failed claim: a duplicate or stale delivery to drop without running."""

    task_id: str
    state: State | None
    why: str
    #: The row is PENDING but its ETA (database time) has not come: publish it again.
    early: bool = False
    #: The row is PENDING and waits for a concurrency slot (recorded in the row): the
    #: delivery is acked; the row is published again when a slot frees.
    waiting: bool = False
    #: The row is PENDING and paced by its task's global rate limit: a later start was
    #: reserved for it (its ETA). Not held: publish it again (it is due then); held:
    #: the reaper publishes it when due.
    paced: bool = False
    held: bool = False


@dataclasses.dataclass(frozen=True)
class Publishable:
    """A PENDING row to (re-)publish."""

    id: str
    name: str
    args: str | None
    kwargs: str | None
    options: str | None
    retries: int
    #: Seconds from now (database time) until the row's ETA, if in the future.
    countdown: float | None
    #: The stored message (``None``: a row written before messages were stored).
    message: str | None = None
    #: The broker of the row's app (``None``: not recorded): only that app publishes it.
    origin: str | None = None


@dataclasses.dataclass(frozen=True)
class Held:
    """A PENDING row held in the store until its ETA (``lease list --scheduled``)."""

    id: str
    name: str
    #: When it is due (database time); the reaper publishes it then.
    eta: datetime | None
    created_at: datetime


@dataclasses.dataclass(frozen=True)
class FollowUps:
    """A SUCCEEDED row whose recorded follow-ups are still to be published."""

    id: str
    name: str
    #: The stored message: its chain, ``link`` callbacks and chord are the follow-ups.
    message: str | None
    #: The stored result (JSON), which each follow-up is given.
    result: str | None
    retries: int


@dataclasses.dataclass(frozen=True)
class Expiry:
    """What happened to one expired lease."""

    task_id: str
    to_state: State
    reason: str


@dataclasses.dataclass(frozen=True)
class FenceResult:
    """The answer of a fenced progress write."""

    cancel_requested: bool
    cancel_reason: str | None


@dataclasses.dataclass(frozen=True)
class Peer:
    """Another live incarnation under the same node name (see ``Store.peers``)."""

    id: str
    hostname: str
    pid: int
    #: Seconds since its last heartbeat (database time).
    heartbeat_age: float
    #: Its last heartbeat as the database stores it (to see whether it moves).
    heartbeat_at: Any


@dataclasses.dataclass(frozen=True)
class RecordedStep:
    """A step as a re-run finds it."""

    state: str
    result: str | None
    attempt: int


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One execution's own outcome, as :meth:`Store.finish` takes it."""

    lease: Lease
    to: State
    reason: str
    result: str | None = None
    error: str | None = None
    #: A retry (``to`` RETRY_WAIT): seconds until it is due, and its message as Celery
    #: built it (stored in the row, its outbox).
    delay: float = 0.0
    message: str | None = None
    #: A retry due far ahead (``lease_hold_eta_after``): kept in the row, not published
    #: by its worker; the reaper's held sweep publishes it when due.
    held: bool = False


@dataclasses.dataclass(frozen=True)
class JoinedSubmission:
    """A row written in a caller's open transaction (see ``Store.submit_joined``)."""

    task_id: str
    #: ``False``: a row with that id or dedup key existed; nothing was written.
    created: bool
    #: To hand to ``Store.announce`` once the caller's transaction committed.
    events: tuple[TransitionEvent, ...]


@dataclasses.dataclass(frozen=True)
class Filter:
    """Which tasks a bulk action takes; every field given must match."""

    state: State | None = None
    name: str | None = None
    #: Text the row's last reason contains (case-sensitive substring).
    reason_contains: str | None = None
    #: The owner of the latest attempt: a worker's node name or incarnation id.
    worker: str | None = None
    #: Seconds since the task was submitted, at least.
    older_than: float | None = None

    def is_empty(self) -> bool:
        return all(getattr(self, f.name) is None for f in dataclasses.fields(self))


@dataclasses.dataclass(frozen=True)
class Selected:
    """One row a filter selected, as it was when read."""

    id: str
    name: str
    state: State
    reason: str | None
    created_at: datetime
    has_args: bool


@dataclasses.dataclass(frozen=True)
class Pause:
    """A queue or task name paused now."""

    kind: str
    target: str
    actor: str
    reason: str
    paused_at: datetime


@dataclasses.dataclass(frozen=True)
class PauseEvent:
    """One pause or resume, from the pauses' audit log."""

    kind: str
    target: str
    action: str
    actor: str
    reason: str
    at: datetime


@dataclasses.dataclass(frozen=True)
class Finished:
    """Tasks of one name that finished in one state within the window."""

    name: str
    state: State
    count: int


@dataclasses.dataclass(frozen=True)
class Runtime:
    """One recent run: its duration and the limits its row carried."""

    name: str
    seconds: float
    max_runtime: float | None
    lease_ttl: float


@dataclasses.dataclass(frozen=True)
class Backlog:
    """PENDING rows of one task name and how long the oldest has waited."""

    name: str
    pending: int
    oldest_age: float


@dataclasses.dataclass(frozen=True)
class InvariantPage:
    """What the invariant checker reads of one page of tasks, in one snapshot.

    ``tasks`` rows carry the task's own columns (``id``, ``state``, ``attempt``,
    ``token``, ``owner``, ``reason``), the owner's ``nodename`` and one boolean per
    liveness deadline passed (``dead_owner``, ``unpublished``, ``republish_overdue``,
    ``held_overdue``, ``retry_overdue``, ``stuck_timeout``, ``follow_ups_overdue``); ``audits`` and
    ``steps`` are the pages' audit and step rows, ordered by task."""

    tasks: list[Row[Any]]
    audits: list[Row[Any]]
    steps: list[Row[Any]]


_Pair = tuple[str | None, str]


@dataclasses.dataclass(frozen=True)
class Fold:
    """What one fold did (see :meth:`Store.fold_transitions`)."""

    #: Audit rows added to the totals.
    rows: int
    #: The watermark after the fold.
    upto: int
    #: Settled rows above the watermark remain: fold again.
    more: bool
    #: Another reaper held the watermark: this one did nothing (``upto`` is then 0).
    held: bool = False


@dataclasses.dataclass(frozen=True)
class Totals:
    """Transition counts as of one snapshot (see :meth:`Store.transition_totals`)."""

    #: Audit rows by ``(from_state, to_state)`` (``from_state`` ``None``: a creation):
    #: the folded totals plus the rows counted above the watermark.
    counts: dict[_Pair, int]
    #: The watermark: every audit row up to this id is in the folded totals.
    upto: int
    #: Audit ids up to this one are counted (the watermark plus the tail read).
    counted_upto: int
    #: The highest audit id (0: no audit row).
    top: int

    @property
    def lag(self) -> int:
        """Audit ids above the watermark: what the reaper has yet to fold (ids, so a
        sequence's gaps make it an upper bound on rows)."""
        return max(0, self.top - self.upto)

    @property
    def uncounted(self) -> int:
        """Audit ids above what this read counted (0 unless the tail was capped)."""
        return max(0, self.top - self.counted_upto)


class Rows(Protocol):
    """What the store reads of an executed statement (a SQLAlchemy ``Result`` has it)."""

    @property
    def rowcount(self) -> int:
        """Rows the statement matched (an UPDATE or DELETE)."""
        ...

    def scalar(self) -> Any:
        """The first column of the first row, or ``None`` when there is no row."""
        ...

    def first(self) -> Any:
        """The first row (its columns by position and by name), or ``None``."""
        ...

    def all(self) -> Sequence[Any]:
        """Every row."""
        ...


class Executor(Protocol):
    """Runs one statement with its bind parameters, in whatever transaction it is in.

    ``statement`` is built by the store with bind parameters (``bindparam("b_id")``)
    that ``parameters`` fills by name; the executor never commits or rolls back.
    """

    def execute(
        self, statement: Executable, parameters: Mapping[str, Any] | None = None, /
    ) -> Rows: ...
