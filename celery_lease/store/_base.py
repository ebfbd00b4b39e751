"""Transactions, the one compare-and-set with its audit rows, and what every operation
shares (thread-safe; fork-safe).

Every state change goes through :meth:`StoreBase._move` (or its batch form
:meth:`StoreBase._move_each`): one conditional UPDATE (compare-and-set on the current
state, plus the caller's fence) and the audit rows, in one transaction. Zero rows
updated is a result the caller handles. A transaction is retried on a transient
driver error, with jittered backoff, all within ``lease_db_timeout``; any other driver
error is wrapped once in a :class:`~celery_lease.exceptions.StoreError`.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar

from sqlalchemy import (
    CTE,
    ColumnElement,
    Connection,
    Engine,
    Executable,
    Insert,
    Integer,
    Row,
    Select,
    String,
    Table,
    Text,
    bindparam,
    case,
    column,
    exc,
    func,
    insert,
    literal,
    null,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql.dml import ReturningUpdate

from .. import states
from ..config import LeaseConfig
from ..exceptions import StoreDataError, StoreError, StoreUnavailable
from ..states import Actor, State
from . import _db
from ._db import WATCHDOG, redact, safe_url
from ._types import Executor, Lease, Listener, Publishable, TransitionEvent
from .schema import Tables, build, db_now, seconds_between

T = TypeVar("T")

logger = logging.getLogger("celery_lease.store")

#: The reason and actor of a transition: bind parameters, so a statement is built once.
_REASON = bindparam("b_reason", type_=Text)


_ACTOR = bindparam("b_actor", type_=String)


def state_is(tasks: Table, state: State) -> ColumnElement[bool]:
    """``tasks.state = state``, written so that no index on ``state`` can drive the
    scan. Every transition names its rows by primary key; on PostgreSQL a prepared
    statement's generic plan (or any plan made from statistics taken while few rows
    had that state) may otherwise walk the state index, and so every PENDING or
    RUNNING row of a backlog, on each claim, outcome and mark."""
    column: ColumnElement[str] = tasks.c.state
    return column.concat("") == state.value


def dumps(value: Any) -> str:
    """Compact JSON, as stored in the text columns."""
    return json.dumps(value, separators=(",", ":"))


_TRANSIENT_PG_CODES = {
    "40001",
    "40P01",
    "57P01",
    "57P02",
    "57P03",
    "08000",
    "08003",
    "08006",
    "08001",
}


def is_transient(error: exc.DBAPIError) -> bool:
    """Whether retrying the transaction may succeed (connection lost, lock busy, serialization)."""
    if error.connection_invalidated:
        return True
    code = getattr(error.orig, "sqlstate", None) or getattr(error.orig, "pgcode", None)
    if code in _TRANSIENT_PG_CODES:
        return True
    return isinstance(error, (exc.OperationalError, exc.InterfaceError))


def wrap(error: exc.SQLAlchemyError, url: str, *, timeout: float | None = None) -> StoreError:
    """The library's exception for a driver error (the cause is kept by ``raise ... from``).

    ``timeout``: the call ran out of its ``lease_db_timeout`` (said in the message).
    """
    detail = str(getattr(error, "orig", None) or error).strip().splitlines()
    first = redact(detail[0]) if detail else type(error).__name__
    if timeout is not None:
        return StoreUnavailable(
            f"lease store {url} unavailable: no answer within {timeout:g} s "
            f"(lease_db_timeout): {first}"
        )
    if isinstance(error, exc.DBAPIError) and is_transient(error):
        return StoreUnavailable(f"lease store {url} unavailable: {first}")
    if isinstance(error, exc.TimeoutError):  # no free connection in the pool in time
        return StoreUnavailable(f"lease store {url} unavailable: {first}")
    if isinstance(error, (exc.DataError, exc.IntegrityError)):
        # the value was wrong (too long, out of range, a constraint), not the database
        return StoreDataError(f"lease store {url} refused a value: {first}")
    return StoreError(f"lease store {url}: {first}")


def retrying(fn: Callable[[bool], T], *, retries: int, url: str, timeout: float | None = None) -> T:
    """Run ``fn(is_retry)``, retrying transient driver errors with jittered exponential
    backoff, all within ``timeout`` seconds (``None``: no deadline).

    Past the deadline the watchdog shuts down the connection the call is blocked on,
    and no further try starts: the call ends with :class:`StoreUnavailable`.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    outer = None if deadline is None else WATCHDOG.arm(deadline)
    try:
        for attempt in range(retries + 1):
            try:
                return fn(attempt > 0)
            except exc.DBAPIError as error:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise wrap(error, url, timeout=timeout) from error
                if attempt < retries and is_transient(error):
                    pause = random.uniform(0, min(2.0, 0.05 * 2**attempt))
                    time.sleep(pause if left is None else min(pause, left))
                    continue
                raise wrap(error, url) from error
            except exc.SQLAlchemyError as error:
                raise wrap(error, url) from error
    finally:
        if outer is not None:
            WATCHDOG.disarm(outer)
    raise AssertionError("unreachable")


