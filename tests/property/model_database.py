"""The databases of the store's model-based test (:mod:`tests.property.store_model`)
and the clock they read, which the test sets.

Every decision the store makes compares database time (``db_now`` compiles to
``statement_timestamp()`` on PostgreSQL and ``julianday('now')`` on SQLite). Nothing
is mocked and no production code changes: on PostgreSQL the store's connections put a
clock schema before ``pg_catalog`` in their ``search_path``, where a function
``statement_timestamp()`` returns the one row of a clock table (``clock_timestamp()``,
which bounds a submission's deadline in real time, stays the server's own); on SQLite
each connection registers an application-defined ``julianday()``, which overrides the
built-in, answering the clock for ``'now'``. Both are installed on the engine before
its first connection.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import event

from celery_lease.config import LeaseConfig
from celery_lease.store import Store

#: Where every example's clock starts (any fixed time: the runs are deterministic).
EPOCH = datetime(2030, 1, 1, tzinfo=timezone.utc)

#: Durations the store compares, each ending in half a second (see the docstring).
TIMINGS: dict[str, Any] = {
    "ttl": 9.5,
    "heartbeat_interval": 3.5,
    "reaper_interval": 3.5,
    "publish_grace": 1.5,
    # doubled per publish (backoff): 4.5 s would reach whole seconds from the second
    # publish on; the 1/1024 s more keeps every multiple off them
    "republish_after": 4.5 + 2**-10,
    "max_age": 60.5,
    "retention": 30.5,
    # a start a rate limit reserves further ahead than this is held in the store (a
    # key's third one on at one start every 2.5 s); the countdowns are all shorter
    "hold_eta_after": 5.5,
}


class Database:
    """Where the examples' stores live, and the clock they all read.

    ``url``: a PostgreSQL URL (a clock schema for this object, a fresh schema per
    example, all dropped by :meth:`close`) or ``None`` for SQLite (a fresh file per
    example under ``folder``)."""

    def __init__(self, url: str | None, folder: Path) -> None:
        self.url = url
        self.folder = folder
        self.now = 0.0  # seconds since EPOCH
        self._count = 0
        self._admin: Any = None
        self.clock_schema = f"mclock_{uuid.uuid4().hex[:10]}"
        if url is not None:
            import psycopg

            self._admin = psycopg.connect(_libpq(url), autocommit=True)
            c = self.clock_schema
            self._admin.execute(f"CREATE SCHEMA {c}")
            self._admin.execute(f"CREATE TABLE {c}.clock (now timestamptz NOT NULL)")
            self._admin.execute(f"INSERT INTO {c}.clock VALUES (%s)", (EPOCH,))
            self._admin.execute(
                f"CREATE FUNCTION {c}.statement_timestamp() RETURNS timestamptz "
                f"LANGUAGE sql STABLE AS 'SELECT now FROM {c}.clock'"
            )

    @property
    def is_pg(self) -> bool:
        return self.url is not None

    def set_clock(self, seconds: float) -> None:
        """The database's time is ``EPOCH + seconds`` from the next statement on."""
        self.now = seconds
        if self._admin is not None:
            self._admin.execute(
                f"UPDATE {self.clock_schema}.clock SET now = %s",
                (EPOCH + timedelta(seconds=seconds),),
            )

    def _julianday(self, value: str) -> float | None:
        if value != "now":
            return None
        return (EPOCH.timestamp() + self.now) / 86400.0 + 2440587.5

    def new_store(self, store_class: type[Store] = Store) -> Store:
        """A migrated store (a ``store_class``) on tables no earlier example touched,
        its clock at EPOCH."""
        self._count += 1
        self.set_clock(0.0)
        if self.url is None:
            config = LeaseConfig(
                database_url=f"sqlite:///{self.folder / f'model-{self._count}.sqlite3'}",
                **TIMINGS,
            )
        else:
            schema = f"model_{uuid.uuid4().hex[:10]}"
            config = LeaseConfig(database_url=self.url, schema=schema, **TIMINGS)
        store = store_class(config)
        # before the first connection: every connection of the store reads the clock
        if self.url is None:

            @event.listens_for(store.engine, "connect")
            def _sqlite_clock(dbapi_conn: Any, record: Any) -> None:
                dbapi_conn.create_function("julianday", 1, self._julianday)

        else:
            path = f"{self.clock_schema}, pg_catalog, public"

            @event.listens_for(store.engine, "connect")
            def _pg_clock(dbapi_conn: Any, record: Any) -> None:
                with dbapi_conn.cursor() as cur:
                    cur.execute(f"SET search_path TO {path}")
                dbapi_conn.commit()

        store.migrate()
        return store

    def drop(self, store: Store) -> None:
        try:
            if self.url is None:
                path = Path(store.engine.url.database or "")
                store.dispose()
                for suffix in ("", "-wal", "-shm"):
                    Path(f"{path}{suffix}").unlink(missing_ok=True)
            else:
                store.drop_schema()
                store.dispose()
        except Exception:
            store.dispose()
            raise

    def close(self) -> None:
        if self._admin is not None:
            self._admin.execute(f"DROP SCHEMA IF EXISTS {self.clock_schema} CASCADE")
            self._admin.close()
            self._admin = None


def _libpq(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
