"""The store's :class:`~celery_lease.store.Executor` on Django's database connection.

The one piece of glue between the store's statements and Django: each statement,
built once by the store with bind parameters, is compiled by the store's dialect with
this call's values, its parameters rendered in the driver's paramstyle and run on
Django's DBAPI connection, so it joins whatever transaction Django has open (and never
commits or rolls back itself).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from sqlalchemy.engine import Dialect
from sqlalchemy.sql import ClauseElement, Executable
from sqlalchemy.sql.compiler import SQLCompiler


class _Rows:
    """A statement's rows, fetched: what the store reads of them (``store.Rows``)."""

    def __init__(self, rows: list[tuple[Any, ...]], rowcount: int) -> None:
        self._rows = rows
        self._rowcount = rowcount

    @property
    def rowcount(self) -> int:
        return self._rowcount

    def scalar(self) -> Any:
        return self._rows[0][0] if self._rows else None

    def first(self) -> tuple[Any, ...] | None:
        return self._rows[0] if self._rows else None

    def all(self) -> Sequence[tuple[Any, ...]]:
        return list(self._rows)


class DjangoExecutor:
    """Runs the store's statements on a Django connection's DBAPI connection."""

    def __init__(self, dialect: Dialect, dbapi_connection: Any) -> None:
        self.dialect = dialect
        self._dbapi = dbapi_connection

    def execute(
        self, statement: Executable, parameters: Mapping[str, Any] | None = None, /
    ) -> _Rows:
        compiled = cast(SQLCompiler, cast(ClauseElement, statement).compile(dialect=self.dialect))
        # this call's values, expanded (IN lists) and processed for the driver
        state = compiled.construct_expanded_state(dict(parameters or {}))
        params = {
            key: state.processors[key](value) if key in state.processors else value
            for key, value in state.parameters.items()
        }
        values: Any = (
            params if state.positiontup is None else tuple(params[k] for k in state.positiontup)
        )
        cursor = self._dbapi.cursor()
        try:
            cursor.execute(state.statement, values)
            rows = [tuple(row) for row in cursor.fetchall()] if cursor.description else []
            return _Rows(rows, cursor.rowcount)
        finally:
            cursor.close()
