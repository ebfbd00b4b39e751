"""Submissions whose ``dedup_key`` has a window, a set of states, or a conflict policy
(``unique_for``, ``unique_while``, ``on_conflict``).

The decision is the database's: the partial unique index on ``dedup_key`` lets one row
hold a key, and every change of who holds it is a compare-and-set in the transaction
that inserts the new row. A submission, in one transaction:

1. inserts its row ``ON CONFLICT DO NOTHING``: written, the key was free;
2. otherwise reads the row holding the key (a new statement: on PostgreSQL's READ
   COMMITTED it sees what committed meanwhile; the insert itself waited for a
   concurrent insert of the key to commit or roll back);
3. if that row no longer deduplicates (created ``unique_for`` seconds ago or more by
   the database's clock, or in a state outside ``unique_while``), takes the key from
   it, ``UPDATE ... SET dedup_key = NULL WHERE id = :id AND dedup_key = :key AND
   <still outside>``, and goes back to 1; if the update changed nothing, another
   submitter took the key first (on PostgreSQL the update waited for that submitter's
   lock, then found the key gone), and the next round sees the row it inserted;
4. otherwise it is a duplicate: ``on_conflict="replace"`` writes the new arguments and
   message into the row ``WHERE`` it is still PENDING, never claimed and holding the
   key (else the next round decides again); ``"return"`` and ``"raise"`` write nothing.

So two submitters can never both insert in one window: the second one's insert conflicts
with the first one's row, or its release finds the key already taken. On SQLite write
transactions are serialized (``BEGIN IMMEDIATE``), which decides the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import ColumnElement, Connection, and_, false, not_, or_, select, update

from ..exceptions import StoreError
from ..states import State
from ._submit import Submission, _submit_params
from ._types import NewTask, Replacement, Unique, UniqueAnswer
from .schema import after, db_now

#: Rounds of insert / read / release before giving up (each round that does not end is
#: another submitter's change of the same key, which ends theirs).
_ROUNDS = 20

#: The reason of a PENDING row whose arguments a later submission replaced.
REPLACED_ARGUMENTS = "submitted; arguments replaced by a later submission with its dedup key"


class UniqueSubmission(Submission):
    """:meth:`submit_unique`: a submission whose dedup key has uniqueness options."""

    def _outside(self, unique: Unique) -> ColumnElement[bool]:
        """The row holding the key no longer deduplicates for ``unique``."""
        t = self.t.tasks
        conds: list[ColumnElement[bool]] = []
        if unique.unique_for is not None:
            conds.append(after(t.c.created_at, unique.unique_for) <= db_now())
        if unique.unique_while is not None:
            conds.append(t.c.state.not_in(sorted(s.value for s in unique.unique_while)))
        return or_(*conds) if conds else false()

    def submit_unique(
        self,
        new: NewTask,
        unique: Unique,
        replacement: Callable[[str], Replacement] | None = None,
        conn: Connection | None = None,
    ) -> UniqueAnswer:
        """Insert ``new`` (PENDING) unless its ``dedup_key`` is held by a row that still
        deduplicates for ``unique`` (see the module's text); ``replacement``: what
        ``on_conflict="replace"`` writes into that row (given its id) if it is PENDING
        and was never claimed. With ``conn`` the work joins the caller's transaction.

        Raises:
            ValueError: ``new`` has no dedup key, or ``replace`` without a replacement.
            StoreError: the key changed hands more than a few dozen times in one call.
        """
        key = new.dedup_key
        if key is None:
            raise ValueError("submit_unique() needs a row with a dedup_key")
        if (unique.on_conflict == "replace") != (replacement is not None):
            raise ValueError('a replacement is given with on_conflict="replace", and only then')
        t = self.t.tasks
        params = _submit_params(new)
        countdown = new.countdown is not None
        outside = self._outside(unique)

        def op(conn: Connection, is_retry: bool) -> UniqueAnswer:
            insert_stmt = self._prepared(
                ("submit", countdown), lambda: self._submit_insert(countdown)
            )
            for _ in range(_ROUNDS):
                if conn.execute(insert_stmt, params).scalar() is not None:
                    self._audit(conn, new.id, None, State.PENDING, "submitted", "producer", 0)
                    return UniqueAnswer(new.id, "created")
                rows = conn.execute(
                    select(
                        t.c.id,
                        t.c.dedup_key,
                        t.c.state,
                        outside.label("outside"),
                        and_(*self._replaceable()).label("replaceable"),
                    ).where(or_(t.c.id == new.id, t.c.dedup_key == key))
                ).all()
                mine = next((r for r in rows if r.id == new.id), None)
                if mine is not None:
                    if is_retry and mine.dedup_key == key:
                        # a first try that committed but whose answer was lost wrote it
                        return UniqueAnswer(new.id, "created")
                    # the task id itself is taken: the row with that id is the answer
                    return UniqueAnswer(new.id, "duplicate", State(mine.state))
                holder = next((r for r in rows if r.dedup_key == key), None)
                if holder is None:
                    continue  # released or purged meanwhile: insert again
                if holder.outside:
                    # take the key from it, if it still holds it and is still outside
                    conn.execute(
                        update(t)
                        .where(t.c.id == holder.id, t.c.dedup_key == key, outside)
                        .values(dedup_key=None)
                    )
                    continue  # insert again (a failed release: the next round decides)
                if replacement is not None and holder.replaceable:
                    made = replacement(str(holder.id))
                    if self._replace(conn, str(holder.id), key, outside, made):
                        return UniqueAnswer(str(holder.id), "replaced", State.PENDING)
                    continue  # claimed, or released, meanwhile: the next round decides
                return UniqueAnswer(str(holder.id), "duplicate", State(holder.state))
            raise StoreError(
                f"lease store {self.url}: dedup key {key!r} changed hands more than "
                f"{_ROUNDS} times during one submission"
            )

        if conn is not None:
            return op(conn, False)
        return self._tx(op)

    def _replace(
        self,
        conn: Connection,
        task_id: str,
        key: str,
        outside: ColumnElement[bool],
        replacement: Replacement,
    ) -> bool:
        """Write ``replacement`` into the row ``task_id`` if it still holds ``key``, still
        deduplicates, is PENDING and was never claimed (compare-and-set); whether it did.
        The row stays PENDING (no transition): its message is the new one, marked not
        published, and a message sent before is refused at claim (:attr:`revision`)."""
        t = self.t.tasks
        values: dict[str, Any] = {
            "args": replacement.args,
            "kwargs": replacement.kwargs,
            "options": replacement.options,
            "message": replacement.message,
            "revision": replacement.revision,
            "eta": (
                after(db_now(), replacement.countdown)
                if replacement.countdown is not None
                else replacement.eta
            ),
            "published_at": None,
            "updated_at": db_now(),
            "reason": REPLACED_ARGUMENTS,
        }
        done = conn.execute(
            update(t)
            .where(t.c.id == task_id, t.c.dedup_key == key, *self._replaceable(), not_(outside))
            .values(**values)
        ).rowcount
        return bool(done)

    def _replaceable(self) -> list[ColumnElement[bool]]:
        """A row ``on_conflict="replace"`` may write into: PENDING, never claimed, no
        cancel asked for."""
        t = self.t.tasks
        return [
            t.c.state == State.PENDING.value,
            t.c.attempt == 0,
            t.c.cancel_requested_at.is_(None),
        ]
