"""Store plumbing: engine, transactions with retries, the one compare-and-set helper."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from sqlalchemy import ColumnElement, Connection, Row, String, Text, insert, literal, select, update
from sqlalchemy.dialects import postgresql, sqlite

from .. import states
from ..config import LeaseConfig
from ..states import State
from . import _engine
from ._sql import db_now
from ._types import Lease
from .schema import Tables, build

T = TypeVar("T")

logger = logging.getLogger("celery_lease.store")


@dataclasses.dataclass(frozen=True)
class TransitionEvent:
    """A committed state change, handed to the store's listeners after the commit."""

    task_id: str
    name: str | None
    from_state: State | None
    to_state: State
    reason: str
    actor: str
    attempt: int


#: Called once per committed transaction with the transitions it made.
Listener = Callable[[Sequence[TransitionEvent]], None]


def dumps(value: Any) -> str:
    """Compact JSON, as stored in the text columns."""
    return json.dumps(value, separators=(",", ":"))


class StoreBase:
    """Connection handling shared by the domain operations (thread-safe; fork-safe)."""

    def __init__(self, config: LeaseConfig) -> None:
        self.config = config
        self.engine = _engine.create(config)
        self.url = _engine.safe_url(self.engine.url)
        self.t: Tables = build(config.table_prefix, config.schema)
        self.dialect = self.engine.dialect.name
        self.is_pg = self.dialect == "postgresql"
        #: Keeps fork() out of SQLite transactions (see _engine.fork_guard).
        self._fork_guard = _engine.fork_guard(self.engine)
        self._schema_checked = False
        #: Called after each commit with its transitions (logs, events, metrics, backends).
        self.listeners: list[Listener] = []
        self._local = threading.local()
        # PostgreSQL: single-statement operations run in autocommit, one round trip
        # instead of BEGIN / statement / COMMIT
        self._autocommit = (
            self.engine.execution_options(isolation_level="AUTOCOMMIT") if self.is_pg else None
        )

    # -- plumbing ---------------------------------------------------------------------

    def _tx(self, fn: Callable[[Connection, bool], T], *, single: bool = False) -> T:
        """Run ``fn(conn, is_retry)`` in one transaction, retrying transient errors.

        ``single=True`` promises that ``fn`` executes exactly one statement: on
        PostgreSQL it then runs in autocommit (the statement is its own transaction).
        """

        def attempt(is_retry: bool) -> T:
            events: list[TransitionEvent] = []
            self._local.events = events
            try:
                if single and self._autocommit is not None:
                    with self._autocommit.connect() as conn:
                        result = fn(conn, is_retry)
                else:
                    with self._fork_guard, self.engine.begin() as conn:
                        result = fn(conn, is_retry)
            finally:
                self._local.events = None
            if events:
                self._dispatch(events)
            return result

        return _engine.retrying(attempt, retries=self.config.db_retries, url=self.url)

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

    def _dispatch(self, events: Sequence[TransitionEvent]) -> None:
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

        return _engine.retrying(attempt, retries=self.config.db_retries, url=self.url)

    def _insert(self, table: Any) -> Any:
        return (postgresql.insert if self.is_pg else sqlite.insert)(table)

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
        states.check(frm, to)
        t, tr = self.t.tasks, self.t.transitions
        stmt = (
            update(t)
            .where(t.c.state == frm.value, *where)
            .values(state=to.value, updated_at=db_now(), reason=reason, **(values or {}))
            .returning(t.c.id, t.c.attempt, t.c.name, *returning)
        )
        if self.is_pg:
            moved = stmt.cte("moved")
            audit = insert(tr).from_select(
                ["task_id", "from_state", "to_state", "reason", "actor", "attempt", "at"],
                select(
                    moved.c.id,
                    literal(frm.value, String),
                    literal(to.value, String),
                    literal(reason, Text),
                    literal(actor, String),
                    moved.c.attempt,
                    db_now(),
                ),
            )
            rows = list(conn.execute(select(moved).add_cte(audit.cte("audit"))).all())
        else:
            rows = list(conn.execute(stmt).all())
        for row in rows:
            self._record_event(
                TransitionEvent(row.id, row.name, frm, to, reason, actor, int(row.attempt))
            )
        if rows and not self.is_pg:
            conn.execute(
                insert(self.t.transitions).values(at=db_now()),
                [
                    {
                        "task_id": row.id,
                        "from_state": frm.value,
                        "to_state": to.value,
                        "reason": reason,
                        "actor": actor,
                        "attempt": row.attempt,
                    }
                    for row in rows
                ],
            )
        return rows

    def _fenced(self, lease: Lease) -> list[ColumnElement[bool]]:
        t = self.t.tasks
        return [t.c.id == lease.task_id, t.c.attempt == lease.attempt, t.c.token == lease.token]

    def _audit(
        self,
        conn: Connection,
        task_id: str,
        frm: State | None,
        to: State,
        reason: str,
        actor: str,
        attempt: int,
    ) -> None:
        states.check(frm, to, task_id)
        self._record_event(TransitionEvent(task_id, None, frm, to, reason, actor, attempt))
        conn.execute(
            insert(self.t.transitions).values(
                task_id=task_id,
                from_state=frm.value if frm else None,
                to_state=to.value,
                reason=reason,
                actor=actor,
                attempt=attempt,
                at=db_now(),
            )
        )
