"""Read-only operations behind the health figures (``lease stats``, the metrics).

Each one reads an index range whose size is bounded by what an operator watches (the
rows finished within a window, the live rows), never the whole tasks table: the
finished states are named in the words of the partial index ``<prefix>tasks_finished``
(see :data:`~.schema.FINISHED_SQL`) and the live ones as literals, so that a generic
plan of a prepared statement can use the same indexes as a custom one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sqlalchemy import ColumnElement, Connection, func, literal_column, select, text

from ..states import State
from ._base import StoreBase
from ._sql import after, db_now, seconds_between
from .schema import FINISHED_SQL

#: States that are not finished: counted exactly, from the state index.
LIVE_STATES = (
    State.PENDING,
    State.RUNNING,
    State.RETRY_WAIT,
    State.TIMEOUT,
    State.WAIT_MANUAL,
)


def _literal_in(column: Any, states: tuple[State, ...]) -> ColumnElement[bool]:
    result: ColumnElement[bool] = column.in_([literal_column(f"'{s.value}'") for s in states])
    return result


@dataclasses.dataclass(frozen=True)
class Finished:
    """Tasks of one name that finished in one state within the window."""

    name: str
    state: State
    count: int


@dataclasses.dataclass(frozen=True)
class Runtime:
    """One recent run: its duration and the limits its row carried."""

    name: str
    seconds: float
    max_runtime: float | None
    lease_ttl: float


@dataclasses.dataclass(frozen=True)
class Backlog:
    """PENDING rows of one task name and how long the oldest has waited."""

    name: str
    pending: int
    oldest_age: float


class HealthMixin(StoreBase):
    def live_counts(self) -> dict[State, int]:
        """Rows per live state (PENDING, RUNNING, RETRY_WAIT, TIMEOUT, WAIT_MANUAL),
        zero included: a range of the state index, never the finished rows."""
        t = self.t.tasks
        q = (
            select(t.c.state, func.count())
            .where(_literal_in(t.c.state, LIVE_STATES))
            .group_by(t.c.state)
        )
        rows = self._read(lambda conn: conn.execute(q).all())
        out = dict.fromkeys(LIVE_STATES, 0)
        for state, count in rows:
            out[State(state)] = int(count)
        return out

    def finished_by_name(self, window: float) -> list[Finished]:
        """Tasks finished (SUCCEEDED, FAILED, CANCELLED) in the last ``window`` seconds,
        by task name and state."""
        t = self.t.tasks
        q = (
            select(t.c.name, t.c.state, func.count())
            .where(text(FINISHED_SQL), t.c.finished_at >= after(db_now(), -window))
            .group_by(t.c.name, t.c.state)
        )
        rows = self._read(lambda conn: conn.execute(q).all())
        return [Finished(str(n), State(s), int(c)) for n, s, c in rows]

    def finished_total(self, cap: int = 100_000) -> tuple[dict[State, int], bool]:
        """Rows per finished state over the whole table, and whether any figure is an
        estimate. Each state is counted exactly up to ``cap`` rows (a bounded range
        of the partial index); past that, on PostgreSQL, the planner's statistics
        give the figure (``reltuples`` times the state's frequency, as fresh as the
        last ``ANALYZE``), so the cost stays flat however large the table grows."""
        t = self.t.tasks
        finished = (State.SUCCEEDED, State.FAILED, State.CANCELLED)

        def bounded(state: State) -> Any:
            inner = (
                select(literal_column("1"))
                .where(text(FINISHED_SQL), t.c.state == literal_column(f"'{state.value}'"))
                .limit(cap + 1)
                .subquery()
            )
            return select(func.count()).select_from(inner).scalar_subquery()

        q = select(*(bounded(s).label(s.value) for s in finished))
        row = self._read(lambda conn: conn.execute(q).one())
        out = {s: int(row._mapping[s.value]) for s in finished}
        over = [s for s, n in out.items() if n > cap]
        if not over:
            return out, False
        estimates = self._state_estimates() if self.is_pg else {}
        for s in over:
            out[s] = max(cap, estimates.get(s.value, cap))
        return out, True

    def _state_estimates(self) -> dict[str, int]:
        """PostgreSQL's estimate of rows per state (``pg_class`` and ``pg_stats``)."""
        t = self.t.tasks
        q = text(
            "SELECT c.reltuples::bigint AS n, s.most_common_vals::text AS vals, "
            "s.most_common_freqs AS freqs "
            "FROM pg_class c JOIN pg_namespace ns ON ns.oid = c.relnamespace "
            "LEFT JOIN pg_stats s ON s.schemaname = ns.nspname AND s.tablename = c.relname "
            "AND s.attname = 'state' "
            "WHERE c.relname = :table AND ns.nspname = coalesce(:schema, current_schema())"
        ).bindparams(table=t.name, schema=t.schema)
        row = self._read(lambda conn: conn.execute(q).first())
        if row is None or row.vals is None or row.freqs is None or row.n is None:
            return {}
        values = [v.strip('"') for v in str(row.vals).strip("{}").split(",")]
        return {v: int(row.n * f) for v, f in zip(values, row.freqs, strict=False)}

    def recent_runtimes(self, window: float, limit: int) -> list[Runtime]:
        """Durations (``finished_at - started_at`` of the last attempt) of the at most
        ``limit`` most recent SUCCEEDED and FAILED runs within ``window`` seconds."""
        t = self.t.tasks
        q = (
            select(
                t.c.name,
                seconds_between(t.c.finished_at, t.c.started_at).label("seconds"),
                t.c.max_runtime,
                t.c.lease_ttl,
            )
            .where(
                text(FINISHED_SQL),
                t.c.state != literal_column(f"'{State.CANCELLED.value}'"),
                t.c.finished_at >= after(db_now(), -window),
                t.c.started_at.is_not(None),
            )
            .order_by(t.c.finished_at.desc())
            .limit(limit)
        )
        rows = self._read(lambda conn: conn.execute(q).all())
        return [
            Runtime(
                str(r.name),
                max(0.0, float(r.seconds)),
                None if r.max_runtime is None else float(r.max_runtime),
                float(r.lease_ttl),
            )
            for r in rows
            if r.seconds is not None
        ]

    def backlog(self) -> list[Backlog]:
        """PENDING rows per task name with the age of the oldest (the backlog)."""
        t = self.t.tasks
        q = (
            select(
                t.c.name,
                func.count(),
                seconds_between(db_now(), func.min(t.c.created_at)),
            )
            .where(t.c.state == literal_column(f"'{State.PENDING.value}'"))
            .group_by(t.c.name)
        )

        def read(conn: Connection) -> list[Any]:
            return list(conn.execute(q).all())

        return [
            Backlog(str(n), int(c), max(0.0, float(age or 0.0))) for n, c, age in self._read(read)
        ]