#: States a row can hold a concurrency slot in: leaving one may free a slot (the grant
#: that follows counts; see :mod:`celery_lease.store._slots`).
_HOLDING = frozenset({State.RUNNING, State.WAIT_MANUAL})


def _close_pool(engine: Engine) -> None:
    """Close the pooled connections of a store that was dropped. Run by the garbage
    collector, so it closes the pool without making a new one: ``Engine.dispose()``
    would build a fresh pool and register its event listeners, and SQLAlchemy's event
    registry is not safe to change from inside a collection (sqlalchemy#6740: its
    weakref callbacks then fail with ``KeyError``)."""
    engine.pool.dispose()


class StoreBase:
    """Connection handling shared by the domain operations (thread-safe; fork-safe)."""

    def __init__(self, config: LeaseConfig) -> None:
        self.config = config
        self.engine = _db.create(config)
        # a store dropped with its app (Celery's pytest fixtures make an app per test)
        # closes its pooled connections at once, not when the server notices
        weakref.finalize(self, _close_pool, self.engine).atexit = False
        self.url = safe_url(self.engine.url)
        self.t: Tables = build(config.table_prefix, config.schema, config.origin)
        self.dialect = self.engine.dialect.name
        self.is_pg = self.dialect == "postgresql"
        #: Keeps fork() out of SQLite transactions (see _db.fork_guard).
        self._fork_guard = _db.fork_guard(self.engine)
        self._schema_checked = False
        #: Called after each commit with its transitions (logs, events, metrics, backends).
        self.listeners: list[Listener] = []
        #: Called after a commit that ended RUNNING rows of limited tasks, with their
        #: (task name, concurrency key) pairs: the slots it freed (or that marked a row
        #: waiting: a free it raced may be granted only then). The app's runtime sets
        #: it to grant those slots to waiting rows and publish them at once; unset, the
        #: reaper's sweep does it (see :mod:`celery_lease.store._slots`).
        self.on_slots_freed: Callable[[Sequence[tuple[str, str]]], None] | None = None
        self._local = threading.local()
        #: Statements built once (see :meth:`_prepared`).
        self._statements: dict[Hashable, Any] = {}
        # PostgreSQL: single-statement operations run in autocommit, one round trip
        # instead of BEGIN / statement / COMMIT
        self._autocommit = (
            self.engine.execution_options(isolation_level="AUTOCOMMIT") if self.is_pg else None
        )

    # -- plumbing ---------------------------------------------------------------------

    def _tx(
        self,
        fn: Callable[[Connection, bool], T],
        *,
        single: bool = False,
        timeout: float | Literal["db_timeout"] | None = "db_timeout",
    ) -> T:
        """Run ``fn(conn, is_retry)`` in one transaction, retrying transient errors,
        all within ``timeout`` seconds (by default ``lease_db_timeout``; ``None``: no
        deadline, for a migration).

        ``single=True`` promises that ``fn`` executes exactly one statement: on
        PostgreSQL it then runs in autocommit (the statement is its own transaction).
        """

        committed_frees: set[tuple[str, str]] = set()

        def attempt(is_retry: bool) -> T:
            events: list[TransitionEvent] = []
            freed: set[tuple[str, str]] = set()
            self._local.events = events
            self._local.freed = freed
            try:
                if single and self._autocommit is not None:
                    with self._autocommit.connect() as conn:
                        result = fn(conn, is_retry)
                else:
                    with self._fork_guard, self.engine.begin() as conn:
                        result = fn(conn, is_retry)
            finally:
                self._local.events = None
                self._local.freed = None
            if events:
                self.announce(events)
            committed_frees.update(freed)
            return result

        result = retrying(
            attempt,
            retries=self.config.db_retries,
            url=self.url,
            timeout=self.config.db_timeout if timeout == "db_timeout" else timeout,
        )
        if committed_frees:
            self._slots_freed(sorted(committed_frees))
        return result

    def _slots_freed(self, pairs: Sequence[tuple[str, str]]) -> None:
        """Hand committed frees to :attr:`on_slots_freed` (its error is logged: the
        reaper's sweep grants what it could not)."""
        hook = self.on_slots_freed
        if hook is None:
            return
        try:
            hook(pairs)
        except Exception:
            logger.exception("celery-lease: granting freed concurrency slots failed")

    def _note_grant_due(self, name: str, key: str) -> None:
        """Grant (name, key) once the caller's transaction commits (a slot freed, or a
        row marked waiting: see :meth:`~celery_lease.store._slots.Slots.mark_waiting`)."""
        freed: set[tuple[str, str]] | None = getattr(self._local, "freed", None)
        if freed is not None:
            freed.add((name, key))

    def _note_frees(self, rows: Iterable[Row[Any]]) -> None:
        """Rows that just left RUNNING (or WAIT_MANUAL): those of limited tasks freed a
        slot each (the state change is the free, so it happens once, with the fenced
        write; a WAIT_MANUAL row held one only after an overrun, and the grant counts)."""
        for row in rows:
            key = row._mapping.get("slot_key")
            if key is not None:
                self._note_grant_due(str(row.name), str(key))

    def _single_then(
        self,
        fast: Callable[[Connection, bool], T | None],
        slow: Callable[[Connection, bool], T],
    ) -> T:
        """Try ``fast`` (one statement, autocommit on PostgreSQL); when it answers
        ``None`` run ``slow`` in a full transaction. ``slow`` is told whether any try
        may have committed without its answer reaching us."""
        retried = False

        def first(conn: Connection, is_retry: bool) -> T | None:
            nonlocal retried
            retried = retried or is_retry
            return fast(conn, is_retry)

        result = self._tx(first, single=True)
        if result is not None:
            return result
        return self._tx(lambda conn, is_retry: slow(conn, is_retry or retried))

    def announce(self, events: Sequence[TransitionEvent]) -> None:
        """Hand committed transitions to the listeners (a listener's error is logged).

        The store's own transactions do it after their commit; a caller whose
        transaction a submission joined (:meth:`submit_joined`) does it after its own.
        """
        for listener in list(self.listeners):
            try:
                listener(events)
            except Exception:
                logger.exception("celery-lease: transition listener %r failed", listener)

    def _record_event(self, event: TransitionEvent) -> None:
        events: list[TransitionEvent] | None = getattr(self._local, "events", None)
        if events is not None:
            events.append(event)

    def _read(self, fn: Callable[[Connection], T]) -> T:
        def attempt(is_retry: bool) -> T:
            with (
                self._fork_guard,
                self.engine.connect().execution_options(lease_readonly=True) as conn,
            ):
                return fn(conn)

        return retrying(
            attempt, retries=self.config.db_retries, url=self.url, timeout=self.config.db_timeout
        )

    def _insert(self, table: Table) -> postgresql.Insert | sqlite.Insert:
        """INSERT with the dialect's ``ON CONFLICT`` clauses."""
        return (postgresql.insert if self.is_pg else sqlite.insert)(table)

    def _take_ids(self, conn: Connection, q: Select[Any]) -> list[str]:
        """The ids ``q`` (a SELECT of task ids) finds, for the caller's transaction to
        take: on PostgreSQL the rows are locked ``FOR UPDATE SKIP LOCKED``, so a row
        another transaction holds (a concurrent reaper's batch, a claim) is left for a
        later batch, never waited for."""
        if self.is_pg:
            q = q.with_for_update(skip_locked=True)
        return [str(r.id) for r in conn.execute(q).all()]

    def _prepared(self, key: Hashable, build: Callable[[], T]) -> T:
        """The statement stored under ``key``, built by ``build()`` the first time.

        Building a statement and computing its cache key costs more client CPU than
        running it: the hot operations build theirs once, with bind parameters, and
        only pass values afterwards (SQLAlchemy memoizes the cache key of a statement
        object, and psycopg prepares a statement text it sees again)."""
        stmt = self._statements.get(key)
        if stmt is None:
            stmt = self._statements[key] = build()
        return stmt

    def _move_statement(
        self,
        where: Sequence[ColumnElement[bool]],
        frm: State,
        to: State,
        values: dict[str, Any] | None = None,
        returning: Iterable[Any] = (),
    ) -> tuple[Executable, Executable | None]:
        """The compare-and-set ``frm -> to`` and, on SQLite, its separate audit insert.

        ``reason`` and ``actor`` are bind parameters (``b_reason``, ``b_actor``): the
        statement can be built once and run for any transition of this shape.
        """
        stmt = self._move_update(where, frm, to, values, returning)
        if not self.is_pg:
            audit = insert(self.t.transitions).values(
                task_id=bindparam("b_task_id", type_=String),
                from_state=frm.value,
                to_state=to.value,
                reason=_REASON,
                actor=_ACTOR,
                attempt=bindparam("b_attempt", type_=Integer),
                at=db_now(),
            )
            return stmt, audit
        moved, audit_cte = self._move_ctes(stmt, frm, to)
        return select(moved).add_cte(audit_cte), None

    def _move_update(
        self,
        where: Sequence[ColumnElement[bool]],
        frm: State,
        to: State,
        values: dict[str, Any] | None = None,
        returning: Iterable[Any] = (),
    ) -> ReturningUpdate[Any]:
        """The conditional UPDATE of a transition (bind parameter ``b_reason``)."""
        states.check(frm, to)
        t = self.t.tasks
        # a row leaving RUNNING (or WAIT_MANUAL, after an overrun whose run went on)
        # tells whether it held a concurrency slot
        freeing = (t.c.slot_key,) if frm in _HOLDING else ()
        return (
            update(t)
            .where(state_is(t, frm), *where)
            .values(state=to.value, updated_at=db_now(), reason=_REASON, **(values or {}))
            .returning(t.c.id, t.c.attempt, t.c.name, *freeing, *returning)
        )

    def _move_ctes(self, stmt: ReturningUpdate[Any], frm: State, to: State) -> tuple[CTE, CTE]:
        """PostgreSQL: the UPDATE ``stmt`` as CTE ``moved`` and its audit insert as CTE
        ``audit`` (a statement that selects from ``moved`` adds ``audit`` with
        ``add_cte``; data-modifying CTEs must stay at the top level)."""
        moved = stmt.cte("moved")
        audit = insert(self.t.transitions).from_select(
            ["task_id", "from_state", "to_state", "reason", "actor", "attempt", "at"],
            select(
                moved.c.id,
                literal(frm.value, String),
                literal(to.value, String),
                _REASON,
                _ACTOR,
                moved.c.attempt,
                db_now(),
            ),
        )
        return moved, audit.cte("audit")

    def _move(
        self,
        conn: Connection,
        where: Sequence[ColumnElement[bool]],
        frm: State,
        to: State,
        *,
        reason: str,
        actor: str,
        values: dict[str, Any] | None = None,
        returning: Iterable[Any] = (),
    ) -> list[Row[Any]]:
        """Compare-and-set ``frm -> to`` on the rows matching ``where``, with audit rows.

        On PostgreSQL the state change and its audit rows are one statement (a
        data-modifying CTE), so a caller running only this is one round trip.
        """
        statements = self._move_statement(where, frm, to, values, returning)
        return self._run_move(conn, statements, {}, frm, to, reason=reason, actor=actor)

    def _move_prepared(
        self,
        conn: Connection,
        key: Hashable,
        build: Callable[[], tuple[Sequence[ColumnElement[bool]], dict[str, Any], Iterable[Any]]],
        params: dict[str, Any],
        frm: State,
        to: State,
        *,
        reason: str,
        actor: str,
    ) -> list[Row[Any]]:
        """:meth:`_move` with a statement built once (``build()`` gives where, values
        and returning, written with bind parameters that ``params`` fills)."""

        def statements() -> tuple[Executable, Executable | None]:
            where, values, returning = build()
            return self._move_statement(where, frm, to, values, returning)

        prepared = self._prepared(("move", key, frm, to), statements)
        return self._run_move(conn, prepared, params, frm, to, reason=reason, actor=actor)

    def _run_move(
        self,
        conn: Connection,
        statements: tuple[Executable, Executable | None],
        params: dict[str, Any],
        frm: State,
        to: State,
        *,
        reason: str,
        actor: str,
    ) -> list[Row[Any]]:
        stmt, audit = statements
        rows = list(conn.execute(stmt, {**params, "b_reason": reason, "b_actor": actor}).all())
        if frm in _HOLDING:
            self._note_frees(rows)
        for row in rows:
            self._record_event(
                TransitionEvent(row.id, row.name, frm, to, reason, actor, int(row.attempt))
            )
        if rows and audit is not None:
            conn.execute(
                audit,
                [
                    {
                        "b_task_id": row.id,
                        "b_attempt": row.attempt,
                        "b_reason": reason,
                        "b_actor": actor,
                    }
                    for row in rows
                ],
            )
        return rows

    def _move_each(
        self,
        conn: Connection,
        frm: State,
        moves: Sequence[tuple[str, State, str]],
        *,
        actor: str,
        stamps: Mapping[State, str],
    ) -> list[Row[Any]]:
        """Compare-and-set ``frm -> to`` for many rows at once, each ``(task id, to,
        reason)`` with its own destination and reason, with their audit rows.

        ``stamps`` names the timestamp column a destination sets to the database's time
        (``next_retry_at`` for a retry due now, ``finished_at`` for a final state).
        On PostgreSQL the whole batch is one statement (``UPDATE ... FROM unnest(...)``,
        the audit rows inserted by a CTE over the updated rows); on SQLite one statement
        per row in the caller's transaction (no round trip to pay).
        """
        if not moves:
            return []
        for task_id, to, _ in moves:
            states.check(frm, to, task_id)
        if not self.is_pg:
            rows: list[Row[Any]] = []
            for task_id, to, reason in moves:
                values = {stamps[to]: db_now()} if to in stamps else {}
                rows += self._move(
                    conn,
                    [self.t.tasks.c.id == task_id],
                    frm,
                    to,
                    reason=reason,
                    actor=actor,
                    values=values,
                    returning=(self.t.tasks.c.state,),
                )
            return rows
        key = ("move_each", frm, tuple(sorted((s.value, c) for s, c in stamps.items())))
        stmt = self._prepared(key, lambda: self._move_each_statement(frm, stamps))
        params = {
            "b_ids": [m[0] for m in moves],
            "b_tos": [m[1].value for m in moves],
            "b_reasons": [m[2] for m in moves],
            "b_actor": actor,
        }
        rows = list(conn.execute(stmt, params).all())
        if frm in _HOLDING:
            self._note_frees(rows)
        for row in rows:
            self._record_event(
                TransitionEvent(
                    row.id, row.name, frm, State(row.state), row.reason, actor, int(row.attempt)
                )
            )
        return rows

    def _move_each_statement(self, frm: State, stamps: Mapping[State, str]) -> Executable:
        t = self.t.tasks
        v = (
            func.unnest(
                bindparam("b_ids", type_=ARRAY(String)),
                bindparam("b_tos", type_=ARRAY(String)),
                bindparam("b_reasons", type_=ARRAY(Text)),
            )
            .table_valued(column("id", String), column("to_state", String), column("reason", Text))
            .render_derived(name="v")
        )
        columns: dict[str, list[State]] = {}
        for to, name in stamps.items():
            columns.setdefault(name, []).append(to)
        stamped = {
            name: case((v.c.to_state.in_([s.value for s in tos]), db_now()), else_=t.c[name])
            for name, tos in columns.items()
        }
        moved = (
            update(t)
            .where(t.c.id == v.c.id, state_is(t, frm))
            .values(state=v.c.to_state, updated_at=db_now(), reason=v.c.reason, **stamped)
            .returning(t.c.id, t.c.attempt, t.c.name, t.c.state, t.c.reason, t.c.slot_key)
            .cte("moved")
        )
        return select(moved).add_cte(self._audit_of(moved, frm))

    def _audit_of(self, moved: CTE, frm: State) -> CTE:
        """PostgreSQL: the audit rows of the rows a CTE ``moved`` changed from ``frm``
        (its ``id``, ``attempt``, new ``state`` and ``reason``), as CTE ``audit``."""
        return (
            insert(self.t.transitions)
            .from_select(
                ["task_id", "from_state", "to_state", "reason", "actor", "attempt", "at"],
                select(
                    moved.c.id,
                    literal(frm.value, String),
                    moved.c.state,
                    moved.c.reason,
                    _ACTOR,
                    moved.c.attempt,
                    db_now(),
                ),
            )
            .cte("audit")
        )

    def _submitted_audit(self, inserted: Any) -> Any:
        """PostgreSQL: the ``None -> PENDING`` audit rows of the rows a CTE inserted,
        as CTE ``audit``."""
        return (
            insert(self.t.transitions)
            .from_select(
                ["task_id", "from_state", "to_state", "reason", "actor", "attempt", "at"],
                select(
                    inserted.c.id,
                    null(),
                    literal(State.PENDING.value, String),
                    literal("submitted", Text),
                    literal(Actor.PRODUCER.value, String),
                    literal(0, Integer),
                    db_now(),
                ),
            )
            .cte("audit")
        )

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
            t.c.origin,
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
                    r.origin,
                )
            )
        return out

    def _fenced(self, lease: Lease) -> list[ColumnElement[bool]]:
        t = self.t.tasks
        return [t.c.id == lease.task_id, t.c.attempt == lease.attempt, t.c.token == lease.token]

    def _audit(
        self,
        conn: Executor,
        task_id: str,
        frm: State | None,
        to: State,
        reason: str,
        actor: str,
        attempt: int,
    ) -> None:
        states.check(frm, to, task_id)
        self._record_event(TransitionEvent(task_id, None, frm, to, reason, actor, attempt))
        params = {
            "b_task_id": task_id,
            "b_from": frm.value if frm else None,
            "b_to": to.value,
            "b_reason": reason,
            "b_actor": actor,
            "b_attempt": attempt,
        }
        conn.execute(self._prepared("audit", self._audit_insert), params)

    def _audit_insert(self) -> Insert:
        return insert(self.t.transitions).values(
            task_id=bindparam("b_task_id", type_=String),
            from_state=bindparam("b_from", type_=String),
            to_state=bindparam("b_to", type_=String),
            reason=_REASON,
            actor=_ACTOR,
            attempt=bindparam("b_attempt", type_=Integer),
            at=db_now(),
        )
