"""Numbered schema migrations, and the store operations that apply them.

The ``schema_version`` table records every applied step. ``celery lease migrate``
(and the Django app's migrations) call :func:`migrate`. Step 1 is the baseline:
it creates the tables of :mod:`.schema` as they were at version 1; a later change
to the tables adds a step here and bumps ``SCHEMA_VERSION``, and the baseline is
then frozen as it stands. A test checks that migrating an empty database gives
exactly the tables that :mod:`.schema` defines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from sqlalchemy import Connection, Table, insert, inspect, select
from sqlalchemy.schema import CreateColumn, CreateSchema, DropSchema

from ..exceptions import SchemaOutOfDate
from ._base import StoreBase
from ._db import redact
from .schema import SCHEMA_VERSION, TASKS_FILLFACTOR, Tables, db_now


@dataclasses.dataclass(frozen=True)
class Migration:
    version: int
    description: str
    apply: Callable[[Connection, Tables], None]


def _baseline(conn: Connection, tables: Tables) -> None:
    for table in (tables.tasks, tables.transitions, tables.steps, tables.workers, tables.locks):
        table.create(conn, checkfirst=True)


def _retention(conn: Connection, tables: Tables) -> None:
    for index in tables.tasks.indexes:
        if index.name == f"{tables.tasks.name}_finished":
            index.create(conn, checkfirst=True)
    tables.counters.create(conn, checkfirst=True)


def _pauses(conn: Connection, tables: Tables) -> None:
    tables.pauses.create(conn, checkfirst=True)
    tables.pause_log.create(conn, checkfirst=True)


def _task_message(conn: Connection, tables: Tables) -> None:
    # the baseline creates today's tables, which already have the column
    tasks = tables.tasks
    have = {c["name"] for c in inspect(conn).get_columns(tasks.name, schema=tasks.schema)}
    if "message" not in have:
        preparer = conn.dialect.identifier_preparer
        conn.exec_driver_sql(f"ALTER TABLE {preparer.format_table(tasks)} ADD COLUMN message TEXT")


def _audit_ids_never_reused(conn: Connection, tables: Tables) -> None:
    """SQLite: rebuild the audit table with AUTOINCREMENT ids, rows kept (a rowid table
    gives a new row the highest id left plus one, which may be an id folded already)."""
    tr = tables.transitions
    if conn.dialect.name != "sqlite":
        return  # PostgreSQL's ids come from a sequence: never reused
    sql = conn.exec_driver_sql(
        "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (tr.name,)
    ).scalar()
    if sql is None or "AUTOINCREMENT" in sql.upper():
        return
    old = f"{tr.name}_before_v5"
    for index in tr.indexes:  # index names are per database: free them for the new table
        conn.exec_driver_sql(f'DROP INDEX IF EXISTS "{index.name}"')
    conn.exec_driver_sql(f'ALTER TABLE "{tr.name}" RENAME TO "{old}"')
    tr.create(conn)
    names = ", ".join(f'"{c.name}"' for c in tr.columns)
    conn.exec_driver_sql(f'INSERT INTO "{tr.name}" ({names}) SELECT {names} FROM "{old}"')
    conn.exec_driver_sql(f'DROP TABLE "{old}"')


def _transition_totals(conn: Connection, tables: Tables) -> None:
    _audit_ids_never_reused(conn, tables)
    tables.transition_totals.create(conn, checkfirst=True)
    wm = tables.transition_watermark
    wm.create(conn, checkfirst=True)
    # the reaper folds the audit table's past from id 0, in bounded batches
    if conn.execute(select(wm.c.id).where(wm.c.id == 1)).first() is None:
        conn.execute(insert(wm).values(id=1, upto=0))


def _follow_ups(conn: Connection, tables: Tables) -> None:
    # the baseline creates today's tables, which already have the column
    tasks = tables.tasks
    have = {c["name"] for c in inspect(conn).get_columns(tasks.name, schema=tasks.schema)}
    if "follow_ups_at" not in have:
        preparer = conn.dialect.identifier_preparer
        kind = tasks.c.follow_ups_at.type.compile(dialect=conn.dialect)
        conn.exec_driver_sql(
            f"ALTER TABLE {preparer.format_table(tasks)} ADD COLUMN follow_ups_at {kind}"
        )
    for index in tasks.indexes:
        if index.name == f"{tasks.name}_follow_ups":
            index.create(conn, checkfirst=True)


def _purged(conn: Connection, tables: Tables) -> None:
    tables.purged.create(conn, checkfirst=True)


def _origin(conn: Connection, tables: Tables) -> None:
    # the baseline creates today's tables, which already have the columns
    preparer = conn.dialect.identifier_preparer
    for table in (tables.tasks, tables.workers):
        have = {c["name"] for c in inspect(conn).get_columns(table.name, schema=table.schema)}
        if "origin" not in have:
            conn.exec_driver_sql(
                f"ALTER TABLE {preparer.format_table(table)} ADD COLUMN origin VARCHAR(255)"
            )


#: Indexes of the tasks table that a migration step dropped (without the table prefix):
#: recorded query plans of earlier versions may name them.
DROPPED_INDEXES: tuple[str, ...] = ("tasks_name_state",)


def _narrow_state(conn: Connection, tables: Tables) -> None:
    """What a lifecycle's updates write, narrowed: no (name, state) index, a dedup
    index over the rows that have a key, and (PostgreSQL) room on each page for the new
    versions of its rows. Rows are not touched; the fillfactor applies to pages filled
    from now on."""
    tasks = tables.tasks
    preparer = conn.dialect.identifier_preparer

    def index(name: str) -> str:
        if tasks.schema is None:
            return preparer.quote(name)
        return f"{preparer.quote_schema(tasks.schema)}.{preparer.quote(name)}"

    prefix = tasks.name.removesuffix("tasks")
    for name in DROPPED_INDEXES:
        conn.exec_driver_sql(f"DROP INDEX IF EXISTS {index(prefix + name)}")
    # version 8's dedup index covers every row (a NULL key too): built again, partial
    for dedup in tasks.indexes:
        if dedup.name == f"{tasks.name}_dedup_key":
            conn.exec_driver_sql(f"DROP INDEX IF EXISTS {index(dedup.name)}")
            dedup.create(conn)
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(
            f"ALTER TABLE {preparer.format_table(tasks)} SET (fillfactor = {TASKS_FILLFACTOR})"
        )


def _schedules(conn: Connection, tables: Tables) -> None:
    tables.schedules.create(conn, checkfirst=True)
    tables.beats.create(conn, checkfirst=True)


def _add_column(conn: Connection, table: Table, name: str) -> None:
    """Add ``table``'s column ``name`` as the schema defines it, unless it is there (the
    baseline creates today's tables, which already have it)."""
    have = {c["name"] for c in inspect(conn).get_columns(table.name, schema=table.schema)}
    if name not in have:
        preparer = conn.dialect.identifier_preparer
        column = CreateColumn(table.c[name]).compile(dialect=conn.dialect)
        conn.exec_driver_sql(f"ALTER TABLE {preparer.format_table(table)} ADD COLUMN {column}")


