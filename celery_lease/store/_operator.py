"""What operators read and do: records, history, and transitions made by a person."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Row, and_, delete, func, literal_column, or_, select, update

from .. import states
from ..exceptions import TaskNotFound
from ..records import StepRecord, TaskRecord, TransitionRecord, WorkerRecord, loads
from ..states import State
from ._base import StoreBase
from ._sql import after, db_now, seconds_between

#: What a person may do, by target state (the rest of the table belongs to machines).
OPERATOR_SOURCES: dict[State, tuple[State, ...]] = {
    State.PENDING: (State.WAIT_MANUAL, State.FAILED, State.TIMEOUT),
    State.FAILED: (State.WAIT_MANUAL,),
    State.SUCCEEDED: (State.WAIT_MANUAL,),
    State.CANCELLED: (
        State.PENDING,
        State.RETRY_WAIT,
        State.TIMEOUT,
        State.WAIT_MANUAL,
        State.FAILED,
    ),
}


class OperatorMixin(StoreBase):
    # -- reads ------------------------------------------------------------------------

    def _record_query(self) -> Any:
        t, w = self.t.tasks, self.t.workers
        return select(t, w.c.heartbeat_at.label("owner_heartbeat_at"), w.c.nodename).select_from(
            t.outerjoin(w, w.c.id == t.c.owner)
        )

    @staticmethod
    def _record(row: Row[Any]) -> TaskRecord:
        m = row._mapping
        return TaskRecord(
            id=m["id"],
            name=m["name"],
            state=State(m["state"]),
            attempt=int(m["attempt"]),
            recoveries=int(m["recoveries"]),
            retries=int(m["retries"]),
            dedup_key=m["dedup_key"],
            owner=m["owner"],
            created_at=m["created_at"],
            started_at=m["started_at"],
            heartbeat_at=m["owner_heartbeat_at"],
            finished_at=m["finished_at"],
            next_retry_at=m["next_retry_at"],
            result=loads(m["result"]),
            error=m["error"],
            reason=m["reason"],
            args=loads(m["args"]),
            kwargs=loads(m["kwargs"]),
            options=loads(m["options"]),
            eta=m["eta"],
            published_at=m["published_at"],
            progress_at=m["progress_at"],
            progress=loads(m["progress"]),
            lease_ttl=m["lease_ttl"],
            max_runtime=m["max_runtime"],
            max_retries=m["max_retries"],
            on_timeout=m["on_timeout"],
            on_exhausted=m["on_exhausted"],
            max_recoveries=m["max_recoveries"],
            owner_node=m["nodename"],
            cancel_requested_at=m["cancel_requested_at"],
            cancel_actor=m["cancel_actor"],
            cancel_reason=m["cancel_reason"],
            message=m["message"],
        )

    def get(self, task_id: str) -> TaskRecord | None:
        """The task's row, or ``None``."""
        t = self.t.tasks
        row = self._read(
            lambda conn: conn.execute(self._record_query().where(t.c.id == task_id)).first()
        )
        return None if row is None else self._record(row)

    def history(self, task_id: str) -> list[TransitionRecord]:
        """The task's audit trail, oldest first."""
        tr = self.t.transitions
        rows = self._read(
            lambda conn: conn.execute(
                select(tr).where(tr.c.task_id == task_id).order_by(tr.c.id)
            ).all()
        )
        return [
            TransitionRecord(
                from_state=State(r.from_state) if r.from_state else None,
                to_state=State(r.to_state),
                reason=r.reason,
                actor=r.actor,
                attempt=int(r.attempt),
                at=r.at,
            )
            for r in rows
        ]

    def list_tasks(
        self,
        *,
        state: State | str | None = None,
        name: str | None = None,
        older_than: float | None = None,
        worker: str | None = None,
        limit: int = 100,
    ) -> list[TaskRecord]:
        """Rows, newest first, filtered by state, task name, age (seconds) and worker
        (incarnation id or node name)."""
        t, w = self.t.tasks, self.t.workers
        # SQLite's clock has millisecond resolution: rows created in the same millisecond
        # come newest first by insertion order (rowid)
        tie = t.c.id if self.is_pg else literal_column(f'"{t.name}".rowid').desc()
        q = self._record_query().order_by(t.c.created_at.desc(), tie).limit(limit)
        if state is not None:
            q = q.where(t.c.state == State(state).value)
        if name is not None:
            q = q.where(t.c.name == name)
        if older_than is not None:
            q = q.where(after(t.c.created_at, older_than) < db_now())
        if worker is not None:
            q = q.where(or_(t.c.owner == worker, w.c.nodename == worker))
        rows = self._read(lambda conn: conn.execute(q).all())
        return [self._record(r) for r in rows]

    def steps(self, task_id: str) -> list[StepRecord]:
        """The task's recorded steps in the order they started."""
        s = self.t.steps
        rows = self._read(
            lambda conn: conn.execute(
                select(s)
                .where(s.c.task_id == task_id)
                # SQLite's clock ticks in milliseconds: insertion order breaks ties
                .order_by(s.c.started_at, literal_column("rowid") if not self.is_pg else s.c.name)
            ).all()
        )
        return [
            StepRecord(
                name=r.name,
                state=r.state,
                idempotent=bool(r.idempotent),
                attempt=int(r.attempt),
                result=loads(r.result),
                started_at=r.started_at,
                finished_at=r.finished_at,
            )
            for r in rows
        ]

    def workers(self, *, ttl: float | None = None) -> list[WorkerRecord]:
        """Incarnations, newest first; alive = not stopped and heartbeat younger than ``ttl``."""
        t, w = self.t.tasks, self.t.workers
        horizon = ttl if ttl is not None else self.config.ttl
        running = (
            select(func.count())
            .where(t.c.owner == w.c.id, t.c.state == State.RUNNING.value)
            .scalar_subquery()
        )
        alive = and_(w.c.stopped_at.is_(None), after(w.c.heartbeat_at, horizon) >= db_now())
        q = select(w, alive.label("alive"), running.label("running")).order_by(
            w.c.started_at.desc()
        )
        rows = self._read(lambda conn: conn.execute(q).all())
        return [
            WorkerRecord(
                id=r.id,
                nodename=r.nodename,
                hostname=r.hostname,
                pid=int(r.pid),
                started_at=r.started_at,
                heartbeat_at=r.heartbeat_at,
                stopped_at=r.stopped_at,
                stop_reason=r.stop_reason,
                alive=bool(r.alive),
                running=int(r.running),
            )
            for r in rows
        ]

    def counts(self) -> dict[State, int]:
        """Rows per state (every state present, zero included)."""
        t = self.t.tasks
        rows = self._read(
            lambda conn: conn.execute(select(t.c.state, func.count()).group_by(t.c.state)).all()
        )
        out = dict.fromkeys(State, 0)
        for state, count in rows:
            out[State(state)] = int(count)
        return out

    def expired_unreaped(self) -> int:
        """RUNNING rows whose lease has expired but which no reaper has moved yet."""
        t, w = self.t.tasks, self.t.workers
        q = (
            select(func.count())
            .select_from(t.outerjoin(w, w.c.id == t.c.owner))
            .where(
                t.c.state == State.RUNNING.value,
                or_(
                    w.c.id.is_(None),
                    w.c.stopped_at.is_not(None),
                    after(w.c.heartbeat_at, t.c.lease_ttl) < db_now(),
                ),
            )
        )
        return int(self._read(lambda conn: conn.execute(q).scalar_one()))

    def oldest_pending_age(self) -> float | None:
        """Seconds since the oldest PENDING row was created (``None``: none pending)."""
        t = self.t.tasks
        q = select(seconds_between(db_now(), func.min(t.c.created_at))).where(
            t.c.state == State.PENDING.value
        )
        value = self._read(lambda conn: conn.execute(q).scalar())
        return None if value is None else float(value)

    # -- operator transitions ---------------------------------------------------------

    def _lock_state(self, conn: Connection, task_id: str) -> State:
        t = self.t.tasks
        q = select(t.c.state).where(t.c.id == task_id)
        if self.is_pg:
            q = q.with_for_update()
        state = conn.execute(q).scalar()
        if state is None:
            raise TaskNotFound(task_id)
        return State(state)

    def operator_move(
        self,
        task_id: str,
        to: State,
        *,
        actor: str,
        reason: str,
        result: str | None = None,
        allowed: Sequence[State] | None = None,
    ) -> State:
        """A person moves a task to ``to``; returns the state it left.

        Raises :class:`TaskNotFound` or :class:`IllegalTransition` and changes nothing
        when the table (or ``allowed``) does not permit it.
        """
        t, s = self.t.tasks, self.t.steps

        def op(conn: Connection, _: bool) -> State:
            frm = self._lock_state(conn, task_id)
            permitted = OPERATOR_SOURCES.get(to, ()) if allowed is None else allowed
            if frm not in permitted or not states.is_legal(frm, to):
                from ..exceptions import IllegalTransition

                raise IllegalTransition(task_id, frm, to)
            # the token goes: a still-running owner (WAIT_MANUAL over max_runtime) is fenced off
            values: dict[str, Any] = {"token": None}
            if to is State.PENDING:
                values.update(
                    publish_count=0,
                    published_at=None,
                    next_retry_at=None,
                    finished_at=None,
                    eta=None,
                    cancel_requested_at=None,
                    cancel_actor=None,
                    cancel_reason=None,
                )
                # a step whose outcome was unknown is re-run: the person decided so
                conn.execute(delete(s).where(s.c.task_id == task_id, s.c.state != "DONE"))
            else:
                values["finished_at"] = db_now()
            if to is State.FAILED:
                values["error"] = reason
            if to is State.SUCCEEDED:
                values["result"] = result
            self._move(
                conn, [t.c.id == task_id], frm, to, reason=reason, actor=actor, values=values
            )
            return frm

        return self._tx(op)

    def request_cancel(self, task_id: str, *, actor: str, reason: str) -> State:
        """Cancel a task: at once unless RUNNING, where the request waits for the task
        to reach a step boundary. Returns the state found."""
        t = self.t.tasks

        def op(conn: Connection, _: bool) -> State:
            frm = self._lock_state(conn, task_id)
            if frm is State.RUNNING:
                conn.execute(
                    update(t)
                    .where(t.c.id == task_id, t.c.state == State.RUNNING.value)
                    .values(cancel_requested_at=db_now(), cancel_actor=actor, cancel_reason=reason)
                )
                return frm
            if not states.is_legal(frm, State.CANCELLED):
                from ..exceptions import IllegalTransition

                raise IllegalTransition(task_id, frm, State.CANCELLED)
            self._move(
                conn,
                [t.c.id == task_id],
                frm,
                State.CANCELLED,
                reason=reason,
                actor=actor,
                values={"finished_at": db_now(), "token": None},
            )
            return frm

        return self._tx(op)

    def purge(self, *, older_than: float, states_: Sequence[State], batch: int = 1000) -> int:
        """Delete one batch of rows in ``states_`` finished more than ``older_than`` seconds
        ago, with their steps and audit rows. Returns how many tasks were deleted."""
        t, s, tr = self.t.tasks, self.t.steps, self.t.transitions

        def op(conn: Connection, _: bool) -> int:
            q = (
                select(t.c.id)
                .where(
                    t.c.state.in_([st.value for st in states_]),
                    after(func.coalesce(t.c.finished_at, t.c.updated_at), older_than) < db_now(),
                )
                .limit(batch)
            )
            if self.is_pg:
                q = q.with_for_update(skip_locked=True)
            ids = [r.id for r in conn.execute(q).all()]
            if ids:
                conn.execute(delete(s).where(s.c.task_id.in_(ids)))
                conn.execute(delete(tr).where(tr.c.task_id.in_(ids)))
                conn.execute(delete(t).where(t.c.id.in_(ids)))
            return len(ids)

        return self._tx(op)

    def db_time(self) -> datetime:
        return self._read(lambda conn: conn.execute(select(db_now())).scalar_one())
