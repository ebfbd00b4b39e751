"""The operator API: ``celery_lease.admin(app)``.

Every action is a transition checked against the one table, recorded with its
actor and reason; an illegal request raises and changes nothing.
"""

from __future__ import annotations

import builtins
import dataclasses
from collections.abc import Sequence
from typing import Any

from celery import Celery

from ._execution import encode
from ._runtime import default_actor, runtime
from .exceptions import IllegalTransition, TaskNotFound
from .reaper import Reaper, ReapReport
from .records import StepRecord, TaskRecord, TransitionRecord, WorkerRecord
from .states import CANCELLABLE, RETRYABLE, State
from .store import Store

#: States ``purge`` deletes by default: finished work nobody will act on.
PURGEABLE_DEFAULT = (State.SUCCEEDED, State.CANCELLED)


@dataclasses.dataclass(frozen=True)
class Stats:
    """A snapshot of the store (``admin(app).stats()``)."""

    counts: dict[State, int]
    running: int
    expired_unreaped: int
    oldest_pending_age: float | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "counts": {state.value: n for state, n in self.counts.items()},
            "running": self.running,
            "expired_unreaped": self.expired_unreaped,
            "oldest_pending_age": self.oldest_pending_age,
        }


class Admin:
    """Read and act on leased tasks of one app."""

    def __init__(self, app: Celery) -> None:
        self.app = app

    @property
    def store(self) -> Store:
        return runtime(self.app).store

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

    def list(
        self,
        state: State | str | None = None,
        name: str | None = None,
        limit: int = 100,
        *,
        older_than: float | None = None,
        worker: str | None = None,
    ) -> list[TaskRecord]:
        """Tasks, newest first, filtered by state, name, age in seconds and worker."""
        if limit < 1:
            raise ValueError("limit must be at least 1")
        if state is not None:
            try:
                state = State(state.upper() if isinstance(state, str) else state)
            except ValueError:
                raise ValueError(
                    f"unknown state {state!r}: one of {', '.join(s.value for s in State)}"
                ) from None
        return self.store.list_tasks(
            state=state, name=name, older_than=older_than, worker=worker, limit=limit
        )

    def workers(self) -> builtins.list[WorkerRecord]:
        """Worker incarnations, newest first, with liveness and tasks owned."""
        return self.store.workers()

    def stats(self) -> Stats:
        """Counts per state, RUNNING count, expired-but-unreaped count, oldest PENDING age."""
        counts = self.store.counts()
        return Stats(
            counts=counts,
            running=counts[State.RUNNING],
            expired_unreaped=self.store.expired_unreaped(),
            oldest_pending_age=self.store.oldest_pending_age(),
        )

    # -- acting -----------------------------------------------------------------------

    def reap(self) -> ReapReport:
        """Run one reaper sweep now."""
        return Reaper(self.app, actor=f"admin:{default_actor()}").sweep()

    def retry(self, task_id: str, *, actor: str | None = None, reason: str | None = None) -> None:
        """WAIT_MANUAL / FAILED / TIMEOUT -> PENDING, re-published. Completed steps are
        kept, so the re-run resumes; a step whose outcome was unknown runs again."""
        record = self._require(task_id)
        if record.state in RETRYABLE and record.args is None:
            raise IllegalTransition(task_id, record.state, State.PENDING)
        who = actor or default_actor()
        self.store.operator_move(
            task_id,
            State.PENDING,
            actor=who,
            reason=reason or f"retried by {who}",
            allowed=tuple(RETRYABLE),
        )
        Reaper(self.app, actor=f"admin:{who}").publish(self.store.take_pending([task_id]))

    def fail(self, task_id: str, *, actor: str | None = None, reason: str) -> None:
        """WAIT_MANUAL -> FAILED: a person decided the task will not complete."""
        self.store.operator_move(
            task_id, State.FAILED, actor=actor or default_actor(), reason=reason
        )

    def resolve(
        self,
        task_id: str,
        *,
        actor: str | None = None,
        reason: str,
        result: Any = None,
    ) -> None:
        """WAIT_MANUAL -> SUCCEEDED: a person finished the work by hand."""
        text = encode("resolve result", result)
        self.store.operator_move(
            task_id, State.SUCCEEDED, actor=actor or default_actor(), reason=reason, result=text
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

    def purge(
        self,
        *,
        older_than: float,
        states: Sequence[State | str] = PURGEABLE_DEFAULT,
        batch: int = 1000,
    ) -> int:
        """Delete terminal rows finished more than ``older_than`` seconds ago, with their
        steps and audit rows, in batches; frees their dedup keys. Returns the count."""
        chosen = [State(s) for s in states]
        live = [s for s in chosen if s not in (State.SUCCEEDED, State.CANCELLED, State.FAILED)]
        if live:
            raise ValueError(
                f"purge deletes finished tasks only, not {', '.join(s.value for s in live)}"
            )
        total = 0
        while True:
            n = self.store.purge(older_than=older_than, states_=chosen, batch=batch)
            total += n
            if n < batch:
                return total


def admin(app: Celery) -> Admin:
    """The operator API of ``app``."""
    return Admin(app)


__all__ = ["CANCELLABLE", "PURGEABLE_DEFAULT", "Admin", "Stats", "admin"]
