"""Plain values exchanged between the store and its callers."""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from ..states import State


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
    #: The message Celery built for the task (see ``celery_lease._message``).
    message: str | None = None
    #: A second publication of a message already submitted once (a follow-up sent
    #: again after a crash), not a new submission: a row with its id, even finished,
    #: is this task (see ``Store.submit``).
    resend: bool = False

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
        )


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
