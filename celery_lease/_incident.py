"""What an incident needs from the operator API: durable pauses and bulk actions.
Mixed into :class:`~celery_lease.operations.Admin`."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from ._runtime import default_actor
from .exceptions import IllegalTransition, TaskNotFound
from .pause import KINDS, Pause, PauseEvent
from .states import State, parse_state
from .store import Filter
from .worker.pool.execution import encode

if TYPE_CHECKING:
    from celery import Celery

    from .store import Store


def _reason(reason: str) -> str:
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError("a reason is required: say why, it goes into the audit trail")
    return reason.strip()


def _encode_result(result: Any) -> str | None:
    return encode("resolve result", result)


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


#: Tasks one bulk action takes at most when no ``limit`` is given.
MAX_BULK = 1_000_000

#: Bulk actions and the state each one moves a task to.
BULK_TARGETS: dict[str, State] = {
    "retry": State.PENDING,
    "fail": State.FAILED,
    "resolve": State.SUCCEEDED,
    "cancel": State.CANCELLED,
}


@dataclasses.dataclass(frozen=True)
class BulkChange:
    """One task a bulk action changed (or, in a dry run, would change)."""

    id: str
    name: str
    from_state: State
    #: The state it moves to; a RUNNING task cancelled stays RUNNING with a request.
    to_state: State
    requested: bool = False


@dataclasses.dataclass(frozen=True)
class BulkRefusal:
    """The first selected task the transition table refuses: the action stopped there."""

    id: str
    name: str
    state: State | None
    why: str


@dataclasses.dataclass(frozen=True)
class BulkResult:
    """What a bulk action did (``dry_run``: what it would do), in order."""

    action: str
    dry_run: bool
    changed: list[BulkChange]
    #: Where it stopped, if it did; everything before it is done (or would be).
    refused: BulkRefusal | None
    #: Transactions committed (0 in a dry run).
    batches: int

    def as_dict(self) -> dict[str, Any]:
        plain: dict[str, Any] = json.loads(json.dumps(dataclasses.asdict(self), default=str))
        return plain


class BulkOps:
    """Operator actions over every task a filter selects, in batched transactions."""

    app: Celery

    @property
    def store(self) -> Store:  # provided by Admin
        raise NotImplementedError

    def bulk(
        self,
        action: str,
        *,
        reason: str,
        state: State | str | None = None,
        name: str | None = None,
        reason_contains: str | None = None,
        worker: str | None = None,
        older_than: float | None = None,
        actor: str | None = None,
        result: Any = None,
        dry_run: bool = False,
        batch: int = 100,
        limit: int | None = None,
    ) -> BulkResult:
        """Apply ``action`` (``retry``, ``fail``, ``resolve`` or ``cancel``) to every
        task the filters select, oldest first, ``batch`` tasks per transaction.

        The first task the transition table refuses (a state the action does not apply
        to, or a task that changed meanwhile) stops the action: the tasks before it are
        done, it and the rest are left as they are, and the result says which and why.
        ``dry_run`` changes nothing and reports what would change and where it would
        stop. ``reason`` is required; at least one filter is, too. ``limit`` caps the
        tasks taken."""
        from .producer import publisher as _publisher
        from .states import action_sources

        if action not in BULK_TARGETS:
            raise ValueError(f"unknown action {action!r}: one of {', '.join(BULK_TARGETS)}")
        why = _reason(reason)
        if batch < 1 or (limit is not None and limit < 1):
            raise ValueError("batch and limit must be at least 1")
        if older_than is not None and older_than < 0:
            raise ValueError("older_than must be a number of seconds >= 0")
        where = Filter(
            state=None if state is None else parse_state(state),
            name=name,
            reason_contains=reason_contains or None,
            worker=worker,
            older_than=older_than,
        )
        if where.is_empty():
            raise ValueError(
                "a bulk action needs at least one filter (state, name, reason text, worker or age)"
            )
        to = BULK_TARGETS[action]
        stored = None if action != "resolve" else _encode_result(result)
        who = actor or default_actor()
        store = self.store
        sources = action_sources(action)
        changed: list[BulkChange] = []
        refused: BulkRefusal | None = None
        batches = 0
        selected = store.select_tasks(where, limit=limit or MAX_BULK)
        take: list[Any] = []
        for row in selected:  # everything before the first refused task
            if row.state not in sources:
                why_not = f"{action} does not apply to a {row.state.value} task"
            elif action == "retry" and not row.has_args:
                why_not = "its arguments were not stored: it cannot be published again"
            else:
                take.append(row)
                continue
            refused = BulkRefusal(row.id, row.name, row.state, why_not)
            break
        for start in range(0, len(take), batch):
            page = take[start : start + batch]
            plan = [
                BulkChange(
                    r.id,
                    r.name,
                    r.state,
                    State.RUNNING if to is State.CANCELLED and r.state is State.RUNNING else to,
                    requested=to is State.CANCELLED and r.state is State.RUNNING,
                )
                for r in page
            ]
            if dry_run:
                changed += plan
                continue
            ids = [r.id for r in page]
            try:
                moved = dict(store.bulk_move(ids, to, actor=who, reason=why, result=stored))
            except (IllegalTransition, TaskNotFound) as error:
                # a task changed between the read and its batch: nothing of it was written
                task_id = str(getattr(error, "task_id", "") or "")
                refused = BulkRefusal(
                    task_id,
                    next((r.name for r in page if r.id == task_id), ""),
                    getattr(error, "from_state", None),
                    f"changed meanwhile ({error}); its batch of {len(page)} was not applied",
                )
                break
            batches += 1
            changed += [
                dataclasses.replace(c, from_state=moved.get(c.id, c.from_state)) for c in plan
            ]
            if action == "retry":
                _publisher.publish(self.app, store, store.take_pending(ids))
        return BulkResult(action, dry_run, changed, refused, batches)
