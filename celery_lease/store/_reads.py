"""What the store lets anyone read: records, counts, and the read-only queries of the
invariant checker, the operator statistics and the Prometheus metrics (the
transition totals are read in ``_totals``, next to the fold that writes them).

Nothing here writes. Every query the checker, ``Admin.stats`` and the metrics run
is a named operation of this mixin, so no module outside the store builds SQL.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Row,
    Select,
    and_,
    exists,
    func,
    literal,
    literal_column,
    or_,
    select,
)

from ..records import StepRecord, TaskRecord, TransitionRecord, WorkerRecord, loads
from ..states import State
from ._base import StoreBase
from ._sql import after, db_now, seconds_between


@dataclasses.dataclass(frozen=True)
class InvariantPage:
    """What the invariant checker reads of one page of tasks, in one snapshot.

    ``tasks`` rows carry the task's own columns (``id``, ``state``, ``attempt``,
    ``token``, ``owner``, ``reason``), the owner's ``nodename`` and one boolean per
    liveness deadline passed (``dead_owner``, ``unpublished``, ``republish_overdue``,
    ``retry_overdue``, ``stuck_timeout``, ``follow_ups_overdue``); ``audits`` and
    ``steps`` are the pages' audit and step rows, ordered by task."""

    tasks: list[Row[Any]]
    audits: list[Row[Any]]
    steps: list[Row[Any]]


