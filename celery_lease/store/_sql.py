"""Dialect-aware SQL pieces: database time, interval arithmetic, GREATEST.

Timestamps are ``timestamptz`` on PostgreSQL and REAL epoch seconds on SQLite
(SQLite has no time type, and sub-second precision matters for short leases).
Python sees timezone-aware UTC datetimes on both. Every "now" in a decision is
:class:`db_now`, evaluated by the database, never a worker's clock.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, cast

from sqlalchemy import DateTime, Float
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import ColumnElement, FunctionElement
from sqlalchemy.types import TypeDecorator, TypeEngine

from ..config import MAX_SECONDS


class DbTime(TypeDecorator[datetime]):
    """A point in time: ``timestamptz`` on PostgreSQL, epoch seconds (REAL) on SQLite."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "sqlite":
            return dialect.type_descriptor(Float())
        return dialect.type_descriptor(DateTime(timezone=True))

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> Any:
        if value is None:
            return None
        if dialect.name == "sqlite":
            return value.timestamp()
        return value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if dialect.name == "sqlite":
            return datetime.fromtimestamp(float(value), timezone.utc)
        if isinstance(value, datetime) and value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        # the driver's value for a timestamptz column: an aware datetime
        return cast("datetime | None", value)


class db_now(FunctionElement[datetime]):
    """The database's current time."""

    type = DbTime()
    inherit_cache = True


@compiles(db_now)
def _now_default(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return "CURRENT_TIMESTAMP"


@compiles(db_now, "postgresql")
def _now_pg(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    # statement time, not transaction start: a long sweep transaction must not age its "now"
    return "statement_timestamp()"


@compiles(db_now, "sqlite")
def _now_sqlite(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    # julianday('now') is stable within one statement and has millisecond precision
    return "((julianday('now') - 2440587.5) * 86400.0)"


class after(FunctionElement[datetime]):
    """``ts + seconds``: a time plus a (possibly fractional, possibly column) number of seconds."""

    type = DbTime()
    inherit_cache = True

    def __init__(self, ts: ColumnElement[Any], seconds: ColumnElement[Any] | float) -> None:
        super().__init__(ts, seconds)


@compiles(after)
def _after_default(element: after, compiler: SQLCompiler, **kw: Any) -> str:
    ts, seconds = list(element.clauses)
    return f"({compiler.process(ts, **kw)} + {compiler.process(seconds, **kw)})"


@compiles(after, "postgresql")
def _after_pg(element: after, compiler: SQLCompiler, **kw: Any) -> str:
    ts, seconds = list(element.clauses)
    # clamped to the longest duration a setting or option may take: a row written
    # unchecked (an older version, a hand edit) with 1e300, Infinity or NaN seconds
    # would otherwise fail the whole statement ("interval out of range") and stop the
    # sweep for every row (PostgreSQL orders NaN above every number: it clamps high)
    return (
        f"({compiler.process(ts, **kw)} + GREATEST(LEAST("
        f"CAST({compiler.process(seconds, **kw)} AS DOUBLE PRECISION), {MAX_SECONDS!r}), "
        f"{-MAX_SECONDS!r}) * INTERVAL '1 second')"
    )


class seconds_between(FunctionElement[float]):
    """``later - earlier`` in seconds (float)."""

    type = Float()
    inherit_cache = True

    def __init__(self, later: ColumnElement[Any], earlier: ColumnElement[Any]) -> None:
        super().__init__(later, earlier)


@compiles(seconds_between)
def _between_default(element: seconds_between, compiler: SQLCompiler, **kw: Any) -> str:
    later, earlier = list(element.clauses)
    return f"({compiler.process(later, **kw)} - {compiler.process(earlier, **kw)})"


@compiles(seconds_between, "postgresql")
def _between_pg(element: seconds_between, compiler: SQLCompiler, **kw: Any) -> str:
    later, earlier = list(element.clauses)
    return (
        f"EXTRACT(EPOCH FROM ({compiler.process(later, **kw)} - "
        f"{compiler.process(earlier, **kw)}))::double precision"
    )


class greatest(FunctionElement[Any]):
    """The larger of two values (``GREATEST`` on PostgreSQL, scalar ``max`` on SQLite)."""

    inherit_cache = True

    def __init__(self, a: ColumnElement[Any], b: ColumnElement[Any]) -> None:
        super().__init__(a, b)
        self.type = a.type


@compiles(greatest)
def _greatest_default(element: greatest, compiler: SQLCompiler, **kw: Any) -> str:
    a, b = list(element.clauses)
    return f"GREATEST({compiler.process(a, **kw)}, {compiler.process(b, **kw)})"


@compiles(greatest, "sqlite")
def _greatest_sqlite(element: greatest, compiler: SQLCompiler, **kw: Any) -> str:
    a, b = list(element.clauses)
    return f"max({compiler.process(a, **kw)}, {compiler.process(b, **kw)})"
