"""The operator API: ``celery_lease.admin(app)`` returns an :class:`Admin`.

(The module was first called ``celery_lease.admin``, a deprecated name that still imports; the
Django admin site's integration is ``celery_lease.contrib.django``.)

Every action is a transition checked against the one table, recorded with its
actor and reason; an illegal request raises and changes nothing.
"""

from __future__ import annotations

import builtins
import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from celery import Celery

from ._incident import BulkOps, PauseOps
from ._runtime import default_actor, runtime
from .exceptions import CeleryLeaseDeprecationWarning, IllegalTransition, TaskNotFound
from .health import DURATION_SAMPLE, TaskHealth, percentile, snapshot, state_counts
from .producer import publisher as _publisher
from .reaper import Reaper, ReapReport
from .records import StepRecord, TaskRecord, TransitionRecord, WorkerRecord
from .states import CANCELLABLE, RETRYABLE, State, parse_state
from .store import Held, SlotUsage, Store, Waiting
from .worker.pool.execution import encode

#: States ``purge`` deletes by default: finished work nobody will act on.
PURGEABLE_DEFAULT = (State.SUCCEEDED, State.CANCELLED)
#: States ``purge`` may delete at all (FAILED only when asked for).
PURGEABLE = frozenset({State.SUCCEEDED, State.CANCELLED, State.FAILED})
#: Seconds of history ``stats()`` summarizes by default (run durations, rates).
STATS_WINDOW = 3600.0
_FINISHED = (State.SUCCEEDED, State.FAILED, State.CANCELLED)


@dataclasses.dataclass(frozen=True)
class Stats:
    """A snapshot of the store (``admin(app).stats()``).

    Durations and rates cover tasks that finished in the last ``window`` seconds;
    a run's duration is ``finished_at - started_at`` of its last attempt.
    """

    counts: dict[State, int]
    running: int
    expired_unreaped: int
    oldest_pending_age: float | None
    #: Seconds of history the fields below summarize.
    window: float = STATS_WINDOW
    #: Tasks that reached SUCCEEDED, FAILED or CANCELLED within the window.
    finished: int = 0
    #: Median and 99th percentile run duration (seconds) of SUCCEEDED and FAILED tasks.
    run_p50: float | None = None
    run_p99: float | None = None
    #: FAILED / finished and CANCELLED / finished within the window (``None``: none finished).
    failure_rate: float | None = None
    cancel_rate: float | None = None
    #: 95th percentile run duration (seconds), as ``run_p50`` and ``run_p99``.
    run_p95: float | None = None
    #: The same figures per task name, with its backlog and its limits.
    tasks: tuple[TaskHealth, ...] = ()
    #: Counts of SUCCEEDED, FAILED or CANCELLED past ``health.COUNT_CAP`` rows are PostgreSQL's
    #: estimates (planner statistics): counting them exactly would read the whole table.
    counts_estimated: bool = False
    #: Totals since the tables were created: finished rows deleted by retention,
    #: messages re-published by the reaper, duplicate deliveries dropped at claim.
    purged: int = 0
    republished: int = 0
    duplicates_dropped: int = 0
    #: Per limited task and concurrency key: its limit, slots in use, rows waiting.
    slots: tuple[SlotUsage, ...] = ()

    @property
    def zombies(self) -> int:
        """RUNNING tasks whose lease expired and which no reaper has moved yet."""
        return self.expired_unreaped

    def as_dict(self) -> dict[str, Any]:
        return {
            "counts": {state.value: n for state, n in self.counts.items()},
            "running": self.running,
            "expired_unreaped": self.expired_unreaped,
            "oldest_pending_age": self.oldest_pending_age,
            "window": self.window,
            "finished": self.finished,
            "run_p50": self.run_p50,
            "run_p99": self.run_p99,
            "failure_rate": self.failure_rate,
            "cancel_rate": self.cancel_rate,
            "run_p95": self.run_p95,
            "counts_estimated": self.counts_estimated,
            "purged": self.purged,
            "republished": self.republished,
            "duplicates_dropped": self.duplicates_dropped,
            "tasks": [t.as_dict() for t in self.tasks],
            "slots": [slot_dict(u) for u in self.slots],
        }


def slot_dict(usage: SlotUsage) -> dict[str, Any]:
    """One limited task and key as JSON (``lease stats --json``)."""
    return {
        "task": usage.name,
        "key": usage.key,
        "limit": usage.limit,
        "in_use": usage.running + usage.granted,
        "running": usage.running,
        "granted": usage.granted,
        "waiting": usage.waiting,
        "oldest_waiting_age": usage.oldest_waiting_age,
    }


