"""The store: domain operations on the lease tables.

Every state change goes through :meth:`Store._move`: one conditional UPDATE
(compare-and-set on the current state, plus the caller's fence) and the audit
rows, in one transaction. Zero rows updated is a result the caller handles.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Float,
    Integer,
    Row,
    String,
    Text,
    and_,
    any_,
    bindparam,
    case,
    delete,
    func,
    insert,
    literal,
    null,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.dialects import postgresql

from .. import policy, states
from ..config import LeaseConfig
from ..exceptions import SchemaOutOfDate
from ..states import STEP_STARTED, Actor, State
from . import migrations
from ._backlog import BacklogMixin
from ._base import StoreBase, TransitionEvent, bind, state_is
from ._bulk import BulkMixin
from ._health import HealthMixin
from ._marks import PublishedMarks
from ._operator import OperatorMixin
from ._pauses import PausesMixin
from ._retention import RetentionMixin
from ._sql import after, db_now, greatest, seconds_between
from ._steps import StepsMixin
from ._submit_many import SubmitManyMixin
from ._types import Claim, Expiry, Lease, NewTask, Publishable, Refusal
from ._workers import WorkersMixin
from .schema import SCHEMA_VERSION

#: Columns of a new row taken from :class:`NewTask` (bound as ``b_<name>``).
_SUBMIT = (
    "id",
    "name",
    "dedup_key",
    "args",
    "kwargs",
    "options",
    "message",
    "lease_ttl",
    "max_runtime",
    "max_retries",
    "on_timeout",
    "on_exhausted",
    "max_recoveries",
)


def _submit_params(new: NewTask) -> dict[str, Any]:
    params = {f"b_{c}": getattr(new, c) for c in _SUBMIT}
    params["b_countdown"] = new.countdown
    params["b_eta"] = new.eta
    return params


#: Note for rows whose arguments could not be stored: they cannot be re-published.
_NO_ARGS_NOTE = "arguments could not be stored as JSON: recovery needs a person"


class Store(
    StepsMixin,
    WorkersMixin,
    BulkMixin,
    OperatorMixin,
    RetentionMixin,
    HealthMixin,
    PausesMixin,
    BacklogMixin,
    SubmitManyMixin,
    StoreBase,
):
    """Domain operations on the lease tables of one database (thread-safe; fork-safe)."""

    def __init__(self, config: LeaseConfig) -> None:
        super().__init__(config)
        self._marks = PublishedMarks(self.mark_published)

    # -- schema -----------------------------------------------------------------------

    def schema_version(self) -> int | None:
        """The applied schema version (``None``: no lease tables)."""
        return self._read(lambda conn: migrations.current_version(conn, self.t))

    def migrate(self) -> tuple[int | None, int]:
        """Create or upgrade the lease tables; returns (version before, version after)."""
        result = self._tx(lambda conn, _: migrations.migrate(conn, self.t))
        self._schema_checked = True
        return result

    def ensure_schema(self, *, auto_migrate: bool | None = None) -> None:
        """Check the schema once per process; create it on SQLite or when auto-migrate is on."""
        if self._schema_checked:
            return
        current = self.schema_version()
        if current != SCHEMA_VERSION:
            auto = self.config.auto_migrate if auto_migrate is None else auto_migrate
            if not (auto or self.dialect == "sqlite") or (current or 0) > SCHEMA_VERSION:
                raise SchemaOutOfDate(current, SCHEMA_VERSION, self.url)
            self.migrate()
        self._schema_checked = True

    def dispose(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()

    # -- producer ---------------------------------------------------------------------

    def submit(self, new: NewTask, conn: Connection | None = None) -> tuple[str, bool]:
        """Insert a PENDING row; returns (task id, created). A duplicate dedup key or id
        returns the existing row's id with ``created=False``.

        With ``conn`` the row joins the caller's transaction (transactional enqueue).
        Without, the same transaction also records the rows waiting in
        :meth:`mark_published_soon`.
        """
        params = _submit_params(new)
        countdown = new.countdown is not None

        def op(conn: Connection, is_retry: bool, marks: Sequence[str] = ()) -> tuple[str, bool]:
            insert_stmt = self._prepared(
                ("submit", countdown), lambda: self._submit_insert(countdown)
            )
            created = self._execute(
                conn, insert_stmt, params, lambda v: self._submit_insert(countdown, v)
            ).scalar()
            if marks:
                self._mark(conn, marks)
            if created is not None:
                self._audit(conn, new.id, None, State.PENDING, "submitted", "producer", 0)
                return new.id, True
            existing = self._execute(
                conn, self._prepared("existing", self._existing), params, self._existing
            ).scalar()
            if existing is None:  # the conflicting row was purged meanwhile: insert again
                return op(conn, is_retry)
            return str(existing), False

        if conn is not None:
            return op(conn, False)
        marks = self._marks.take()
        try:
            if not self.is_pg:
                return self._tx(lambda conn, is_retry: op(conn, is_retry, marks))

            def fast(conn: Connection, _: bool) -> tuple[str, bool] | None:
                # row, audit row, waiting "published" marks and the dedup answer in one
                # statement: one round trip in autocommit
                stmt = self._prepared(("submit-pg", countdown), lambda: self._submit_pg(countdown))
                row = conn.execute(stmt, {**params, "b_marks": marks}).one()
                if row.created is not None:
                    self._record_event(
                        TransitionEvent(
                            new.id, new.name, None, State.PENDING, "submitted", "producer", 0
                        )
                    )
                    return new.id, True
                if row.existing is not None:
                    return str(row.existing), False
                return None  # a conflicting row this statement's snapshot cannot see

            return self._single_then(fast, op)
        except BaseException:
            self._marks.put_back(marks)
            raise

    def _submit_insert(self, countdown: bool, params: dict[str, Any] | None = None) -> Any:
        t = self.t.tasks
        values: dict[str, Any] = {c: bind(f"b_{c}", t.c[c].type, params) for c in _SUBMIT}
        values.update(
            state=State.PENDING.value,
            created_at=db_now(),
            updated_at=db_now(),
            reason="submitted",
            eta=(
                after(db_now(), bind("b_countdown", Float, params))
                if countdown
                else bind("b_eta", t.c.eta.type, params)
            ),
        )
        return self._insert(t).values(**values).on_conflict_do_nothing().returning(t.c.id)

    def _existing(self, params: dict[str, Any] | None = None) -> Any:
        t = self.t.tasks
        return (
            select(t.c.id)
            .where(
                or_(
                    t.c.id == bind("b_id", t.c.id.type, params),
                    t.c.dedup_key == bind("b_dedup_key", t.c.dedup_key.type, params),
                )
            )
            .limit(1)
        )

    def _submit_pg(self, countdown: bool) -> Any:
        t, tr = self.t.tasks, self.t.transitions
        inserted = self._submit_insert(countdown).cte("inserted")
        audit = insert(tr).from_select(
            ["task_id", "from_state", "to_state", "reason", "actor", "attempt", "at"],
            select(
                inserted.c.id,
                null(),
                literal(State.PENDING.value, String),
                literal("submitted", Text),
                literal("producer", String),
                literal(0, Integer),
                db_now(),
            ),
        )
        marked = self._mark_statement(
            t.c.id == any_(bindparam("b_marks", type_=postgresql.ARRAY(String)))
        )
        # the statement's snapshot does not see its own insert: "existing" is the row
        # that made the insert conflict (a duplicate dedup key or id)
        return select(
            select(inserted.c.id).scalar_subquery().label("created"),
            self._existing().scalar_subquery().label("existing"),
        ).add_cte(audit.cte("audit"), marked.cte("marked"))

    def _mark_statement(self, which: ColumnElement[bool]) -> Any:
        t = self.t.tasks
        return (
            update(t)
            .where(which, state_is(t, State.PENDING), t.c.published_at.is_(None))
            .values(published_at=db_now(), publish_count=t.c.publish_count + 1)
        )

    def _mark(self, conn: Connection, ids: Sequence[str]) -> None:
        t = self.t.tasks
        stmt = self._prepared(
            "mark",
            lambda: self._mark_statement(t.c.id.in_(bindparam("b_ids", expanding=True))),
        )
        conn.execute(stmt, {"b_ids": list(ids)})

    def mark_published(self, ids: Sequence[str]) -> None:
        """Record that these PENDING rows' messages were handed to the broker."""
        if ids:
            self._tx(lambda conn, _: self._mark(conn, ids), single=True)

    def mark_published_soon(self, task_id: str) -> None:
        """:meth:`mark_published` for one row, recorded a few milliseconds later with
        others (in this process's next submit, or in one statement for many rows).

        Until then the row looks unpublished; if this process dies first, the reaper
        publishes the row again after ``lease_publish_grace`` and the extra message is
        dropped at claim.
        """
        self._marks.add(task_id)

    def flush_published(self) -> None:
        """Record every row waiting in :meth:`mark_published_soon` now."""
        self._marks.flush()

    def discard_unpublished(self, task_id: str) -> None:
        """Delete a row whose message could not be built (nothing was published)."""
        t, tr = self.t.tasks, self.t.transitions

        def op(conn: Connection, _: bool) -> None:
            gone = conn.execute(
                delete(t).where(
                    t.c.id == task_id,
                    t.c.state == State.PENDING.value,
                    t.c.attempt == 0,
                    t.c.published_at.is_(None),
                )
            ).rowcount
            if gone:
                conn.execute(delete(tr).where(tr.c.task_id == task_id))

        self._tx(op)

    # -- worker: claim and outcome ----------------------------------------------------

    def claim(
        self,
        task_id: str,
        owner: str,
        actor: str,
        adopt: NewTask | Callable[[], NewTask] | None = None,
    ) -> Claim | Refusal:
        """Compare-and-set PENDING -> RUNNING (attempt += 1). A delivery without a row is
        adopted when ``adopt`` describes it (or builds it: only called when needed);
        anything else is refused."""
        t = self.t.tasks
        token = uuid.uuid4().hex
        reason = f"claimed by {actor}"
        params = {"b_task_id": task_id, "b_token": token, "b_owner": owner}

        def claimed(r: Row[Any], adopted: bool) -> Claim:
            return Claim(
                lease=Lease(task_id, int(r.attempt), token),
                retries=int(r.retries),
                recoveries=int(r.recoveries),
                resumed=adopted or int(r.attempt) > 1,
                cancel_requested=r.cancel_requested_at is not None,
            )

        def move(conn: Connection) -> list[Row[Any]]:
            return self._move_prepared(
                conn,
                "claim",
                self._claim_spec,
                params,
                State.PENDING,
                State.RUNNING,
                reason=reason,
                actor=actor,
            )

        def fast(conn: Connection, _: bool) -> Claim | Refusal | None:
            # the claim, its audit row and, when it fails, the row's state: one statement
            stmt = self._prepared("claim-pg", self._claim_pg)
            row = conn.execute(stmt, {**params, "b_reason": reason, "b_actor": actor}).first()
            if row is None:
                return None  # no row: adopt it, or refuse, in a transaction
            if row.attempt is not None:
                self._record_event(
                    TransitionEvent(
                        task_id, row.name, State.PENDING, State.RUNNING, reason, actor, row.attempt
                    )
                )
                return claimed(row, False)
            if row.state == State.PENDING.value or row.token == token:
                # not due yet, or a claim that raced this one (the snapshot predates it),
                # or our own first try whose answer was lost: decided in a transaction
                return None
            state = State(row.state)
            return Refusal(task_id, state, f"task is {state}")

        def op(conn: Connection, is_retry: bool) -> Claim | Refusal:
            rows = move(conn)
            adopted = False
            if not rows:
                due = self._claim_spec()[0][1]
                row = conn.execute(
                    select(t.c.state, t.c.token, ~due.self_group()).where(t.c.id == task_id)
                ).first()
                if row is not None and row.state == State.PENDING.value and row[2]:
                    return Refusal(task_id, State.PENDING, "arrived before its ETA", early=True)
                if row is not None and row.state == State.PENDING.value:
                    # its ETA came between the claim and the read (a retry is delivered
                    # at its ETA, to the millisecond): claim it now
                    rows = move(conn)
                elif row is None and adopt is not None:
                    self._adopt(conn, adopt() if callable(adopt) else adopt)
                    adopted = True
                    rows = move(conn)  # an adopted row has no ETA: due at once
                elif row is not None and is_retry and row.token == token:
                    # the first try committed but its answer was lost
                    again = select(t.c.id, t.c.attempt, *self._claim_spec()[2]).where(
                        t.c.id == task_id
                    )
                    rows = list(conn.execute(again))
                if not rows:
                    state = State(row.state) if row is not None else None
                    why = "no row for this message" if row is None else f"task is {state}"
                    return Refusal(task_id, state, why)
            return claimed(rows[0], adopted)

        if not self.is_pg:
            return self._tx(op)
        return self._single_then(fast, op)

    def _claim_spec(
        self,
    ) -> tuple[list[ColumnElement[bool]], dict[str, Any], tuple[Any, ...]]:
        """Where, values and returning of a claim, with bind parameters ``b_task_id``,
        ``b_token`` and ``b_owner``."""
        t = self.t.tasks
        # a message that arrives before its ETA by database time (a worker whose clock
        # runs ahead) is not claimed: it is published again with the remaining delay
        due = or_(t.c.eta.is_(None), t.c.eta <= db_now())
        values = {
            "attempt": t.c.attempt + 1,
            "token": bindparam("b_token", type_=t.c.token.type),
            "owner": bindparam("b_owner", type_=t.c.owner.type),
            "started_at": db_now(),
            "progress_at": db_now(),
            "finished_at": None,
            "next_retry_at": None,
        }
        where = [t.c.id == bindparam("b_task_id", type_=t.c.id.type), due]
        return where, values, (t.c.retries, t.c.recoveries, t.c.cancel_requested_at)

    def _claim_pg(self) -> Any:
        t = self.t.tasks
        where, values, returning = self._claim_spec()
        update_stmt = self._move_update(where, State.PENDING, State.RUNNING, values, returning)
        moved, audit = self._move_ctes(update_stmt, State.PENDING, State.RUNNING)
        row = t.alias("row")
        # one row per existing task: the claim's answer, or (claim refused) the state the
        # statement's snapshot saw; no row when the task has none
        return (
            select(
                moved.c.attempt,
                moved.c.name,
                moved.c.retries,
                moved.c.recoveries,
                moved.c.cancel_requested_at,
                row.c.state,
                row.c.token,
            )
            .select_from(row.outerjoin(moved, true()))
            .where(row.c.id == bindparam("b_task_id", type_=t.c.id.type))
            .add_cte(audit)
        )

    def _adopt(self, conn: Connection, new: NewTask) -> None:
        t = self.t.tasks
        stmt = (
            self._insert(t)
            .values(
                id=new.id,
                name=new.name,
                state=State.PENDING.value,
                args=new.args,
                kwargs=new.kwargs,
                options=new.options,
                message=new.message,
                lease_ttl=new.lease_ttl,
                max_runtime=new.max_runtime,
                max_retries=new.max_retries,
                on_timeout=new.on_timeout if new.args is not None else "manual",
                on_exhausted=new.on_exhausted,
                max_recoveries=new.max_recoveries,
                created_at=db_now(),
                updated_at=db_now(),
                published_at=db_now(),
                reason="adopted",
            )
            .on_conflict_do_nothing()
            .returning(t.c.id)
        )
        if conn.execute(stmt).scalar() is not None:
            reason = "adopted: message without a row"
            if new.args is None:
                reason += f" ({_NO_ARGS_NOTE})"
            self._audit(conn, new.id, None, State.PENDING, reason, "worker", 0)

    def finish(
        self,
        lease: Lease,
        to: State,
        *,
        actor: str,
        reason: str,
        result: str | None = None,
        error: str | None = None,
    ) -> bool:
        """The execution's own outcome (SUCCEEDED, FAILED, CANCELLED, WAIT_MANUAL),
        fenced by attempt and token. ``False``: the lease was lost; nothing was written."""
        t = self.t.tasks
        values: dict[str, Any] = {"finished_at": db_now(), "result": result, "error": error}
        # RUNNING first; over max_runtime the row went to WAIT_MANUAL but its owner kept
        # running, and may still finish from there
        sources = sorted(states.sources(to, Actor.TASK), key=lambda s: s is not State.RUNNING)

        def fast(conn: Connection, _: bool) -> bool | None:
            moved = self._move_prepared(
                conn,
                ("finish", to),
                self._finish_spec,
                {
                    "b_task_id": lease.task_id,
                    "b_attempt": lease.attempt,
                    "b_token": lease.token,
                    "b_result": result,
                    "b_error": error,
                },
                State.RUNNING,
                to,
                reason=reason,
                actor=actor,
            )
            return True if moved else None

        def op(conn: Connection, is_retry: bool) -> bool:
            for frm in sources:
                if self._move(
                    conn, self._fenced(lease), frm, to, reason=reason, actor=actor, values=values
                ):
                    return True
            if is_retry:
                row = conn.execute(
                    select(t.c.state, t.c.token).where(t.c.id == lease.task_id)
                ).first()
                return row is not None and row.token == lease.token and row.state == to.value
            return False

        return self._single_then(fast, op)

    def _finish_spec(self) -> tuple[list[ColumnElement[bool]], dict[str, Any], tuple[Any, ...]]:
        """Where and values of an outcome, fenced by bind parameters ``b_task_id``,
        ``b_attempt`` and ``b_token``; ``b_result`` and ``b_error`` are stored."""
        t = self.t.tasks
        where = [
            t.c.id == bindparam("b_task_id", type_=t.c.id.type),
            t.c.attempt == bindparam("b_attempt", type_=t.c.attempt.type),
            t.c.token == bindparam("b_token", type_=t.c.token.type),
        ]
        values = {
            "finished_at": db_now(),
            "result": bindparam("b_result", type_=t.c.result.type),
            "error": bindparam("b_error", type_=t.c.error.type),
        }
        return where, values, ()

    def schedule_retry(
        self,
        lease: Lease,
        delay: float,
        *,
        actor: str,
        reason: str,
        error: str | None,
        message: str | None = None,
        requeued: bool = False,
    ) -> bool:
        """RUNNING -> RETRY_WAIT -> PENDING, fenced, in one transaction: the retry is due
        ``delay`` seconds from now (database time) and its message goes out at once.

        ``message``: the retry's message as Celery built it (stored in the row, which is
        its outbox: if it is never published, the reaper publishes it). ``requeued``:
        the broker keeps the delivered message (a ``Reject(requeue=True)``), so the row
        is recorded published. ``False``: the lease was lost; nothing was written."""
        t = self.t.tasks
        retry_values: dict[str, Any] = {
            "next_retry_at": after(db_now(), delay),
            "retries": t.c.retries + 1,
            "error": error,
        }
        due: dict[str, Any] = {
            "eta": t.c.next_retry_at,
            "next_retry_at": None,
            "published_at": db_now() if requeued else None,
            "publish_count": 0,
        }
        if message is not None:
            due["message"] = message

        def op(conn: Connection, is_retry: bool) -> bool:
            rows = self._move(
                conn,
                self._fenced(lease),
                State.RUNNING,
                State.RETRY_WAIT,
                reason=reason,
                actor=actor,
                values=retry_values,
            )
            if rows:
                self._move(
                    conn,
                    [t.c.id == lease.task_id],
                    State.RETRY_WAIT,
                    State.PENDING,
                    reason=f"retry {'requeued' if requeued else 'published'} by its worker",
                    actor=actor,
                    values=due,
                )
                return True
            if is_retry:
                row = conn.execute(
                    select(t.c.state, t.c.token).where(t.c.id == lease.task_id)
                ).first()
                return row is not None and row.token == lease.token and row.state == "PENDING"
            return False

        return self._tx(op)

    # -- lease expiry -----------------------------------------------------------------

    def _expired_condition(self) -> ColumnElement[bool]:
        t, w = self.t.tasks, self.t.workers
        return or_(
            w.c.id.is_(None),
            w.c.stopped_at.is_not(None),
            after(w.c.heartbeat_at, t.c.lease_ttl) < db_now(),
        )

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

    # -- publishing (the row is the outbox) -------------------------------------------

    def _publishable_columns(self) -> tuple[Any, ...]:
        t = self.t.tasks
        return (
            t.c.name,
            t.c.args,
            t.c.kwargs,
            t.c.options,
            t.c.retries,
            seconds_between(t.c.eta, db_now()).label("countdown"),
            t.c.message,
        )

    @staticmethod
    def _publishable(rows: Iterable[Row[Any]]) -> list[Publishable]:
        out = []
        for r in rows:
            countdown = float(r.countdown) if r.countdown is not None and r.countdown > 0 else None
            out.append(
                Publishable(
                    str(r.id),
                    r.name,
                    r.args,
                    r.kwargs,
                    r.options,
                    int(r.retries),
                    countdown,
                    r.message,
                )
            )
        return out

    def take_due_retries(self, *, actor: str, limit: int | None = None) -> list[Publishable]:
        """RETRY_WAIT rows whose ``next_retry_at`` has come -> PENDING, to publish."""
        t = self.t.tasks
        batch = limit or self.config.reaper_batch_size

        def op(conn: Connection, _: bool) -> list[Publishable]:
            q = (
                select(t.c.id)
                .where(t.c.state == State.RETRY_WAIT.value, t.c.next_retry_at <= db_now())
                .order_by(t.c.next_retry_at)
                .limit(batch)
            )
            if self.is_pg:
                q = q.with_for_update(skip_locked=True)
            ids = [r.id for r in conn.execute(q).all()]
            if not ids:
                return []
            rows = self._move(
                conn,
                [t.c.id.in_(ids)],
                State.RETRY_WAIT,
                State.PENDING,
                reason="retry due: re-published",
                actor=actor,
                # a new run of the row: its lost-message backoff starts over
                values={"published_at": None, "eta": None, "publish_count": 0},
                returning=self._publishable_columns(),
            )
            return self._publishable(rows)

        return self._tx(op)

    def take_pending(self, task_ids: Sequence[str]) -> list[Publishable]:
        """These rows, if still PENDING, reserved for publishing again at once (their
        message was lost with a pool child before it could claim)."""
        t = self.t.tasks

        def op(conn: Connection, _: bool) -> list[Publishable]:
            rows = conn.execute(
                update(t)
                .where(t.c.id.in_(task_ids), t.c.state == State.PENDING.value)
                .values(published_at=None, updated_at=db_now())
                .returning(t.c.id, *self._publishable_columns())
            ).all()
            return self._publishable(rows)

        return self._tx(op)

    def take_unpublished(self, *, limit: int | None = None) -> list[Publishable]:
        """PENDING rows never marked published after the grace, or published but not
        claimed for ``republish_after`` (message lost): reserved for re-publishing."""
        t = self.t.tasks
        cfg = self.config
        batch = limit or cfg.reaper_batch_size
        now = db_now()
        never = and_(t.c.published_at.is_(None), after(t.c.updated_at, cfg.publish_grace) < now)
        # each re-publish of the same row waits twice as long (capped at 64x): a long
        # backlog, which looks like a lost message, is duplicated a few times, not flooded
        backoff = case(
            (t.c.publish_count <= 1, literal(1)),
            (t.c.publish_count >= 7, literal(64)),
            else_=literal(1).op("<<")(t.c.publish_count - 1),
        )
        lost = (
            after(
                greatest(func.coalesce(t.c.eta, t.c.published_at), t.c.published_at),
                literal(cfg.republish_after) * backoff,
            )
            < now
        )

        def op(conn: Connection, _: bool) -> list[Publishable]:
            q = (
                select(t.c.id)
                .where(t.c.state == State.PENDING.value, or_(never, lost))
                .where(self.paused_names_clause())  # held until the pause ends
                .limit(batch)
            )
            if self.is_pg:
                q = q.with_for_update(skip_locked=True)
            ids = [r.id for r in conn.execute(q).all()]
            if not ids:
                return []
            # reserve: a concurrent reaper sees a fresh updated_at and leaves these alone;
            # if this one dies before publishing, the grace sweep picks them up again
            rows = conn.execute(
                update(t)
                .where(t.c.id.in_(ids), t.c.state == State.PENDING.value)
                .values(published_at=None, updated_at=db_now())
                .returning(t.c.id, *self._publishable_columns())
            ).all()
            return self._publishable(rows)

        return self._tx(op)
