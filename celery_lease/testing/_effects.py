"""A counter of real side effects, shared by a test and every worker process it starts."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..exceptions import ConfigurationError

#: Environment variable through which a worker started by the kit finds the test's counter.
EFFECTS_ENV = "CELERY_LEASE_SIDE_EFFECTS"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS effects (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    key TEXT,
    payload TEXT,
    pid INTEGER NOT NULL,
    at REAL NOT NULL,
    UNIQUE (name, key)
);
CREATE TABLE IF NOT EXISTS calls (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    key TEXT,
    effect_id INTEGER NOT NULL,
    deduplicated INTEGER NOT NULL,
    pid INTEGER NOT NULL
);
"""


@dataclasses.dataclass(frozen=True)
class Effect:
    """One real effect: its id, the name it was counted under, its key and payload, the
    process that performed it and when (``time.time()`` in that process)."""

    id: int
    name: str
    key: str | None
    payload: str | None
    pid: int
    at: float


class SideEffects:
    """A stand-in for a payment API, a mailer or an upload target, outside every worker.

    Its state is a SQLite file, so calls from any process (pool processes, other
    workers, the test) are counted together, and an effect committed just before a
    SIGKILL stays counted, as it would in a real remote system.

    ``call(name, key)`` performs one effect and returns its id. A call that repeats an
    idempotency ``key`` already used for ``name`` performs nothing new and returns the
    first effect's id, as an API that deduplicates on a key does. ``count(name)`` is
    the number of real effects; ``calls(name)`` every call, deduplicated or not.

    In task code running in a worker the kit started, :func:`side_effects` returns the
    test's counter.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        with self._connect() as conn:
            conn.executescript(_SCHEMA)

    @classmethod
    def from_env(cls, variable: str = EFFECTS_ENV) -> SideEffects:
        """The counter named by the environment variable ``variable``.

        Raises:
            ConfigurationError: the variable is not set (this process was not started
                by a test that counts side effects).
        """
        try:
            return cls(os.environ[variable])
        except KeyError:
            raise ConfigurationError(
                f"{variable} is not set: side effects are counted only in processes "
                "started by celery_lease.testing (the lease_worker fixture)"
            ) from None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.path}>"

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        # a connection per call: safe across fork, and nothing stays open in a killed child
        conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            yield conn
        finally:
            conn.close()

    def call(self, name: str, key: str | None = None, payload: Any = None) -> int:
        """Perform one effect (or replay the one recorded under ``key``); return its id."""
        text = None if payload is None else str(payload)
        pid = os.getpid()
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                existing = None
                if key is not None:
                    existing = conn.execute(
                        "SELECT id FROM effects WHERE name = ? AND key = ?", (name, key)
                    ).fetchone()
                if existing is not None:
                    effect_id, deduplicated = int(existing[0]), 1
                else:
                    cur = conn.execute(
                        "INSERT INTO effects (name, key, payload, pid, at) VALUES (?, ?, ?, ?, ?)",
                        (name, key, text, pid, time.time()),
                    )
                    effect_id, deduplicated = int(cur.lastrowid or 0), 0
                conn.execute(
                    "INSERT INTO calls (name, key, effect_id, deduplicated, pid)"
                    " VALUES (?, ?, ?, ?, ?)",
                    (name, key, effect_id, deduplicated, pid),
                )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return effect_id

    def count(self, name: str | None = None) -> int:
        """Real effects performed (for ``name``, or in all)."""
        return self._scalar("effects", name)

    def calls(self, name: str | None = None) -> int:
        """Calls received, including those answered from an idempotency key."""
        return self._scalar("calls", name)

    def counts(self) -> dict[str, int]:
        """Real effects per name."""
        with self._connect() as conn:
            rows = conn.execute("SELECT name, count(*) FROM effects GROUP BY name").fetchall()
        return {str(r[0]): int(r[1]) for r in rows}

    def effects(self, name: str | None = None) -> list[Effect]:
        """The real effects, oldest first."""
        query = "SELECT id, name, key, payload, pid, at FROM effects"
        params: tuple[Any, ...] = ()
        if name is not None:
            query += " WHERE name = ?"
            params = (name,)
        with self._connect() as conn:
            rows = conn.execute(query + " ORDER BY id", params).fetchall()
        return [Effect(int(r[0]), r[1], r[2], r[3], int(r[4]), float(r[5])) for r in rows]

    def _scalar(self, table: str, name: str | None) -> int:
        query = f"SELECT count(*) FROM {table}"
        params: tuple[Any, ...] = ()
        if name is not None:
            query += " WHERE name = ?"
            params = (name,)
        with self._connect() as conn:
            return int(conn.execute(query, params).fetchone()[0])


_cached: SideEffects | None = None


def side_effects() -> SideEffects:
    """The test's counter, in a process the kit started (from ``CELERY_LEASE_SIDE_EFFECTS``).

    Raises:
        ConfigurationError: the process was not started by the kit.
    """
    global _cached
    path = os.environ.get(EFFECTS_ENV)
    if _cached is None or path is None or _cached.path != Path(path):
        _cached = SideEffects.from_env()
    return _cached
