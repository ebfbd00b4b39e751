"""Retention (finished rows deleted after ``lease_retention``) and the counters table.

Retention runs in the reaper, one bounded batch per transaction. On PostgreSQL a
batch is one statement: the rows are chosen with ``FOR UPDATE SKIP LOCKED`` (a row
another transaction holds is left for the next batch, never waited for), their steps,
audit rows and the rows themselves are deleted, and the ``purged`` counter is raised,
all in one round trip. Live rows (PENDING, RUNNING, RETRY_WAIT, TIMEOUT, WAIT_MANUAL)
are never chosen: the query names the finished states only, in the words of the
partial index ``<prefix>tasks_finished`` so that every plan can use it; nor is a
SUCCEEDED row whose follow-ups are recorded and not yet published. The audit
rows it deletes that the reaper has not folded into the transition totals yet are
added to the totals in the same statement (see ``_totals``), so a purge never lowers a
counter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, Float, String, bindparam, delete, func, select, text
from sqlalchemy.dialects import postgresql

from ._sql import after, db_now
from ._tombstones import TombstonesMixin
from ._totals import TotalsMixin
from .schema import FINISHED_SQL

#: Names of the counters (``lease_counters.name``).
PURGED = "purged"
DUPLICATES_DROPPED = "duplicates_dropped"
REPUBLISHED = "republished"
COUNTERS = (PURGED, DUPLICATES_DROPPED, REPUBLISHED)


class RetentionMixin(TombstonesMixin, TotalsMixin):
    # -- counters ---------------------------------------------------------------------

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

    # -- retention --------------------------------------------------------------------

    def _victims(self) -> Any:
        """Ids of one batch of finished rows older than ``b_older`` seconds (bind
        parameters ``b_older`` and ``b_limit``)."""
        t = self.t.tasks
        q = (
            select(t.c.id)
            .where(
                text(FINISHED_SQL),
                t.c.finished_at < after(db_now(), -bindparam("b_older", type_=Float)),
                # a success whose follow-ups are not yet published is what the reaper
                # publishes them from: kept until they are
                t.c.follow_ups_at.is_(None),
            )
            # oldest first: the finished_at index drives the batch whatever share of the
            # table is old (a sequential scan would wade through the dead rows of the
            # batches before, until a vacuum)
            .order_by(t.c.finished_at)
            .limit(bindparam("b_limit"))
        )
        if self.is_pg:
            q = q.with_for_update(skip_locked=True)
        return q

    def _purge_pg(self) -> Any:
        t, s, tr, c = self.t.tasks, self.t.steps, self.t.transitions, self.t.counters
        victims = self._victims().cte("victims")
        chosen = select(victims.c.id)
        tombs = self._tombstones(t.c.id.in_(chosen)).cte("tombs")
        gone_steps = delete(s).where(s.c.task_id.in_(chosen)).cte("gone_steps")
        gone_audit, counted_audit = self._audit_delete_ctes(tr.c.task_id.in_(chosen))
        gone = delete(t).where(t.c.id.in_(chosen)).returning(t.c.id).cte("gone")
        counted = select(func.count()).select_from(gone).scalar_subquery()
        bump = postgresql.insert(c).from_select(
            ["name", "value", "updated_at"],
            select(bindparam("b_name", PURGED, type_=String), counted, db_now()).where(counted > 0),
        )
        bump = bump.on_conflict_do_update(
            index_elements=[c.c.name],
            set_={"value": c.c.value + bump.excluded.value, "updated_at": db_now()},
        )
        return select(counted.label("purged")).add_cte(
            tombs, gone_steps, gone_audit, *counted_audit, gone, bump.cte("bumped")
        )

    def purge_expired(self, older_than: float, *, limit: int | None = None) -> int:
        """Delete one batch (at most ``limit``, default ``lease_retention_batch_size``)
        of SUCCEEDED, FAILED and CANCELLED rows whose ``finished_at`` is more than
        ``older_than`` seconds ago, with their steps and audit rows; raise the
        ``purged`` counter by as many. Returns how many tasks were deleted."""
        batch = limit or self.config.retention_batch_size
        params = {"b_older": float(older_than), "b_limit": batch}
        t, s, tr = self.t.tasks, self.t.steps, self.t.transitions
        if self.is_pg:
            stmt = self._prepared("purge-expired-pg", self._purge_pg)
            return int(
                self._tx(
                    lambda conn, _: conn.execute(stmt, params).scalar_one(),
                    single=True,
                )
            )

        def op(conn: Connection, _: bool) -> int:
            ids = [r.id for r in conn.execute(self._victims(), params)]
            if ids:
                conn.execute(self._tombstones(t.c.id.in_(ids)))
                conn.execute(delete(s).where(s.c.task_id.in_(ids)))
                self._delete_audit(conn, tr.c.task_id.in_(ids))
                conn.execute(delete(t).where(t.c.id.in_(ids)))
                self.add_counts({PURGED: len(ids)}, conn)
            return len(ids)

        return self._tx(op)
