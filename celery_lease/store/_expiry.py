"""Lease expiry and overrun: RUNNING -> TIMEOUT, and what the policy decides, in one
transaction."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, and_, false, not_, or_, select, tuple_
from sqlalchemy.sql.expression import ColumnElement

from .. import policy
from ..config import MAX_SECONDS
from ..states import STEP_STARTED, State
from ._base import StoreBase
from ._sql import after, db_now, seconds_between
from ._types import Expiry, Lease

#: The timestamp a destination of an expiry sets to the database's time.
_STAMPS = {State.RETRY_WAIT: "next_retry_at", State.CANCELLED: "finished_at"}


class ExpiryMixin(StoreBase):
    def expire(
        self,
        *,
        actor: str,
        reason: str,
        task_ids: Sequence[str] | None = None,
        owners: Sequence[str] | None = None,
        attempt: int | None = None,
        only_expired: bool = True,
        limit: int | None = None,
    ) -> list[Expiry]:
        """RUNNING -> TIMEOUT -> RETRY_WAIT (due now) or WAIT_MANUAL, per the policy.

        Selects RUNNING rows (optionally only those of ``task_ids``/``owners``, and only
        the execution of that ``attempt``, when the caller knows which one it lost; with
        ``only_expired``, only those whose owner's heartbeat is older than their TTL),
        at most ``limit`` (a batch), skipping rows another reaper holds.

        A batch is decided together, in one transaction: one read of the candidates,
        one fenced ``RUNNING -> TIMEOUT`` of them all, one read of their steps in flight,
        the policy's decision for each row, and one write of the decisions (on
        PostgreSQL each of these is one statement, whatever the batch's size).
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
            if attempt is not None:
                q = q.where(t.c.attempt == attempt)
            if only_expired:
                q = q.where(self._expired_condition())
            if self.is_pg:
                q = q.with_for_update(of=t, skip_locked=True)
            candidates = [(str(c.id), c.token) for c in conn.execute(q).all()]
            return self._expire_batch(conn, candidates, actor=actor, reason=reason)

        return self._tx(op)

    def _expire_batch(
        self,
        conn: Connection,
        candidates: Sequence[tuple[str, str | None]],
        *,
        actor: str,
        reason: str,
    ) -> list[Expiry]:
        """Expire the leases ``(task id, token)`` (each fenced by its token) and apply
        the policy to each, in the caller's transaction."""
        if not candidates:
            return []
        t, s = self.t.tasks, self.t.steps
        held = [c for c in candidates if c[1] is not None]
        tokenless = [task_id for task_id, token in candidates if token is None]
        fence = or_(
            tuple_(t.c.id, t.c.token).in_(held) if held else false(),
            and_(t.c.id.in_(tokenless), t.c.token.is_(None)) if tokenless else false(),
        )
        timed_out = self._move(
            conn,
            [fence],
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
        if not timed_out:
            return []
        # only this attempt's calls can be in flight: a step left STARTED by an earlier
        # attempt ended when its call raised and the task chose to retry
        inflight: dict[str, str] = {}
        for step in conn.execute(
            select(s.c.task_id, s.c.name)
            .where(
                tuple_(s.c.task_id, s.c.attempt).in_([(r.id, r.attempt) for r in timed_out]),
                s.c.state == STEP_STARTED,
                s.c.idempotent.is_(False),
                s.c.checkable.is_(False),
            )
            .order_by(s.c.task_id, s.c.name)
        ).all():
            inflight.setdefault(str(step.task_id), str(step.name))
        decided: list[Expiry] = []
        for row in timed_out:
            to, why = policy.after_timeout(
                on_timeout=row.on_timeout,
                recoveries=int(row.recoveries),
                max_recoveries=int(row.max_recoveries),
                age=float(row.age),
                max_age=self.config.max_age,
                inflight_step=inflight.get(str(row.id)),
                cancel_requested=row.cancel_requested_at is not None,
            )
            decided.append(Expiry(str(row.id), to, why))
        self._move_each(
            conn,
            State.TIMEOUT,
            [(e.task_id, e.to_state, f"{e.reason} (after: {reason})") for e in decided],
            actor=actor,
            stamps=_STAMPS,
        )
        return decided

    def give_up(self, lease: Lease, *, actor: str, reason: str) -> Expiry | None:
        """An execution gives up its own lease (it stopped without an outcome): expire it
        at once, fenced by its token, then apply the policy. ``None``: it was no longer
        this execution's lease (nothing changed)."""
        expiries = self._tx(
            lambda conn, _: self._expire_batch(
                conn, [(lease.task_id, lease.token)], actor=actor, reason=reason
            )
        )
        return expiries[0] if expiries else None

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
            moves = [
                (
                    str(cand.id),
                    State.WAIT_MANUAL,
                    f"alive but no progress for more than max_runtime ({cand.max_runtime:g} s): "
                    "left running; a person decides",
                )
                for cand in conn.execute(q).all()
            ]
            rows = self._move_each(conn, State.RUNNING, moves, actor=actor, stamps={})
            moved = {str(r.id) for r in rows}
            return [task_id for task_id, _, _ in moves if task_id in moved]

        return self._tx(op)

    def out_of_range(self, *, limit: int = 10) -> list[str]:
        """RUNNING rows whose stored ``lease_ttl`` or ``max_runtime`` is outside the range
        a setting or option may take (not finite, not positive, over ``MAX_SECONDS``):
        written by an older version or by hand. The sweeps clamp such a value (see
        :class:`~._sql.after`), so the row stops no sweep; the reaper reports it."""
        t = self.t.tasks

        def bad(column: Any) -> ColumnElement[bool]:
            # NaN: PostgreSQL orders it above every number, so it fails the upper bound
            return not_(and_(column > 0, column <= MAX_SECONDS))

        q = (
            select(t.c.id)
            .where(
                t.c.state == State.RUNNING.value,
                or_(bad(t.c.lease_ttl), and_(t.c.max_runtime.is_not(None), bad(t.c.max_runtime))),
            )
            .order_by(t.c.id)
            .limit(limit)
        )
        return [str(i) for i in self._read(lambda conn: conn.execute(q).scalars().all())]
