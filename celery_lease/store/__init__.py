"""Storage: the lease tables and the operations on them (SQLAlchemy Core).

:class:`Store`, one object per database, is composed of one class per concept, each
owning its statements with their single and batch forms:

=====================  ==============================================================
``Submission``         ``_submit``: new rows, one or many; the run that replaces a
                       finished one; "published" marks and their recorder; the
                       caller's transaction a submission joins
``Claims``             ``_claim``: claims, one or many; steps, progress, lease checks
``Slots``              ``_slots``: concurrency limits: a key's lock, waiting rows, the
                       grants of freed slots (``Claims`` derives from it: a limited
                       claim takes its slot in the claim's own transaction)
``Outcomes``           ``_outcome``: outcomes and retries, one or many; follow-ups sent
``Sweeps``             ``_sweeps``: the reaper's expiry, re-publishing, backlog and
                       follow-ups; worker rows and the reaper's lock
``Operator``           ``_operator``: a person's moves, bulk actions, purges, pauses;
                       retention
``Counting``           ``_totals``: transition totals, counters, health figures
``Schedules``          ``_schedules``: the beat's rows, a periodic entry's slots
                       decided in one transaction; the beats seen
``SchemaSetup``        ``migrations``: the schema's version, migrating it
``Store`` itself       the reads that belong to no part: records, history, lists,
                       counts, the invariant checker's page
=====================  ==============================================================

Each derives from ``StoreBase`` (``_base``: transactions, the one compare-and-set with
its audit rows) alone, except ``Claims``, which derives from ``Slots``, and ``Operator``,
which derives from ``Counting`` (a purge
deletes audit rows through it); no two define the same name, so the order of the bases
does not matter. Underneath: ``_types`` (the values exchanged with callers), ``schema``
(the tables, the dialect SQL, the conditions several operations share) and ``_db``
(engines, deadlines, redaction).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
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
    true,
)

from ..records import StepRecord, TaskRecord, TransitionRecord, WorkerRecord, loads
from ..states import State
from ._base import dumps
from ._claim import Claims
from ._db import bounded_connection, redact
from ._operator import KINDS as PAUSE_KINDS
from ._operator import Operator
from ._outcome import Outcomes
from ._schedules import BeatRow, ScheduleRow, Schedules, SlotDecision
from ._slots import WAITING, holders
from ._submit import (
    REOPENABLE,
    REPLACED,
    RESUBMITTED,
    JoinedTransaction,
    join_transaction,
    outbox_transaction,
)
from ._sweeps import Sweeps
from ._totals import DUPLICATES_DROPPED, PURGED, REPUBLISHED
from ._types import (
    ON_CONFLICT,
    Claim,
    Executor,
    Expiry,
    FenceResult,
    Filter,
    Fold,
    FollowUps,
    Held,
    InvariantPage,
    JoinedSubmission,
    Lease,
    LeaseOptions,
    Listener,
    NewTask,
    Outcome,
    Pause,
    PauseEvent,
    Publishable,
    RecordedStep,
    Refusal,
    Replacement,
    Rows,
    Slot,
    SlotUsage,
    Totals,
    TransitionEvent,
    Unique,
    UniqueAnswer,
    Waiting,
)
from ._unique import REPLACED_ARGUMENTS, UniqueSubmission
from .migrations import SchemaSetup
from .schema import (
    SCHEMA_VERSION,
    Tables,
    after,
    build,
    db_now,
    lease_expired,
    message_lost,
    never_published,
    seconds_between,
)


class Store(UniqueSubmission, Claims, Outcomes, Sweeps, Operator, Schedules, SchemaSetup):
    """Domain operations on the lease tables of one database (thread-safe; fork-safe).

    The parts above own the operations; the class itself owns the reads that belong to
    none of them, and none of which writes: records, history, lists, counts and the
    invariant checker's page.
    """

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
            .where(t.c.state == State.RUNNING.value, lease_expired(self.t))
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
        unpublished = and_(
            t.c.state == State.PENDING.value,
            never_published(self.t, self.config.publish_grace + grace),
        )
        republish_overdue = and_(
            t.c.state == State.PENDING.value,
            message_lost(self.t, self.config.republish_after, grace),
        )
        # the held sweep publishes a row before its ETA: one still held past it is late
        held_overdue = and_(
            t.c.state == State.PENDING.value, t.c.held == true(), after(t.c.eta, grace) < now
        )
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
        # a row waiting for a concurrency slot while its key has one free, and nothing
        # of that key changed for the grace (a free changes the row it ends, a grant
        # the row it grants): no grant is in flight, the reaper's backstop should have
        # granted it (unless its task is paused: grants leave a paused task's rows)
        c, peer = self.t.concurrency, t.alias("peer")
        waiting_with_free_slot = and_(
            t.c.state == State.PENDING.value,
            t.c.slot == WAITING,
            self.paused_names_clause(),
            exists(
                select(c.c.name).where(
                    c.c.name == t.c.name,
                    c.c.key == t.c.slot_key,
                    holders(peer, w, c.c.name, c.c.key) < c.c.max_slots,
                )
            ),
            ~exists(
                select(peer.c.id).where(
                    peer.c.name == t.c.name,
                    peer.c.slot_key == t.c.slot_key,
                    after(peer.c.updated_at, grace) >= now,
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
                held_overdue.label("held_overdue"),
                retry_overdue.label("retry_overdue"),
                stuck_timeout.label("stuck_timeout"),
                follow_ups_overdue.label("follow_ups_overdue"),
                no_publisher.label("no_publisher"),
                waiting_with_free_slot.label("waiting_with_free_slot"),
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

    def now(self) -> datetime:
        """The database's current time."""
        return self._read(lambda conn: conn.execute(select(db_now())).scalar_one())

    def ping(self) -> None:
        """Raise :class:`StoreUnavailable` unless the database answers."""
        self._read(lambda conn: conn.execute(select(literal(1))).scalar_one())


__all__ = [
    "DUPLICATES_DROPPED",
    "ON_CONFLICT",
    "PAUSE_KINDS",
    "PURGED",
    "REOPENABLE",
    "REPLACED",
    "REPLACED_ARGUMENTS",
    "REPUBLISHED",
    "RESUBMITTED",
    "SCHEMA_VERSION",
    "BeatRow",
    "Claim",
    "Executor",
    "Expiry",
    "FenceResult",
    "Filter",
    "Fold",
    "FollowUps",
    "Held",
    "InvariantPage",
    "JoinedSubmission",
    "JoinedTransaction",
    "Lease",
    "LeaseOptions",
    "Listener",
    "NewTask",
    "Outcome",
    "Pause",
    "PauseEvent",
    "Publishable",
    "RecordedStep",
    "Refusal",
    "Replacement",
    "Rows",
    "ScheduleRow",
    "Slot",
    "SlotDecision",
    "SlotUsage",
    "Store",
    "Tables",
    "Totals",
    "TransitionEvent",
    "Unique",
    "UniqueAnswer",
    "Waiting",
    "bounded_connection",
    "build",
    "dumps",
    "join_transaction",
    "outbox_transaction",
    "redact",
]