def _held(conn: Connection, tables: Tables) -> None:
    tasks = tables.tasks
    _add_column(conn, tasks, "held")
    for index in tasks.indexes:
        if index.name == f"{tasks.name}_held_eta":
            index.create(conn, checkfirst=True)


def _revision(conn: Connection, tables: Tables) -> None:
    _add_column(conn, tables.tasks, "revision")


def _concurrency(conn: Connection, tables: Tables) -> None:
    tasks = tables.tasks
    _add_column(conn, tasks, "slot_key")
    _add_column(conn, tasks, "slot")
    for index in tasks.indexes:
        if index.name in (f"{tasks.name}_slot_running", f"{tasks.name}_slot_queue"):
            index.create(conn, checkfirst=True)
    tables.concurrency.create(conn, checkfirst=True)


def _rate_limits(conn: Connection, tables: Tables) -> None:
    _add_column(conn, tables.concurrency, "next_start_at")


def _last_start(conn: Connection, tables: Tables) -> None:
    _add_column(conn, tables.concurrency, "last_start_at")


def _changes(conn: Connection, tables: Tables) -> None:
    _add_column(conn, tables.concurrency, "changes")


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "lease tables: tasks, transitions, steps, workers, locks", _baseline),
    Migration(2, "retention: index on finished_at of finished rows; counters", _retention),
    Migration(3, "durable pauses per queue and task name, with their audit log", _pauses),
    Migration(4, "tasks.message: the message Celery built for the task", _task_message),
    Migration(
        5,
        "transition totals folded from the audit table, their watermark; SQLite: audit "
        "ids never reused",
        _transition_totals,
    ),
    Migration(
        6,
        "tasks.follow_ups_at: follow-ups recorded with a success and not yet published",
        _follow_ups,
    ),
    Migration(7, "tombstones of purged task ids: a late message is not adopted", _purged),
    Migration(8, "tasks.origin, workers.origin: the broker of the row's app", _origin),
    Migration(
        9,
        "a narrow lifecycle: no (name, state) index, the dedup index only over rows with a "
        "key, PostgreSQL fillfactor 70 on tasks",
        _narrow_state,
    ),
    Migration(
        10, "beat: a row per periodic entry (its slots decided) and the beats seen", _schedules
    ),
    Migration(
        11,
        "tasks.held: a task due far ahead written and not published until due; its index by ETA",
        _held,
    ),
    Migration(
        12,
        "tasks.revision: the arguments of a PENDING row replaced (on_conflict='replace'); "
        "a message sent before is refused at claim",
        _revision,
    ),
    Migration(
        13,
        "concurrency limits: tasks.slot_key and tasks.slot (waiting, granted), their "
        "indexes, and a row per limited task and key (its lock and limit)",
        _concurrency,
    ),
    Migration(
        14,
        "global rate limits: concurrency.next_start_at, the earliest start not given out; "
        "tasks.slot 'paced' (a start reserved at the row's ETA)",
        _rate_limits,
    ),
    Migration(
        15,
        "global rate limits: concurrency.last_start_at, the last start taken; a paced row "
        "late for its start takes it when none was taken within an interval",
        _last_start,
    ),
    Migration(
        16,
        "concurrency limits: concurrency.changes, the claims, grants and waiting marks of "
        "a key; a claim or a free that no other change preceded under the lock is one "
        "statement",
        _changes,
    ),
)

