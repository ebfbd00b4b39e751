"""Worker incarnations (heartbeats) and the named lock the embedded reapers share."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection, delete, or_, select, update

from ._base import StoreBase
from ._sql import after, db_now, seconds_between
from ._types import Peer


class WorkersMixin(StoreBase):
    def register_worker(
        self, worker_id: str, nodename: str, hostname: str, pid: int, *, supersede: bool = True
    ) -> list[str]:
        """Insert this incarnation; with ``supersede``, mark earlier live incarnations of
        the same node name stopped (a restart means they are gone) and return their ids.

        A worker that may find a live duplicate registers with ``supersede=False``, looks
        at :meth:`peers` and supersedes only the dead ones (:meth:`supersede`).
        """
        w = self.t.workers

        def op(conn: Connection, _: bool) -> list[str]:
            conn.execute(
                self._insert(w)
                .values(
                    id=worker_id,
                    nodename=nodename,
                    hostname=hostname,
                    pid=pid,
                    started_at=db_now(),
                    heartbeat_at=db_now(),
                )
                .on_conflict_do_nothing()
            )
            if not supersede:
                return []
            rows = conn.execute(
                update(w)
                .where(w.c.nodename == nodename, w.c.id != worker_id, w.c.stopped_at.is_(None))
                .values(stopped_at=db_now(), stop_reason=f"superseded by restart {worker_id}")
                .returning(w.c.id)
            ).all()
            return [str(r.id) for r in rows]

        return self._tx(op)

    def peers(self, nodename: str, worker_id: str) -> list[Peer]:
        """The other live (not stopped) incarnations named ``nodename``."""
        w = self.t.workers
        q = select(
            w.c.id,
            w.c.hostname,
            w.c.pid,
            w.c.heartbeat_at,
            seconds_between(db_now(), w.c.heartbeat_at).label("age"),
        ).where(w.c.nodename == nodename, w.c.id != worker_id, w.c.stopped_at.is_(None))
        rows = self._read(lambda conn: conn.execute(q).all())
        return [
            Peer(str(r.id), str(r.hostname), int(r.pid), float(r.age), r.heartbeat_at) for r in rows
        ]

    def supersede(self, worker_ids: Sequence[str], by: str) -> list[str]:
        """Mark these incarnations stopped (gone: superseded by ``by``); returns the ids
        this call stopped (not those already stopped)."""
        if not worker_ids:
            return []
        w = self.t.workers

        def op(conn: Connection, _: bool) -> list[str]:
            rows = conn.execute(
                update(w)
                .where(w.c.id.in_(list(worker_ids)), w.c.stopped_at.is_(None))
                .values(stopped_at=db_now(), stop_reason=f"superseded by restart {by}")
                .returning(w.c.id)
            ).all()
            return [str(r.id) for r in rows]

        return self._tx(op)

    def renew(self, worker_id: str) -> bool:
        """One heartbeat: one statement however many tasks the worker runs.

        ``False``: the incarnation was marked stopped by someone else.
        """
        w = self.t.workers

        def op(conn: Connection, _: bool) -> bool:
            count = conn.execute(
                update(w)
                .where(w.c.id == worker_id, w.c.stopped_at.is_(None))
                .values(heartbeat_at=db_now())
            ).rowcount
            return bool(count)

        return self._tx(op, single=True)

    def reactivate_worker(self, worker_id: str) -> None:
        """Mark this incarnation alive again (it was marked stopped while it still ran)."""
        w = self.t.workers
        self._tx(
            lambda conn, _: conn.execute(
                update(w)
                .where(w.c.id == worker_id)
                .values(stopped_at=None, stop_reason=None, heartbeat_at=db_now())
            )
        )

    def stop_worker(self, worker_id: str, reason: str) -> None:
        """Mark this incarnation stopped: leases it still holds are expired at once."""
        w = self.t.workers
        self._tx(
            lambda conn, _: conn.execute(
                update(w)
                .where(w.c.id == worker_id, w.c.stopped_at.is_(None))
                .values(stopped_at=db_now(), stop_reason=reason)
            )
        )

    # -- reaper lock ------------------------------------------------------------------

    def try_lock(self, name: str, holder: str, ttl: float) -> bool:
        """Take or renew a named lock for ``ttl`` seconds (database time)."""
        lk = self.t.locks

        def op(conn: Connection, _: bool) -> bool:
            got = conn.execute(
                update(lk)
                .where(lk.c.name == name, or_(lk.c.holder == holder, lk.c.expires_at < db_now()))
                .values(holder=holder, expires_at=after(db_now(), ttl))
            ).rowcount
            if got:
                return True
            inserted = conn.execute(
                self._insert(lk)
                .values(name=name, holder=holder, expires_at=after(db_now(), ttl))
                .on_conflict_do_nothing()
                .returning(lk.c.name)
            ).first()
            return inserted is not None

        return self._tx(op)

    def release_lock(self, name: str, holder: str) -> None:
        lk = self.t.locks
        self._tx(
            lambda conn, _: conn.execute(delete(lk).where(lk.c.name == name, lk.c.holder == holder))
        )
