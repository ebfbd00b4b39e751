"""What an incident needs from the operator API: durable pauses (this module) and
bulk actions (:mod:`._bulk`). Mixed into :class:`~celery_lease.admin.Admin`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._runtime import default_actor
from .pause import KINDS, Pause, PauseEvent

if TYPE_CHECKING:
    from celery import Celery

    from .store import Store


def _reason(reason: str) -> str:
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError("a reason is required: say why, it goes into the audit trail")
    return reason.strip()


def _target(queue: str | None, task: str | None) -> tuple[str, str]:
    if (queue is None) == (task is None):
        raise ValueError("name exactly one of queue= or task=")
    kind, target = ("queue", queue) if queue is not None else ("task", task)
    assert target is not None and kind in KINDS
    if not target.strip():
        raise ValueError(f"the {kind} name must not be empty")
    return kind, target.strip()


class PauseOps:
    """Durable pauses per queue and per task name (see :mod:`celery_lease.pause`)."""

    app: Celery

    @property
    def store(self) -> Store:  # provided by Admin
        raise NotImplementedError

    def pause(
        self,
        *,
        queue: str | None = None,
        task: str | None = None,
        reason: str,
        actor: str | None = None,
    ) -> bool:
        """Pause a queue (workers stop consuming it) or a task name (its deliveries are
        not run, and are published again after the pause), within a heartbeat interval,
        until :meth:`resume`. ``False``: it was already paused."""
        kind, target = _target(queue, task)
        who = actor or default_actor()
        return self.store.pause(kind, target, actor=who, reason=_reason(reason))

    def resume(
        self,
        *,
        queue: str | None = None,
        task: str | None = None,
        reason: str,
        actor: str | None = None,
    ) -> bool:
        """End a pause; the deliveries held by a task pause are published again now.
        ``False``: it was not paused."""
        kind, target = _target(queue, task)
        who = actor or default_actor()
        resumed = self.store.resume(kind, target, actor=who, reason=_reason(reason))
        if resumed and kind == "task":
            from .reaper import Reaper

            # held rows are unpublished PENDING rows: one sweep publishes them now
            # (more than a sweep's worth: the next sweeps go on)
            Reaper(self.app, actor=f"admin:{who}", store=self.store).sweep()
        return resumed

    def pauses(self) -> list[Pause]:
        """Everything paused now, oldest first."""
        return self.store.pauses()

    def pause_history(self, limit: int = 100) -> list[PauseEvent]:
        """Every pause and resume, newest first, with who and why."""
        if limit < 1:
            raise ValueError("limit must be at least 1")
        return self.store.pause_history(limit=limit)
