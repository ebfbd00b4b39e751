"""The crash-suite harness outside pytest, for ``scripts/soak.py`` and
``scripts/compare_celery.py``: what the fixtures of ``tests/conftest.py`` give a test
(a PostgreSQL database of its own, or with ``store="sqlite"`` SQLite files of its own,
a Redis database flushed before and after, the counting stub, generated projects and
their worker processes), as a context manager.

Services (as for the test suite): ``CELERY_LEASE_TEST_PG_ADMIN_URL`` (default
``postgresql://postgres@127.0.0.1:5432/test``) and ``CELERY_LEASE_TEST_REDIS_URL``
(default ``redis://127.0.0.1:6379/10``, a database the scripts flush); with a RabbitMQ
broker, ``CELERY_LEASE_TEST_AMQP_URL`` (default ``amqp://guest:guest@127.0.0.1:5672//``)
names the server and user, the environment making a vhost of its own there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any

from sqlalchemy.engine import make_url

from celery_lease.config import LeaseConfig, sqlite_file
from celery_lease.store import Store

from ..helpers import EXTERNAL_ENV, ExternalSystem, ProcessRegistry, WorkerProject, lease_settings
from .faults import rabbitmq_add_vhost, rabbitmq_delete_vhost, vhost_of, with_vhost
from .support import GATES_ENV, Gates, LeasedProject

PG_ADMIN_URL = os.environ.get(
    "CELERY_LEASE_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("CELERY_LEASE_TEST_REDIS_URL", "redis://127.0.0.1:6379/10")
AMQP_URL = os.environ.get("CELERY_LEASE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")


def _libpq(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _pg(url: str, statement: Any) -> None:
    import psycopg

    with psycopg.connect(_libpq(url), autocommit=True, connect_timeout=5) as conn:
        conn.execute(statement)


def _flush_redis(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=5)
    try:
        client.flushdb()
    finally:
        client.close()


class Standalone:
    """A scratch environment: ``with Standalone() as env: p = env.project(SOURCE, ...)``.

    The projects' store is a PostgreSQL database of the environment's own, made on entry
    (each project in a schema of its own), or with ``store="sqlite"`` a SQLite file per
    project in the environment's directory, shared by every process of that project
    (the embedded default: one file on the host, the default table prefix). The
    projects' broker is the Redis database, or with ``broker="amqp"`` RabbitMQ
    (``amqp_url``'s server and user) on a virtual host of the environment's own, made on
    entry (:attr:`broker_url`).

    Everything started is killed on exit, the database is dropped (SQLite: the files
    deleted with the directory), the Redis database flushed, the virtual host deleted;
    when ``keep`` is set (a violation) or the block raised, the database (or SQLite
    files), the Redis database, the virtual host and the directory with the workers' logs
    are kept instead, and where they are is printed.
    """

    def __init__(
        self,
        *,
        redis_url: str = REDIS_URL,
        pg_admin_url: str = PG_ADMIN_URL,
        keep: bool = False,
        broker: str = "redis",
        amqp_url: str = AMQP_URL,
        store: str = "postgresql",
    ) -> None:
        if broker not in ("redis", "amqp"):
            raise ValueError(f"broker {broker!r}: 'redis' or 'amqp'")
        if store not in ("postgresql", "sqlite"):
            raise ValueError(f"store {store!r}: 'postgresql' or 'sqlite'")
        self.redis_url = redis_url
        self.pg_admin_url = pg_admin_url
        self.keep = keep
        #: the projects' broker: the Redis database, or a RabbitMQ vhost of this run's own
        self.broker_url = (
            with_vhost(amqp_url, f"celery-lease-script-{os.getpid()}")
            if broker == "amqp"
            else redis_url
        )
        self.store = store
        self.database = f"celery_lease_script_{os.getpid()}"
        self.dir = Path(tempfile.mkdtemp(prefix="celery-lease-script-"))
        #: the PostgreSQL database of the projects' stores ("" on SQLite: a file each)
        self.database_url = (
            ""
            if store == "sqlite"
            else make_url(pg_admin_url).set(database=self.database).render_as_string(False)
        )
        self.registry = ProcessRegistry()
        self.stores: list[Store] = []
        self.finalizers: list[Any] = []
        self._count = 0

    def __enter__(self) -> Standalone:
        from psycopg import sql

        if self.store == "postgresql":
            name = sql.Identifier(self.database)
            _pg(self.pg_admin_url, sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(name))
            _pg(self.pg_admin_url, sql.SQL("CREATE DATABASE {}").format(name))
        _flush_redis(self.redis_url)
        if self.broker_url != self.redis_url:
            rabbitmq_add_vhost(self.broker_url)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        from psycopg import sql

        self.registry.close()
        for finalize in reversed(self.finalizers):
            with contextlib.suppress(Exception):
                finalize()
        for store in self.stores:
            with contextlib.suppress(Exception):
                store.dispose()
        if self.keep or kind is not None:
            # the evidence stays: the rows, audit trails, steps and stored messages in
            # the database, the queues and the result backend's keys (chords) in Redis
            if self.store == "sqlite":
                files = ", ".join(str(sqlite_file(s.config.database_url)) for s in self.stores)
                database = f"SQLite store kept: {files}"
            else:
                url = make_url(self.database_url).render_as_string(hide_password=True)
                schemas = ", ".join(sorted({s.config.schema or "public" for s in self.stores}))
                database = (
                    f"database kept: {url} (schemas {schemas}; drop it with DROP DATABASE "
                    f"{self.database})"
                )
            print(
                f"worker logs kept in {self.dir}\n{database}\nRedis database kept: "
                f"{self.redis_url} (flushed by the next run)",
                flush=True,
            )
            if self.broker_url != self.redis_url:
                vhost = vhost_of(self.broker_url)
                print(
                    f"RabbitMQ vhost kept: {vhost} (delete it with rabbitmqctl delete_vhost "
                    f"{vhost})",
                    flush=True,
                )
            return
        with contextlib.suppress(Exception):
            _flush_redis(self.redis_url)
        if self.broker_url != self.redis_url:
            with contextlib.suppress(Exception):
                rabbitmq_delete_vhost(self.broker_url)
        if self.store == "postgresql":
            name = sql.Identifier(self.database)
            with contextlib.suppress(Exception):
                _pg(
                    self.pg_admin_url,
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(name),
                )
        shutil.rmtree(self.dir, ignore_errors=True)

    def flush_redis(self) -> None:
        _flush_redis(self.redis_url)

    def lease_config(self, **overrides: Any) -> LeaseConfig:
        """A config on this environment's database, in a schema of its own (SQLite: a
        file of its own in the environment's directory)."""
        name = uuid.uuid4().hex[:10]
        values: dict[str, Any] = (
            {"database_url": f"sqlite:///{self.dir / f'lease-{name}.sqlite3'}"}
            if self.store == "sqlite"
            else {"database_url": self.database_url, "schema": f"s_{name}"}
        )
        values.update(overrides)
        return LeaseConfig(**values)

    def plain_project(
        self, source: str, *, settings: dict[str, Any] | None = None
    ) -> tuple[WorkerProject, ExternalSystem]:
        """A project without celery-lease; its own counting stub."""
        self._count += 1
        directory = self.dir / f"project{self._count}"
        directory.mkdir()
        external = ExternalSystem(directory / "external.sqlite3")
        project = WorkerProject(
            directory,
            broker_url=self.broker_url,
            queue=f"script-{uuid.uuid4().hex[:10]}",
            source=source,
            settings=settings,
            env={EXTERNAL_ENV: str(external.path), GATES_ENV: str(directory / "gates")},
            registry=self.registry,
        )
        return project, external

    def leased_project(
        self, source: str, *, settings: dict[str, Any] | None = None, **lease: Any
    ) -> LeasedProject:
        """A leased project (``lease`` are LeaseConfig fields) on a migrated store."""
        config = self.lease_config(**lease)
        merged = {**lease_settings(config), **(settings or {})}
        project, external = self.plain_project(source, settings=merged)
        store = Store(config)
        self.stores.append(store)
        store.migrate()
        gates = Gates(project.directory / "gates")
        return LeasedProject(project, store, external, gates, self.finalizers)
