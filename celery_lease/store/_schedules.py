"""The beat's state: a row per periodic entry of a leased task, and the beats seen.

A beat decides an entry's slots inside one transaction (:meth:`Schedules.schedule_slots`):
the entry's row is locked (PostgreSQL ``FOR UPDATE``; SQLite's write transactions are
``BEGIN IMMEDIATE``, one writer at a time), the slots after ``last_slot`` are decided
against the database's time, the tasks of the slots that run are written in the same
transaction (each with the slot's dedup key) and the row moves on. A second beat at the
same slot waits for the lock, then finds the slot decided. The rows are the outbox: a
beat that dies after the commit leaves PENDING rows the reaper publishes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime

from sqlalchemy import Connection, delete, exc, select, update

from ..states import State
from ._base import StoreBase, wrap
from ._db import WATCHDOG
from ._submit import outbox_transaction
from .schema import after, db_now

#: Beat rows not seen for this long are deleted when a beat starts (seconds).
BEATS_KEPT = 7 * 24 * 3600.0


@dataclasses.dataclass(frozen=True)
class ScheduleRow:
    """One periodic entry's decided slots, as stored."""

    name: str
    task: str
    #: Every slot up to this time is decided (run, skipped or missed); at registration,
    #: the database time then (slots before an entry was first seen are not its own).
    last_slot: datetime
    #: The last slot whose task was submitted, and that task's id.
    last_run_slot: datetime | None
    last_task_id: str | None
    #: Overlap ``buffer_one``: the slot waiting for the previous run to finish.
    buffered_slot: datetime | None
    missed: int
    skipped: int
    last_reason: str | None
    updated_at: datetime
    updated_by: str | None


@dataclasses.dataclass(frozen=True)
class BeatRow:
    """A beat process as it last reported itself."""

    id: str
    host: str
    pid: int
    started_at: datetime
    seen_at: datetime


@dataclasses.dataclass
class SlotDecision:
    """What a beat decided for one entry, written by :meth:`Schedules.advance_schedule`."""

    last_slot: datetime
    last_run_slot: datetime | None
    last_task_id: str | None
    buffered_slot: datetime | None
    missed: int = 0
    skipped: int = 0
    reason: str | None = None


class Schedules(StoreBase):
    """The beat's rows: entries registered, their slots decided, the beats seen."""

    def beat_seen(self, beat_id: str, host: str, pid: int) -> datetime:
        """Record that beat ``beat_id`` is alive; return the database's time."""
        b = self.t.beats

        def op(conn: Connection, _: bool) -> datetime:
            now: datetime = conn.execute(select(db_now())).scalar_one()
            moved = conn.execute(update(b).where(b.c.id == beat_id).values(seen_at=now))
            if moved.rowcount == 0:
                conn.execute(
                    delete(b).where(b.c.seen_at < after(db_now(), -BEATS_KEPT))  # old ones
                )
                conn.execute(
                    b.insert().values(id=beat_id, host=host, pid=pid, started_at=now, seen_at=now)
                )
            return now

        return self._tx(op)

    def register_schedules(self, entries: Mapping[str, str]) -> None:
        """Give each entry (name -> task name) its row, if it has none: its slots start
        at the database's time now. Existing rows are left as they are."""
        if not entries:
            return
        s = self.t.schedules

        def op(conn: Connection, _: bool) -> None:
            now = conn.execute(select(db_now())).scalar_one()
            for name, task in entries.items():
                conn.execute(
                    self._insert(s)
                    .values(
                        name=name,
                        task=task,
                        last_slot=now,
                        missed=0,
                        skipped=0,
                        updated_at=now,
                    )
                    .on_conflict_do_nothing(index_elements=[s.c.name])
                )

        self._tx(op)

    @contextlib.contextmanager
    def schedule_slots(self, name: str) -> Iterator[tuple[Connection, ScheduleRow, datetime]]:
        """A transaction holding entry ``name``'s row (registered first): yields the
        connection (leased tasks submitted with ``connection=`` it join it, and are
        published once it commits), the row and the database's time.

        The whole transaction ends within ``lease_db_timeout``, as every store call: a
        database that stops answering (a black hole) leaves the beat with
        :class:`~celery_lease.StoreUnavailable`, not blocked on its socket.

        Raises:
            StoreUnavailable: the database did not answer in time, or was lost.
        """
        s = self.t.schedules
        timeout = self.config.db_timeout
        deadline = time.monotonic() + timeout
        outer = WATCHDOG.arm(deadline)
        try:
            with outbox_transaction(self.engine) as conn:
                q = select(s).where(s.c.name == name)
                if self.is_pg:
                    q = q.with_for_update()
                row = conn.execute(q).first()
                if row is None:
                    raise LookupError(f"beat entry {name!r} has no schedule row (not registered)")
                now: datetime = conn.execute(select(db_now())).scalar_one()
                yield conn, ScheduleRow(**row._mapping), now
        except exc.SQLAlchemyError as error:
            late = time.monotonic() >= deadline
            raise wrap(error, self.url, timeout=timeout if late else None) from error
        finally:
            WATCHDOG.disarm(outer)

    def advance_schedule(
        self, conn: Connection, name: str, decision: SlotDecision, actor: str
    ) -> None:
        """Write what was decided for entry ``name`` (in :meth:`schedule_slots`'s
        transaction, whose lock makes it the only writer of the row)."""
        s = self.t.schedules
        conn.execute(
            update(s)
            .where(s.c.name == name)
            .values(
                last_slot=decision.last_slot,
                last_run_slot=decision.last_run_slot,
                last_task_id=decision.last_task_id,
                buffered_slot=decision.buffered_slot,
                missed=s.c.missed + decision.missed,
                skipped=s.c.skipped + decision.skipped,
                last_reason=decision.reason if decision.reason is not None else s.c.last_reason,
                updated_at=db_now(),
                updated_by=actor,
            )
        )

    def task_state(self, conn: Connection, task_id: str) -> State | None:
        """The state of task ``task_id`` as ``conn``'s transaction sees it (``None``:
        no row, purged)."""
        t = self.t.tasks
        value = conn.execute(select(t.c.state).where(t.c.id == task_id)).scalar()
        return None if value is None else State(value)

    def task_for_key(self, dedup_key: str) -> str | None:
        """The id of the task submitted with ``dedup_key`` (a slot's), or ``None``."""
        t = self.t.tasks
        q = select(t.c.id).where(t.c.dedup_key == dedup_key)
        value = self._read(lambda conn: conn.execute(q).scalar())
        return None if value is None else str(value)

    def schedules(self) -> list[ScheduleRow]:
        """Every entry's row, by name."""
        s = self.t.schedules
        rows = self._read(lambda conn: conn.execute(select(s).order_by(s.c.name)).all())
        return [ScheduleRow(**r._mapping) for r in rows]

    def beats(self, seen_within: float) -> list[BeatRow]:
        """The beats seen within the last ``seen_within`` seconds, latest first."""
        b = self.t.beats
        q = (
            select(b)
            .where(b.c.seen_at >= after(db_now(), -seen_within))
            .order_by(b.c.seen_at.desc())
        )
        rows = self._read(lambda conn: conn.execute(q).all())
        return [BeatRow(**r._mapping) for r in rows]

    def schedule_counts(self) -> Sequence[tuple[str, int, int]]:
        """(entry, missed, skipped) of every entry, for the metrics."""
        s = self.t.schedules
        rows = self._read(
            lambda conn: conn.execute(select(s.c.name, s.c.missed, s.c.skipped)).all()
        )
        return [(r.name, int(r.missed), int(r.skipped)) for r in rows]
