"""Lease expiry and overrun: RUNNING -> TIMEOUT, and what the policy decides, in one
transaction."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    Connection,
    select,
)

from .. import policy
from ..states import STEP_STARTED, State
from ._base import StoreBase
from ._sql import after, db_now, seconds_between
from ._types import Expiry, Lease


class ExpiryMixin(StoreBase):
    def expire(
        self,
        *,
        actor: str,
        reason: str,
        task_ids: Sequence[str] | None = None,
        owners: Sequence[str] | None = None,
        only_expired: bool = True,
        limit: int | None = None,
    ) -> list[Expiry]:
        """RUNNING -> TIMEOUT -> RETRY_WAIT (due now) or WAIT_MANUAL, per the policy.

        Selects RUNNING rows (optionally only those of ``task_ids``/``owners``; with
        ``only_expired``, only those whose owner's heartbeat is older than their TTL),
        at most ``limit`` (a batch), skipping rows another reaper holds.
        """
        t, w = self.t.tasks, self.t.workers
        batch = limit or self.config.reaper_batch_size

        def op(conn: Connection, _: bool) -> list[Expiry]:
            q = (
                select(t.c.id, t.c.token)
                .select_from(t.outerjoin(w, w.c.id == t.c.owner))
                .where(t.c.state == State.RUNNING.value)
                .limit(batch)
            )
            if task_ids is not None:
                q = q.where(t.c.id.in_(task_ids))
            if owners is not None:
                q = q.where(t.c.owner.in_(owners))
            if only_expired:
                q = q.where(self._expired_condition())
            if self.is_pg:
                q = q.with_for_update(of=t, skip_locked=True)
            out = []
            for cand in conn.execute(q).all():
                done = self._expire_one(conn, cand.id, cand.token, actor=actor, reason=reason)
                if done is not None:
                    out.append(done)
            return out

        return self._tx(op)

    def _expire_one(
        self, conn: Connection, task_id: str, token: str | None, *, actor: str, reason: str
    ) -> Expiry | None:
        t, s = self.t.tasks, self.t.steps
        rows = self._move(
            conn,
            [t.c.id == task_id, t.c.token == token if token is not None else t.c.token.is_(None)],
            State.RUNNING,
            State.TIMEOUT,
            reason=reason,
            actor=actor,
            values={"token": None, "recoveries": t.c.recoveries + 1},
            returning=(
                t.c.recoveries,
                t.c.max_recoveries,
                t.c.on_timeout,
                t.c.cancel_requested_at,
                seconds_between(db_now(), t.c.created_at).label("age"),
            ),
        )
        if not rows:
            return None
        row = rows[0]
        inflight = conn.execute(
            select(s.c.name)
            .where(
                s.c.task_id == task_id,
                s.c.state == STEP_STARTED,
                # only this attempt's calls can be in flight: a step left STARTED by an
                # earlier attempt ended when its call raised and the task chose to retry
                s.c.attempt == row.attempt,
                s.c.idempotent.is_(False),
                s.c.checkable.is_(False),
            )
            .limit(1)
        ).scalar()
        to, why = policy.after_timeout(
            on_timeout=row.on_timeout,
            recoveries=int(row.recoveries),
            max_recoveries=int(row.max_recoveries),
            age=float(row.age),
            max_age=self.config.max_age,
            inflight_step=inflight,
            cancel_requested=row.cancel_requested_at is not None,
        )
        values: dict[str, Any] = {}
        if to is State.RETRY_WAIT:
            values["next_retry_at"] = db_now()
        elif to is State.CANCELLED:
            values["finished_at"] = db_now()
        self._move(
            conn,
            [t.c.id == task_id],
            State.TIMEOUT,
            to,
            reason=f"{why} (after: {reason})",
            actor=actor,
            values=values,
        )
        return Expiry(task_id, to, why)

    def give_up(self, lease: Lease, *, actor: str, reason: str) -> Expiry | None:
        """An execution gives up its own lease (it stopped without an outcome): expire it
        at once, fenced by its token, then apply the policy. ``None``: it was no longer
        this execution's lease (nothing changed)."""
        return self._tx(
            lambda conn, _: self._expire_one(
                conn, lease.task_id, lease.token, actor=actor, reason=reason
            )
        )

    def overrun(self, *, actor: str, limit: int | None = None) -> list[str]:
        """RUNNING rows with a live lease but no progress for ``max_runtime`` -> WAIT_MANUAL.

        The owner keeps its token: if it finishes, its outcome is accepted."""
        t, w = self.t.tasks, self.t.workers
        batch = limit or self.config.reaper_batch_size

        def op(conn: Connection, _: bool) -> list[str]:
            q = (
                select(t.c.id, t.c.max_runtime)
                .select_from(t.join(w, w.c.id == t.c.owner))
                .where(
                    t.c.state == State.RUNNING.value,
                    t.c.max_runtime.is_not(None),
                    after(t.c.progress_at, t.c.max_runtime) < db_now(),
                    ~self._expired_condition(),
                )
                .limit(batch)
            )
            if self.is_pg:
                q = q.with_for_update(of=t, skip_locked=True)
            moved = []
            for cand in conn.execute(q).all():
                why = (
                    f"alive but no progress for more than max_runtime ({cand.max_runtime:g} s): "
                    "left running; a person decides"
                )
                if self._move(
                    conn,
                    [t.c.id == cand.id],
                    State.RUNNING,
                    State.WAIT_MANUAL,
                    reason=why,
                    actor=actor,
                ):
                    moved.append(str(cand.id))
            return moved

        return self._tx(op)