assert MIGRATIONS[-1].version == SCHEMA_VERSION, "add a migration step for the new schema version"


def _url(conn: Connection) -> str:
    return redact(conn.engine.url.render_as_string(hide_password=True))


def current_version(conn: Connection, tables: Tables) -> int | None:
    """The highest applied version, or ``None`` when the lease tables do not exist."""
    if not inspect(conn).has_table(tables.version.name, schema=tables.version.schema):
        return None
    value = conn.execute(
        select(tables.version.c.version).order_by(tables.version.c.version.desc()).limit(1)
    ).scalar()
    return int(value) if value is not None else None


def migrate(conn: Connection, tables: Tables) -> tuple[int | None, int]:
    """Apply every missing step inside the caller's transaction; return (before, after)."""
    schema = tables.version.schema
    if conn.dialect.name == "postgresql":
        # a migration is DDL over the whole store (an index built over every row of a
        # large table): the bounds the store sets on its short statements do not apply
        # to it; it ends when it is done, or when the operator interrupts it
        conn.exec_driver_sql(
            "SELECT set_config('statement_timeout', '0', true),"
            " set_config('lock_timeout', '0', true),"
            " set_config('idle_in_transaction_session_timeout', '0', true)"
        )
        # serialize concurrent migrators (two workers starting with auto-migrate); taken
        # first because CREATE SCHEMA IF NOT EXISTS itself races under concurrency
        conn.exec_driver_sql("SELECT pg_advisory_xact_lock(hashtext('celery_lease.migrate'))")
        if schema is not None:
            conn.execute(CreateSchema(schema, if_not_exists=True))
    tables.version.create(conn, checkfirst=True)
    before = current_version(conn, tables)
    if before is not None and before > SCHEMA_VERSION:
        # a newer release migrated this store: this code cannot read it, nor undo that
        raise SchemaOutOfDate(before, SCHEMA_VERSION, _url(conn))
    for step in MIGRATIONS:
        if before is not None and step.version <= before:
            continue
        step.apply(conn, tables)
        conn.execute(
            insert(tables.version).values(
                version=step.version, description=step.description, applied_at=db_now()
            )
        )
    return before, SCHEMA_VERSION


class SchemaSetup(StoreBase):
    """The store's own schema: its version, migrating it, dropping it; the engine let go."""

    def schema_version(self) -> int | None:
        """The applied schema version (``None``: no lease tables)."""
        return self._read(lambda conn: current_version(conn, self.t))

    def migrate(self) -> tuple[int | None, int]:
        """Create or upgrade the lease tables; returns (version before, version after)."""
        result = self._tx(lambda conn, _: migrate(conn, self.t), timeout=None)
        self._schema_checked = True
        return result

    def ensure_schema(self, *, auto_migrate: bool | None = None) -> None:
        """Check the schema once per process; create it on SQLite or when auto-migrate is on."""
        if self._schema_checked:
            return
        current = self.schema_version()
        if current != SCHEMA_VERSION:
            auto = self.config.auto_migrate if auto_migrate is None else auto_migrate
            if not (auto or self.dialect == "sqlite") or (current or 0) > SCHEMA_VERSION:
                raise SchemaOutOfDate(current, SCHEMA_VERSION, self.url)
            self.migrate()
        self._schema_checked = True

    def drop_schema(self) -> None:
        """Drop the store's PostgreSQL schema (``lease_schema``) with everything in it,
        if it exists: the end of a store made for one test run. Nothing happens for a
        store without a schema of its own."""
        schema = self.config.schema
        if schema is not None:
            self._tx(lambda conn, _: conn.execute(DropSchema(schema, cascade=True, if_exists=True)))

    def dispose(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()
