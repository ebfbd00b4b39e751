"""What the metrics and ``lease stats`` count, each at a bounded cost: the transition
totals, the named counters (``purged``, ``duplicates_dropped``, ``republished``) and
the health figures.

**Transition totals.** The audit table grows with every transition; counting it at
scrape time does not scale. So the reaper *folds* settled audit rows into
``<prefix>transition_totals``, one bounded primary-key range per transaction, and
raises the watermark (``<prefix>transition_watermark.upto``, one row) to the last id
it folded, in the same transaction. A scrape reads the totals, the watermark and at most
``lease_metrics_tail_rows`` audit rows above it (a primary-key range), in one
snapshot: a handful of rows plus a bounded tail, whatever the size of the table.

What holds, and why:

- Every audit row with an id up to the watermark is in the totals; none above it is,
  except rows that were deleted (below). A scrape adds the rows above the watermark
  it can see, so it counts each committed row exactly once.
- **Settled rows only.** A transaction still open may yet commit an audit row with a
  lower id than a row already visible. A fold therefore stops at the highest id of a
  row older than ``lease_totals_settle`` seconds: a row allocated before that one is
  older still, and its transaction is taken to have committed by then (the same rule
  the metrics' in-memory totals used before). A transaction that commits its audit row
  more than ``lease_totals_settle`` seconds after writing it is missed by the totals
  (never by the audit trail).
- **Deleting audit rows never lowers the totals.** Retention, ``lease purge`` and a
  discarded submission delete audit rows only through :meth:`Counting._delete_audit`
  (or, for retention on PostgreSQL, the same CTEs inside its one statement), which adds
  the deleted rows above the watermark to the totals in the same transaction. The
  rows at or below it are already counted.
- **Concurrent reapers.** A fold holds the watermark row: on PostgreSQL
  ``FOR UPDATE SKIP LOCKED`` (a second reaper folding at the same moment skips its
  turn instead of waiting) and a deletion holds it ``FOR SHARE`` (deletions run side
  by side; a fold waits for none of them and none of them sees the watermark move
  before it commits). On SQLite every write transaction is ``BEGIN IMMEDIATE``: one
  writer at a time. The watermark is also moved by compare-and-set on its old value,
  before the totals are written, so a fold that somehow lost the race writes nothing.

**Health figures.** Each reads an index range whose size is bounded by what an operator
watches (the rows finished within a window, the live rows), never the whole tasks
table: the finished states are named in the words of the partial index
``<prefix>tasks_finished`` (:data:`~.schema.FINISHED_SQL`) and the live ones as
literals, so that a generic plan of a prepared statement can use the same indexes as a
custom one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import (
    CTE,
    ColumnElement,
    Connection,
    Float,
    String,
    bindparam,
    delete,
    func,
    literal,
    literal_column,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql

from ..states import State
from ._base import StoreBase
from ._types import Backlog, Finished, Fold, Runtime, Totals, _Pair
from .schema import FINISHED_SQL, after, db_now, seconds_between

#: ``from_state`` of a task's creation in the totals table (the audit row's is NULL).
CREATED = ""


#: Names of the counters (``lease_counters.name``).
PURGED = "purged"


DUPLICATES_DROPPED = "duplicates_dropped"


REPUBLISHED = "republished"


COUNTERS = (PURGED, DUPLICATES_DROPPED, REPUBLISHED)


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


class Counting(StoreBase):
    """The transition totals (folded, read), the named counters, the health figures."""

    #: The watermark row is known to exist (see :meth:`_ensure_watermark`).
    _watermark_ready = False

    def _add_totals_statement(self) -> Any:
        """Add ``b_n`` to the total of ``(b_from, b_to)`` (bind parameters)."""
        tt = self.t.transition_totals
        stmt = self._insert(tt).values(
            from_state=bindparam("b_from", type_=String),
            to_state=bindparam("b_to", type_=String),
            total=bindparam("b_n", type_=tt.c.total.type),
        )
        return stmt.on_conflict_do_update(
            index_elements=[tt.c.from_state, tt.c.to_state],
            set_={"total": tt.c.total + stmt.excluded.total},
        )

    def _add_totals(self, conn: Connection, pairs: Sequence[tuple[str | None, str, int]]) -> int:
        """Add counted audit rows to the totals; returns how many rows they were."""
        counted = [(frm or CREATED, to, int(n)) for frm, to, n in pairs if n]
        if counted:
            params = [{"b_from": frm, "b_to": to, "b_n": n} for frm, to, n in counted]
            conn.execute(self._prepared("add-totals", self._add_totals_statement), params)
        return sum(n for _, _, n in counted)

    def _watermark(self, *, lock: str | None = None) -> Any:
        """The watermark's value; ``lock`` ``"update"`` (skipping a locked row) or
        ``"share"`` on PostgreSQL."""
        wm = self.t.transition_watermark
        q = select(wm.c.upto).where(wm.c.id == 1)
        if self.is_pg and lock == "update":
            q = q.with_for_update(skip_locked=True)
        elif self.is_pg and lock == "share":
            q = q.with_for_update(read=True)
        return q

    def _ensure_watermark(self) -> None:
        """The watermark row exists (migrations create it; tables made otherwise lack it)."""
        if self._watermark_ready:
            return
        wm = self.t.transition_watermark
        stmt = self._insert(wm).values(id=1, upto=0).on_conflict_do_nothing()
        self._tx(lambda conn, _: conn.execute(stmt), single=True)
        self._watermark_ready = True

    def _audit_delete_ctes(self, condition: ColumnElement[bool]) -> tuple[CTE, list[CTE]]:
        """PostgreSQL: CTE ``gone`` deleting the audit rows matching ``condition``
        (returning their ids), and the CTEs to add to the same statement: the watermark
        held ``FOR SHARE`` and the totals raised by the deleted rows above it."""
        tr, tt = self.t.transitions, self.t.transition_totals
        wm = self._watermark(lock="share").cte("watermark")
        gone = (
            delete(tr)
            .where(condition)
            .returning(tr.c.id, tr.c.from_state, tr.c.to_state)
            .cte("gone_audit")
        )
        frm = func.coalesce(gone.c.from_state, literal(CREATED, String))
        above = gone.c.id > func.coalesce(select(wm.c.upto).scalar_subquery(), 0)
        add = postgresql.insert(tt).from_select(
            ["from_state", "to_state", "total"],
            select(frm, gone.c.to_state, func.count()).where(above).group_by(frm, gone.c.to_state),
        )
        add = add.on_conflict_do_update(
            index_elements=[tt.c.from_state, tt.c.to_state],
            set_={"total": tt.c.total + add.excluded.total},
        )
        return gone, [wm, add.cte("gone_counted")]

    def _delete_audit(self, conn: Connection, condition: ColumnElement[bool]) -> int:
        """Delete the audit rows matching ``condition`` in ``conn``'s transaction, adding
        those above the watermark to the totals first; returns how many were deleted.
        Every deletion of audit rows goes through here (or :meth:`_audit_delete_ctes`)."""
        tr = self.t.transitions
        if self.is_pg:
            gone, ctes = self._audit_delete_ctes(condition)
            stmt = select(func.count()).select_from(gone).add_cte(*ctes)
            return int(conn.execute(stmt).scalar_one())
        base = int(conn.execute(self._watermark()).scalar() or 0)
        pairs = conn.execute(
            select(tr.c.from_state, tr.c.to_state, func.count())
            .where(condition, tr.c.id > base)
            .group_by(tr.c.from_state, tr.c.to_state)
        ).all()
        self._add_totals(conn, [(f, t, int(n)) for f, t, n in pairs])
        return int(conn.execute(delete(tr).where(condition)).rowcount)

    def _fold_ready_statement(self) -> Any:
        """The watermark, and whether the lowest audit row above it is older than
        ``b_settle`` seconds (``None``: no row above it)."""
        tr, wm = self.t.transitions, self.t.transition_watermark
        settled = tr.c.at < after(db_now(), -bindparam("b_settle", type_=Float))
        lowest = (
            select(settled).where(tr.c.id > wm.c.upto).order_by(tr.c.id).limit(1)
        ).scalar_subquery()
        return select(wm.c.upto, lowest).where(wm.c.id == 1)

    def fold_transitions(self, *, settle: float | None = None, limit: int | None = None) -> Fold:
        """Fold one range of settled audit rows into the totals: at most ``limit``
        (default ``lease_totals_batch_size``) ids above the watermark, up to the last
        row older than ``settle`` seconds (default ``lease_totals_settle``). A fold
        that finds the watermark held by another reaper does nothing."""
        horizon = self.config.totals_settle if settle is None else float(settle)
        batch = limit or self.config.totals_batch_size
        tr, wm = self.t.transitions, self.t.transition_watermark
        self._ensure_watermark()
        # most sweeps have nothing settled to fold: find that out in one round trip
        # (the lowest audit row above the watermark is missing or still fresh), without
        # a transaction or a lock
        ready_q = self._prepared("fold-ready", self._fold_ready_statement)
        params = {"b_settle": horizon}
        if self.is_pg:  # autocommit: one round trip
            upto, ready = self._tx(lambda conn, _: conn.execute(ready_q, params).one(), single=True)
        else:  # a read transaction: no write lock
            upto, ready = self._read(lambda conn: conn.execute(ready_q, params).one())
        if not ready:
            return Fold(0, int(upto), False)

        def op(conn: Connection, _: bool) -> Fold:
            held = conn.execute(self._watermark(lock="update")).scalar()
            if held is None:  # another reaper is folding (or deleting) right now
                return Fold(0, 0, False, held=True)
            base = int(held)
            lo, top = conn.execute(
                select(
                    select(func.min(tr.c.id)).where(tr.c.id > base).scalar_subquery(),
                    select(func.max(tr.c.id)).scalar_subquery(),
                )
            ).one()
            if lo is None:
                return Fold(0, base, False)
            hi = int(lo) + batch - 1
            settled = tr.c.at < after(db_now(), -horizon)
            in_range = (tr.c.id >= lo, tr.c.id <= hi)
            # each a walk down the primary key from ``hi``: one row when it is settled
            last, last_settled = conn.execute(
                select(
                    select(func.max(tr.c.id)).where(*in_range).scalar_subquery(),
                    select(func.max(tr.c.id)).where(*in_range, settled).scalar_subquery(),
                )
            ).one()
            if last_settled is None:
                return Fold(0, base, False)
            upto = int(last_settled)
            pairs = conn.execute(
                select(tr.c.from_state, tr.c.to_state, func.count())
                .where(tr.c.id > base, tr.c.id <= upto)
                .group_by(tr.c.from_state, tr.c.to_state)
            ).all()
            moved = conn.execute(
                update(wm)
                .where(wm.c.id == 1, wm.c.upto == base)
                .values(upto=upto, folded_at=db_now())
            ).rowcount
            if moved != 1:  # the watermark moved under us: leave this range to its folder
                return Fold(0, base, False)
            rows = self._add_totals(conn, [(f, t, int(n)) for f, t, n in pairs])
            return Fold(rows, upto, last_settled == last and hi < int(top))

        return self._tx(op)

    def transition_totals(self, *, tail: int | None = None) -> Totals:
        """The transition counts: the folded totals plus the audit rows above the
        watermark, at most ``tail`` ids of them (default ``lease_metrics_tail_rows``),
        read by primary-key range in one snapshot."""
        cap = self.config.metrics_tail_rows if tail is None else int(tail)
        tr, tt = self.t.transitions, self.t.transition_totals

        def op(conn: Connection) -> Totals:
            if self.is_pg:
                conn.execution_options(isolation_level="REPEATABLE READ")
            base = int(conn.execute(self._watermark()).scalar() or 0)
            counts: dict[_Pair, int] = {}
            for frm, to, n in conn.execute(select(tt.c.from_state, tt.c.to_state, tt.c.total)):
                counts[(frm or None, to)] = int(n)
            pairs = (tr.c.from_state, tr.c.to_state)
            tail_rows = conn.execute(
                select(*pairs, func.count())
                .where(tr.c.id > base, tr.c.id <= base + cap)
                .group_by(*pairs)
            ).all()
            for frm, to, n in tail_rows:
                counts[(frm, to)] = counts.get((frm, to), 0) + int(n)
            top = int(conn.execute(select(func.max(tr.c.id))).scalar() or 0)
            return Totals(counts, base, base + cap, top)

        return self._read(op)

    def _bump_statement(self) -> Any:
        c = self.t.counters
        stmt = self._insert(c).values(
            name=bindparam("b_name", type_=String),
            value=bindparam("b_value", type_=c.c.value.type),
            updated_at=db_now(),
        )
        return stmt.on_conflict_do_update(
            index_elements=[c.c.name],
            set_={"value": c.c.value + stmt.excluded.value, "updated_at": db_now()},
        )

    def add_counts(self, deltas: Mapping[str, int], conn: Connection | None = None) -> None:
        """Add ``deltas`` to the named counters (in ``conn``'s transaction if given)."""
        params = [{"b_name": k, "b_value": int(v)} for k, v in sorted(deltas.items()) if v]
        if not params:
            return
        stmt = self._prepared("bump-counter", self._bump_statement)
        if conn is not None:
            conn.execute(stmt, params)
            return
        self._tx(lambda conn, _: conn.execute(stmt, params))

    def counters(self) -> dict[str, int]:
        """Every known counter's total (zero for those never raised)."""
        c = self.t.counters
        rows = self._read(lambda conn: conn.execute(select(c.c.name, c.c.value)).all())
        out = dict.fromkeys(COUNTERS, 0)
        out.update({str(name): int(value) for name, value in rows})
        return out

    # -- the health figures (``lease stats``, the metrics) ---------------------------------

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
