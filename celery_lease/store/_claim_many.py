"""Claims in batches: the deliveries a worker took from the broker together, claimed in
one statement by its main process (``lease_claim_ahead``, see
:mod:`celery_lease._claimer`).

Only the common case is batched: a PENDING row that is due, whose task retries by
itself on a lost lease (``on_timeout = 'retry'``) and has no ``max_runtime`` (a row
claimed ahead waits for a free pool process, and that wait must not count against a
runtime limit). A delivery the batch does not claim (no row, not due, a copy of a
running task, a paused or manual task, or a race) is claimed by its pool process
exactly as without batching, which adopts it, drops it or publishes it again.

On PostgreSQL the batch is one ``UPDATE ... FROM unnest(...)`` with the audit rows
inserted by a data-modifying CTE over the updated rows; on SQLite one transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, String, bindparam, column, func, select
from sqlalchemy.dialects.postgresql import ARRAY

from ..states import State
from ._base import TransitionEvent
from ._claim import ClaimMixin
from ._types import Claim, Lease

#: What a delivery claimed ahead is: (task id, the fresh token of its claim).
Ask = tuple[str, str]


class ClaimManyMixin(ClaimMixin):
    def claim_many(self, asks: Sequence[Ask], owner: str, actor: str) -> dict[str, Claim]:
        """Compare-and-set PENDING -> RUNNING (attempt += 1) of every eligible row of
        ``asks`` in one statement; the claims made, by token. Several asks of one task
        id claim it once: only the ask whose token the row took is answered."""
        if not asks:
            return {}
        reason = f"claimed ahead by {actor}"

        def op(conn: Connection, _: bool) -> list[Any]:
            if self.is_pg:
                stmt = self._prepared("claim_many", self._claim_many_pg)
                params = {
                    "b_ids": [a[0] for a in asks],
                    "b_tokens": [a[1] for a in asks],
                    "b_owner": owner,
                    "b_reason": reason,
                    "b_actor": actor,
                }
                rows = conn.execute(stmt, params).all()
                for r in rows:
                    self._record_event(
                        TransitionEvent(
                            r.id, r.name, State.PENDING, State.RUNNING, reason, actor, r.attempt
                        )
                    )
                return list(rows)
            rows = []
            for task_id, token in asks:
                rows += self._move_prepared(
                    conn,
                    "claim-ahead",
                    self._claim_ahead_spec,
                    {"b_task_id": task_id, "b_token": token, "b_owner": owner},
                    State.PENDING,
                    State.RUNNING,
                    reason=reason,
                    actor=actor,
                )
            return rows

        rows = self._tx(op, single=self.is_pg)
        return {
            str(r.token): Claim(
                lease=Lease(str(r.id), int(r.attempt), str(r.token)),
                retries=int(r.retries),
                recoveries=int(r.recoveries),
                resumed=int(r.attempt) > 1,
                cancel_requested=r.cancel_requested_at is not None,
            )
            for r in rows
        }

    def _claim_ahead_spec(self) -> tuple[list[Any], dict[str, Any], tuple[Any, ...]]:
        """Where, values and returning of one claim made ahead (bind parameters
        ``b_task_id``, ``b_token``, ``b_owner``): the claim's, for eligible rows only."""
        t = self.t.tasks
        where, values, returning = self._claim_spec()
        return [*where, *_eligible(t)], values, (*returning, t.c.token)

    def _claim_many_pg(self) -> Any:
        t = self.t.tasks
        where, values, returning = self._claim_ahead_spec()
        v = (
            func.unnest(
                bindparam("b_ids", type_=ARRAY(String)),
                bindparam("b_tokens", type_=ARRAY(String)),
            )
            .table_valued(column("id", String), column("token", String))
            .render_derived(name="v")
        )
        # the single claim's where and values, with the id and token from the arrays
        where = [w for w in where if not _names_task_id(w)] + [t.c.id == v.c.id]
        values = {**values, "token": v.c.token}
        stmt = self._move_update(where, State.PENDING, State.RUNNING, values, returning)
        moved, audit = self._move_ctes(stmt, State.PENDING, State.RUNNING)
        return select(moved).add_cte(audit)


def _eligible(t: Any) -> list[Any]:
    return [t.c.max_runtime.is_(None), t.c.on_timeout == "retry"]


def _names_task_id(clause: Any) -> bool:
    """Whether ``clause`` is the single claim's ``id = :b_task_id``."""
    right = getattr(clause, "right", None)
    return getattr(right, "key", None) == "b_task_id"
