"""Store plumbing: engine, transactions with retries, the one compare-and-set helper."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from sqlalchemy import ColumnElement, Connection, Row, insert, update
from sqlalchemy.dialects import postgresql, sqlite

from .. import states
from ..config import LeaseConfig
from ..states import State
from . import _engine
from ._sql import db_now
from ._types import Lease
from .schema import Tables, build

T = TypeVar("T")


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
        self._schema_checked = False

    # -- plumbing ---------------------------------------------------------------------

    def _tx(self, fn: Callable[[Connection, bool], T]) -> T:
        """Run ``fn(conn, is_retry)`` in one transaction, retrying transient errors."""

        def attempt(is_retry: bool) -> T:
            with self.engine.begin() as conn:
                return fn(conn, is_retry)

        return _engine.retrying(attempt, retries=self.config.db_retries, url=self.url)

    def _read(self, fn: Callable[[Connection], T]) -> T:
        def attempt(is_retry: bool) -> T:
            with self.engine.connect() as conn:
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
        """Compare-and-set ``frm -> to`` on the rows matching ``where``, with audit rows."""
        states.check(frm, to)
        t = self.t.tasks
        stmt = (
            update(t)
            .where(t.c.state == frm.value, *where)
            .values(state=to.value, updated_at=db_now(), reason=reason, **(values or {}))
            .returning(t.c.id, t.c.attempt, *returning)
        )
        rows = list(conn.execute(stmt).all())
        if rows:
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