class _DeprecatedName:
    """A method's deprecated second name: the same function, read from the class; a
    :class:`CeleryLeaseDeprecationWarning` naming the first, called on an instance."""

    def __init__(self, name: str, replacement: str) -> None:
        self.name = name
        self.replacement = replacement

    def __get__(self, instance: object, owner: type) -> Any:
        if instance is None:
            return getattr(owner, self.replacement)
        warnings.warn(
            f"{owner.__name__}.{self.name} is deprecated: call "
            f"{owner.__name__}.{self.replacement}, the same method",
            CeleryLeaseDeprecationWarning,
            stacklevel=2,
        )
        return getattr(instance, self.replacement)


class Admin(PauseOps, BulkOps):
    """Read and act on leased tasks of one app."""

    def __init__(self, app: Celery) -> None:
        self.app = app

    @property
    def store(self) -> Store:
        store = runtime(self.app).store
        # operator actions are transitions too: log them, tell the result backend and Flower
        from .notify import attach

        attach(self.app, store)
        return store

    # -- reading ----------------------------------------------------------------------

    def get(self, task_id: str) -> TaskRecord | None:
        """The task's record, or ``None`` when no row has this id."""
        return self.store.get(task_id)

    def _require(self, task_id: str) -> TaskRecord:
        record = self.store.get(task_id)
        if record is None:
            raise TaskNotFound(task_id)
        return record

    def history(self, task_id: str) -> list[TransitionRecord]:
        """Every transition of the task, oldest first (``TaskNotFound`` for an unknown id)."""
        self._require(task_id)
        return self.store.history(task_id)

    def steps(self, task_id: str) -> list[StepRecord]:
        """The task's recorded steps (``TaskNotFound`` for an unknown id)."""
        self._require(task_id)
        return self.store.steps(task_id)

    def tasks(
        self,
        state: State | str | None = None,
        name: str | None = None,
        limit: int = 100,
        *,
        older_than: float | None = None,
        worker: str | None = None,
    ) -> list[TaskRecord]:
        """Tasks, newest first, filtered by state, name, age in seconds and worker
        (node name or incarnation id)."""
        if limit < 1:
            raise ValueError("limit must be at least 1")
        if older_than is not None and older_than < 0:
            raise ValueError("older_than must be a number of seconds >= 0")
        return self.store.list_tasks(
            state=None if state is None else parse_state(state),
            name=name,
            older_than=older_than,
            worker=worker,
            limit=limit,
        )

    def held(self, name: str | None = None, limit: int = 100) -> builtins.list[Held]:
        """The tasks held in the store until their ETA (``lease_hold_eta_after``),
        soonest first, optionally of one task name: the reaper publishes each when due."""
        if limit < 1:
            raise ValueError("limit must be at least 1")
        return self.store.held(name=name, limit=limit)

    def waiting(self, name: str | None = None, limit: int = 100) -> builtins.list[Waiting]:
        """The tasks waiting for a concurrency slot, oldest first per task and key,
        optionally of one task name: each is published when a slot frees."""
        if limit < 1:
            raise ValueError("limit must be at least 1")
        return self.store.waiting_rows(name=name, limit=limit)

    def slots(self, name: str | None = None) -> builtins.list[SlotUsage]:
        """Per limited task and concurrency key: its limit (as its last claim gave it),
        slots in use, rows waiting and the age of the oldest."""
        return self.store.slot_usage(name=name)

    #: Deprecated first name of :meth:`tasks` (it shadows the builtin inside the class).
    list = _DeprecatedName("list", "tasks")

    def workers(self) -> builtins.list[WorkerRecord]:
        """Worker incarnations, newest first, with liveness and tasks owned."""
        return self.store.workers()

    def stats(self, window: float = STATS_WINDOW) -> Stats:
        """Counts per state, RUNNING count, expired-but-unreaped count, oldest PENDING age,
        and over the last ``window`` seconds: run-duration p50/p99, failure and cancel rates."""
        if not window > 0:
            raise ValueError("window must be a positive number of seconds")
        store = self.store
        counts, estimated = state_counts(store)
        window_read = snapshot(store, window, DURATION_SAMPLE)
        tasks = window_read.tasks
        totals = window_read.finished
        total = sum(totals.values())
        durations = window_read.durations
        counters = store.counters()
        return Stats(
            counts=counts,
            running=counts[State.RUNNING],
            expired_unreaped=store.expired_unreaped(),
            oldest_pending_age=store.oldest_pending_age(),
            window=window,
            finished=total,
            run_p50=percentile(durations, 0.5),
            run_p99=percentile(durations, 0.99),
            failure_rate=totals[State.FAILED] / total if total else None,
            cancel_rate=totals[State.CANCELLED] / total if total else None,
            run_p95=percentile(durations, 0.95),
            tasks=tuple(tasks),
            counts_estimated=estimated,
            purged=counters["purged"],
            republished=counters["republished"],
            duplicates_dropped=counters["duplicates_dropped"],
            slots=tuple(store.slot_usage()),
        )

    # -- acting -----------------------------------------------------------------------

    def reap(self) -> ReapReport:
        """Run one reaper sweep now."""
        return Reaper(self.app, actor=f"admin:{default_actor()}", store=self.store).sweep()

    def retry(self, task_id: str, *, actor: str | None = None, reason: str | None = None) -> State:
        """WAIT_MANUAL / FAILED / TIMEOUT -> PENDING, re-published; returns the state it
        left. Completed steps are kept, so the re-run resumes; a step whose outcome was
        unknown runs again."""
        store = self.store
        record = self._require(task_id)
        if record.state in RETRYABLE and record.args is None:
            raise IllegalTransition(task_id, record.state, State.PENDING)
        who = actor or default_actor()
        frm = store.operator_move(
            task_id,
            State.PENDING,
            actor=who,
            reason=reason or f"retried by {who}",
        )
        _publisher.publish(self.app, store, store.take_pending([task_id]))
        return frm

    def fail(self, task_id: str, *, actor: str | None = None, reason: str) -> State:
        """WAIT_MANUAL -> FAILED: a person decided the task will not complete. Returns the
        state it left."""
        return self.store.operator_move(
            task_id,
            State.FAILED,
            actor=actor or default_actor(),
            reason=_required(reason),
        )

    def resolve(
        self,
        task_id: str,
        *,
        actor: str | None = None,
        reason: str,
        result: Any = None,
    ) -> State:
        """WAIT_MANUAL -> SUCCEEDED: a person finished the work by hand (``result`` is
        stored as the task's result). Returns the state it left."""
        text = encode("resolve result", result)
        return self.store.operator_move(
            task_id,
            State.SUCCEEDED,
            actor=actor or default_actor(),
            reason=_required(reason),
            result=text,
        )

    def cancel(
        self,
        task_id: str,
        *,
        actor: str | None = None,
        reason: str | None = None,
        terminate: bool = False,
    ) -> State:
        """Cancel a task; returns the state it was in.

        PENDING / RETRY_WAIT / TIMEOUT / WAIT_MANUAL / FAILED become CANCELLED at once.
        A RUNNING task gets a request it sees at its next step boundary; with
        ``terminate=True`` its process is also killed (the row then ends CANCELLED, or
        WAIT_MANUAL if a non-idempotent step was in flight).
        """
        who = actor or default_actor()
        found = self.store.request_cancel(
            task_id, actor=who, reason=reason or f"cancelled by {who}"
        )
        if found is State.RUNNING and terminate:
            self.app.control.revoke(task_id, terminate=True, signal="SIGKILL")
        return found

    def purgeable(
        self, *, older_than: float, states: Sequence[State | str] = PURGEABLE_DEFAULT
    ) -> int:
        """How many tasks :meth:`purge` would delete now with these arguments."""
        return self.store.purgeable_count(_purge_states(older_than, states), older_than)

    def purge(
        self,
        *,
        older_than: float,
        states: Sequence[State | str] = PURGEABLE_DEFAULT,
        batch: int = 1000,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Delete terminal rows finished more than ``older_than`` seconds ago, with their
        steps and audit rows, in batches (one short transaction each); frees their dedup
        keys. ``progress(n)`` is called after each batch with its count. Returns the total."""
        chosen = _purge_states(older_than, states)
        if batch < 1:
            raise ValueError("batch must be at least 1")
        store = self.store
        total = 0
        while True:
            n = store.purge(older_than=older_than, states_=chosen, batch=batch)
            total += n
            if progress is not None and n:
                progress(n)
            if n < batch:
                return total


def _required(reason: str) -> str:
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError("a reason is required: say why, it goes into the audit trail")
    return reason


def _purge_states(older_than: float, states: Sequence[State | str]) -> list[State]:
    if older_than < 0:
        raise ValueError("older_than must be a number of seconds >= 0")
    chosen = [parse_state(s) for s in states]
    if not chosen:
        raise ValueError("purge needs at least one state")
    live = [s for s in chosen if s not in PURGEABLE]
    if live:
        raise ValueError(
            f"purge deletes finished tasks only, not {', '.join(s.value for s in live)}"
        )
    return chosen


def admin(app: Celery) -> Admin:
    """The operator API of ``app``."""
    return Admin(app)


__all__ = [
    "CANCELLABLE",
    "PURGEABLE",
    "PURGEABLE_DEFAULT",
    "STATS_WINDOW",
    "Admin",
    "Stats",
    "TaskHealth",
    "admin",
    "parse_state",
    "percentile",
]
