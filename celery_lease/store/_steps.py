"""Per-step checkpoints, progress cursors and the lease fence they write through."""

from __future__ import annotations

import dataclasses
from typing import Any

from sqlalchemy import Connection, select, update

from ..states import STEP_DONE as DONE
from ..states import STEP_STARTED as STARTED
from ..states import State
from ._base import StoreBase
from ._sql import db_now
from ._types import FenceResult, Lease


@dataclasses.dataclass(frozen=True)
class RecordedStep:
    """A step as a re-run finds it."""

    state: str
    result: str | None
    attempt: int


class StepsMixin(StoreBase):
    def fence(
        self,
        lease: Lease,
        conn: Connection,
        *,
        progress: str | None = None,
        set_progress: bool = False,
    ) -> FenceResult | None:
        """Check the lease inside a write transaction and count it as progress.

        ``None``: the lease is lost. Otherwise says whether a cancel was requested.
        """
        t = self.t.tasks
        values: dict[str, Any] = {"progress_at": db_now()}
        if set_progress:
            values["progress"] = progress
        row = conn.execute(
            update(t)
            .where(
                *self._fenced(lease), t.c.state.in_([State.RUNNING.value, State.WAIT_MANUAL.value])
            )
            .values(**values)
            .returning(t.c.cancel_requested_at, t.c.cancel_reason)
        ).first()
        if row is None:
            return None
        return FenceResult(row.cancel_requested_at is not None, row.cancel_reason)

    def check_lease(self, lease: Lease) -> FenceResult | None:
        """Read-only lease check (for ``check_cancelled``)."""
        t = self.t.tasks

        def op(conn: Connection) -> FenceResult | None:
            row = conn.execute(
                select(t.c.cancel_requested_at, t.c.cancel_reason).where(
                    *self._fenced(lease),
                    t.c.state.in_([State.RUNNING.value, State.WAIT_MANUAL.value]),
                )
            ).first()
            if row is None:
                return None
            return FenceResult(row.cancel_requested_at is not None, row.cancel_reason)

        return self._read(op)

    def load_steps(self, task_id: str) -> dict[str, RecordedStep]:
        """Every recorded step of a task, by name."""
        s = self.t.steps
        return self._read(
            lambda conn: {
                row.name: RecordedStep(row.state, row.result, int(row.attempt))
                for row in conn.execute(
                    select(s.c.name, s.c.state, s.c.result, s.c.attempt).where(
                        s.c.task_id == task_id
                    )
                )
            }
        )

    def step_started(self, lease: Lease, name: str, *, checkable: bool) -> FenceResult | None:
        """Record that a non-idempotent step is about to call out (fenced).

        ``None``: the lease is lost and nothing was written. With a cancel requested
        nothing is recorded either: the caller stops before calling out.
        """
        s = self.t.steps

        def op(conn: Connection, _: bool) -> FenceResult | None:
            fenced = self.fence(lease, conn)
            if fenced is None or fenced.cancel_requested:
                # a STARTED row for a call never made would read "outcome unknown"
                return fenced
            values: dict[str, Any] = {
                "state": STARTED,
                "idempotent": False,
                "checkable": checkable,
                "attempt": lease.attempt,
                "started_at": db_now(),
            }
            conn.execute(
                self._insert(s)
                .values(task_id=lease.task_id, name=name, **values)
                .on_conflict_do_update(
                    index_elements=[s.c.task_id, s.c.name],
                    set_=values,
                    where=s.c.state != DONE,
                )
            )
            return fenced

        return self._tx(op)

    def step_done(
        self, lease: Lease, name: str, result: str, *, idempotent: bool
    ) -> tuple[FenceResult | None, str]:
        """Store a step's result, first writer wins (fenced).

        Returns the fence answer (``None``: lease lost, nothing written) and the stored
        result, which is the earlier one if the step was already done.
        """
        s = self.t.steps

        def op(conn: Connection, _: bool) -> tuple[FenceResult | None, str]:
            fenced = self.fence(lease, conn)
            if fenced is None:
                return None, result
            values: dict[str, Any] = {
                "state": DONE,
                "result": result,
                "attempt": lease.attempt,
                "finished_at": db_now(),
            }
            stored = conn.execute(
                self._insert(s)
                .values(
                    task_id=lease.task_id,
                    name=name,
                    idempotent=idempotent,
                    started_at=db_now(),
                    **values,
                )
                .on_conflict_do_update(
                    index_elements=[s.c.task_id, s.c.name],
                    set_=values,
                    where=s.c.state != DONE,
                )
                .returning(s.c.result)
            ).scalar()
            if stored is None:  # already done by an earlier attempt: keep the first result
                stored = conn.execute(
                    select(s.c.result).where(s.c.task_id == lease.task_id, s.c.name == name)
                ).scalar_one()
            return fenced, str(stored)

        return self._tx(op)

    def save_progress(self, lease: Lease, value: str) -> FenceResult | None:
        """Store the task's progress cursor (fenced); ``None``: lease lost."""
        return self._tx(lambda conn, _: self.fence(lease, conn, progress=value, set_progress=True))

    def load_progress(self, task_id: str) -> str | None:
        t = self.t.tasks
        return self._read(
            lambda conn: conn.execute(select(t.c.progress).where(t.c.id == task_id)).scalar()
        )