class ReadsMixin(StoreBase):
    # -- records ----------------------------------------------------------------------

    def _record_query(self) -> Select[Any]:
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
            follow_ups_at=m["follow_ups_at"],
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
            .where(t.c.state == State.RUNNING.value, self._expired_condition())
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

    # -- operator statistics ------------------------------------------------------------

    def _purgeable_where(
        self, states_: Sequence[State], older_than: float
    ) -> list[ColumnElement[bool]]:
        """Rows in ``states_`` finished (or last changed) more than ``older_than`` seconds
        ago: what ``purge`` deletes and ``purgeable_count`` counts."""
        t = self.t.tasks
        return [
            t.c.state.in_([s.value for s in states_]),
            after(func.coalesce(t.c.finished_at, t.c.updated_at), older_than) < db_now(),
            t.c.follow_ups_at.is_(None),  # kept until its follow-ups are published
        ]

    def purgeable_count(self, states_: Sequence[State], older_than: float) -> int:
        """How many rows :meth:`purge` would delete now with these arguments."""
        q = select(func.count()).where(*self._purgeable_where(states_, older_than))
        return int(self._read(lambda conn: conn.execute(q).scalar_one()))

    def finished_counts(self, states_: Sequence[State], window: float) -> dict[State, int]:
        """Rows in ``states_`` that finished within the last ``window`` seconds, per state
        (every state of ``states_`` present, zero included)."""
        t = self.t.tasks
        q = (
            select(t.c.state, func.count())
            .where(
                t.c.state.in_([s.value for s in states_]),
                t.c.finished_at >= after(db_now(), -window),
            )
            .group_by(t.c.state)
        )
        rows = self._read(lambda conn: conn.execute(q).all())
        out = dict.fromkeys(states_, 0)
        for state, count in rows:
            out[State(state)] = int(count)
        return out

    def run_durations(self, window: float, *, limit: int) -> list[float]:
        """Run durations (``finished_at - started_at``, seconds) of SUCCEEDED and FAILED
        rows that finished within the last ``window`` seconds, the ``limit`` most recent."""
        t = self.t.tasks
        q = (
            select(seconds_between(t.c.finished_at, t.c.started_at))
            .where(
                t.c.state.in_([State.SUCCEEDED.value, State.FAILED.value]),
                t.c.finished_at >= after(db_now(), -window),
                t.c.started_at.is_not(None),
            )
            .order_by(t.c.finished_at.desc())
            .limit(limit)
        )
        rows = self._read(lambda conn: conn.execute(q).scalars().all())
        return [max(0.0, float(v)) for v in rows if v is not None]

    # -- the invariant checker ----------------------------------------------------------

    def task_ids_after(self, last: str | None, *, limit: int) -> list[str]:
        """Up to ``limit`` task ids greater than ``last`` (all when ``None``), in order."""
        t = self.t.tasks
        q = select(t.c.id).order_by(t.c.id).limit(limit)
        if last is not None:
            q = q.where(t.c.id > last)
        return [str(r) for r in self._read(lambda conn: conn.execute(q).scalars().all())]

    def orphans(self) -> dict[str, dict[str, int]]:
        """Audit and step rows of tasks that have no row: ``{"transitions": {task_id:
        count}, "steps": {task_id: count}}``."""
        t = self.t.tasks

        def op(conn: Connection) -> dict[str, dict[str, int]]:
            found: dict[str, dict[str, int]] = {}
            for table in (self.t.transitions, self.t.steps):
                q = (
                    select(table.c.task_id, func.count())
                    .where(~select(t.c.id).where(t.c.id == table.c.task_id).exists())
                    .group_by(table.c.task_id)
                )
                key = "transitions" if table is self.t.transitions else "steps"
                found[key] = {str(task_id): int(n) for task_id, n in conn.execute(q)}
            return found

        return self._read(op)

    def invariant_page(self, ids: Sequence[str], *, grace: float) -> InvariantPage:
        """The rows the checker needs for ``ids``, read in one snapshot, with each
        liveness deadline (the reaper's, plus ``grace`` seconds) evaluated in database
        time."""
        t, w, tr, s = self.t.tasks, self.t.workers, self.t.transitions, self.t.steps
        now = db_now()
        dead_owner = and_(
            t.c.state == State.RUNNING.value,
            or_(
                and_(w.c.id.is_(None), after(t.c.updated_at, t.c.lease_ttl + grace) < now),
                and_(w.c.stopped_at.is_not(None), after(w.c.stopped_at, grace) < now),
                after(w.c.heartbeat_at, t.c.lease_ttl + grace) < now,
            ),
        )
        # the reaper's own windows (take_unpublished), plus the grace
        unpublished = and_(t.c.state == State.PENDING.value, self._never_published(grace))
        republish_overdue = and_(t.c.state == State.PENDING.value, self._message_lost(grace))
        retry_overdue = and_(
            t.c.state == State.RETRY_WAIT.value, after(t.c.next_retry_at, grace) < now
        )
        stuck_timeout = and_(t.c.state == State.TIMEOUT.value, after(t.c.updated_at, grace) < now)
        follow_ups_overdue = and_(
            t.c.follow_ups_at.is_not(None),
            after(t.c.follow_ups_at, self.config.publish_grace + grace) < now,
        )
        # a row to publish whose broker no live worker uses: no reaper will publish it
        # (each publishes only its own broker's rows)
        publisher = w.alias("publisher")
        no_publisher = and_(
            t.c.state.in_([State.PENDING.value, State.RETRY_WAIT.value]),
            t.c.origin.is_not(None),
            ~exists(
                select(publisher.c.id).where(
                    publisher.c.origin == t.c.origin,
                    publisher.c.stopped_at.is_(None),
                    after(publisher.c.heartbeat_at, self.config.ttl + grace) >= now,
                )
            ),
        )
        task_q = (
            select(
                t.c.id,
                t.c.state,
                t.c.attempt,
                t.c.token,
                t.c.owner,
                t.c.reason,
                t.c.lease_ttl,
                t.c.max_runtime,
                w.c.nodename,
                dead_owner.label("dead_owner"),
                unpublished.label("unpublished"),
                republish_overdue.label("republish_overdue"),
                retry_overdue.label("retry_overdue"),
                stuck_timeout.label("stuck_timeout"),
                follow_ups_overdue.label("follow_ups_overdue"),
                no_publisher.label("no_publisher"),
                t.c.origin,
            )
            .select_from(t.outerjoin(w, w.c.id == t.c.owner))
            .where(t.c.id.in_(ids))
        )
        audit_q = select(tr).where(tr.c.task_id.in_(ids)).order_by(tr.c.task_id, tr.c.id)
        step_q = select(s).where(s.c.task_id.in_(ids)).order_by(s.c.task_id, s.c.name)

        def op(conn: Connection) -> InvariantPage:
            # one snapshot for the page, so that a live system does not show a row newer
            # than the trail read a moment before (SQLite: a transaction is a snapshot)
            if self.is_pg:
                conn.execution_options(isolation_level="REPEATABLE READ")
            audits = list(conn.execute(audit_q))
            steps = list(conn.execute(step_q))
            tasks = list(conn.execute(task_q))
            return InvariantPage(tasks, audits, steps)

        return self._read(op)

    # -- the database itself ------------------------------------------------------------

    def now(self) -> datetime:
        """The database's current time."""
        return self._read(lambda conn: conn.execute(select(db_now())).scalar_one())

    def ping(self) -> None:
        """Raise :class:`StoreUnavailable` unless the database answers."""
        self._read(lambda conn: conn.execute(select(literal(1))).scalar_one())
