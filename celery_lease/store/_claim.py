"""The claim: PENDING -> RUNNING with the next attempt and a fresh token, or the
adoption of a message that has no row."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Row,
    bindparam,
    or_,
    select,
    true,
)

from ..states import State
from ._base import TransitionEvent
from ._sql import db_now
from ._tombstones import TombstonesMixin
from ._types import Claim, Lease, NewTask, Refusal

#: Note for rows whose arguments could not be stored: they cannot be re-published.
_NO_ARGS_NOTE = "arguments could not be stored as JSON: recovery needs a person"


class ClaimMixin(TombstonesMixin):
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
                    if self._is_purged(conn, task_id):
                        return Refusal(
                            task_id,
                            None,
                            "its row was purged after the task ended: a late message is "
                            "not adopted",
                        )
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
