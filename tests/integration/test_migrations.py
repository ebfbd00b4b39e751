"""Migrations: an empty database migrated equals the table definitions; migrate is
idempotent and safe to race; ``ensure_schema`` refuses an unmigrated PostgreSQL."""

from __future__ import annotations

import multiprocessing
import re
import threading
import uuid
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, func, insert, inspect, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.schema import CreateSchema

from celery_lease import State
from celery_lease.exceptions import SchemaOutOfDate, StoreError
from celery_lease.store import SCHEMA_VERSION, Claim, NewTask, Refusal, Slot, build
from celery_lease.store.migrations import MIGRATIONS
from celery_lease.store.schema import TASKS_FILLFACTOR, after, db_now

from ..conftest import drop_pg_schema
from ..helpers import migrate_in_process

PREFIX = "lease_"


def _engine(url: str) -> Engine:
    url_obj = make_url(url)
    if url_obj.drivername == "postgresql":
        url_obj = url_obj.set(drivername="postgresql+psycopg")
    return create_engine(url_obj)


def schema_snapshot(engine: Engine, schema: str | None, prefix: str = PREFIX) -> dict[str, Any]:
    """Tables, columns, keys and indexes as the database reports them (schema name masked)."""

    def mask(value: Any) -> Any:
        text = repr(value)
        return re.sub(re.escape(schema), "<schema>", text) if schema else text

    insp = inspect(engine)
    out: dict[str, Any] = {}
    for table in sorted(insp.get_table_names(schema=schema)):
        if not table.startswith(prefix):
            continue
        columns = [
            (
                c["name"],
                str(c["type"]),
                c["nullable"],
                mask(c.get("default")),
                c.get("autoincrement"),
            )
            for c in insp.get_columns(table, schema=schema)
        ]
        indexes = sorted(
            (
                i["name"],
                tuple(i["column_names"]),
                bool(i["unique"]),
                # partial-index predicates come back as SQL text (TextClause on SQLite)
                mask({k: str(v) for k, v in sorted(i.get("dialect_options", {}).items())}),
            )
            for i in insp.get_indexes(table, schema=schema)
        )
        out[table] = {
            "columns": columns,
            "pk": insp.get_pk_constraint(table, schema=schema)["constrained_columns"],
            "indexes": indexes,
            "unique": sorted(mask(u) for u in insp.get_unique_constraints(table, schema=schema)),
            "fks": sorted(mask(f) for f in insp.get_foreign_keys(table, schema=schema)),
        }
    return out


@pytest.fixture
def elsewhere(lease_config, harness, tmp_path):
    """A second empty location on the same backend: (url, schema)."""
    if lease_config.is_pg:
        schema = f"t_{uuid.uuid4().hex[:12]}"
        harness.finalizers.append(lambda: drop_pg_schema(lease_config.url, schema))
        return lease_config.url, schema
    return f"sqlite:///{tmp_path / 'create_all.sqlite3'}", None


def test_migrating_an_empty_database_gives_exactly_the_table_definitions(make_store, elsewhere):
    store = make_store(migrate=False)
    assert store.migrate() == (None, SCHEMA_VERSION)

    url, schema = elsewhere
    engine = _engine(url)
    try:
        with engine.begin() as conn:
            if schema is not None:
                conn.execute(CreateSchema(schema))
            build(PREFIX, schema).metadata.create_all(conn)
        expected = schema_snapshot(engine, schema)
    finally:
        engine.dispose()

    migrated = schema_snapshot(store.engine, store.config.schema)
    assert set(expected) == {
        f"{PREFIX}{name}"
        for name in (
            "tasks",
            "transitions",
            "steps",
            "workers",
            "locks",
            "schema_version",
            "counters",
            "pauses",
            "pause_log",
            "transition_totals",
            "transition_watermark",
            "purged",
            "schedules",
            "beats",
            "concurrency",
        )
    }
    assert migrated == expected


def test_a_version_1_database_is_upgraded_in_place(make_store):
    store = make_store(migrate=False)
    store.migrate()
    full = schema_snapshot(store.engine, store.config.schema)
    task = NewTask(
        id="kept", name="t", args="[]", kwargs="{}", options="{}", lease_ttl=1.0, max_recoveries=1
    )
    store.submit(task)
    # back to what version 1 created: no finished index, counters, pauses, message or
    # follow-ups
    t = store.t
    with store.engine.begin() as conn:
        drop_follow_ups(store, conn)
        next(i for i in t.tasks.indexes if i.name.endswith("_finished")).drop(conn)
        t.counters.drop(conn)
        t.pauses.drop(conn)
        t.pause_log.drop(conn)
        t.transition_totals.drop(conn)
        t.transition_watermark.drop(conn)
        t.purged.drop(conn)
        _drop_origin(store, conn)
        conn.exec_driver_sql(
            f"ALTER TABLE {store.engine.dialect.identifier_preparer.format_table(t.tasks)} "
            "DROP COLUMN message"
        )
        conn.execute(t.version.delete().where(t.version.c.version > 1))
    assert store.schema_version() == 1
    assert store.migrate() == (1, SCHEMA_VERSION)
    assert schema_snapshot(store.engine, store.config.schema) == full
    assert store.get("kept") is not None


def test_a_version_3_database_gains_the_message_column_and_keeps_its_rows(make_store):
    store = make_store(migrate=False)
    store.migrate()
    store.submit(
        NewTask(
            id="old", name="t", args="[]", kwargs="{}", options=None, lease_ttl=30, max_recoveries=5
        )
    )
    t, version = store.t.tasks, store.t.version
    table = store.engine.dialect.identifier_preparer.format_table(t)
    with store.engine.begin() as conn:  # the database as schema version 3 left it
        _drop_origin(store, conn)
        drop_follow_ups(store, conn)
        conn.exec_driver_sql(f"ALTER TABLE {table} DROP COLUMN message")
        store.t.transition_totals.drop(conn)
        store.t.transition_watermark.drop(conn)
        store.t.purged.drop(conn)
        conn.execute(version.delete().where(version.c.version >= 4))
    assert store.schema_version() == 3

    assert store.migrate() == (3, SCHEMA_VERSION)
    record = store.get("old")
    assert record is not None and record.args == [] and record.message is None
    store.submit(
        NewTask(
            id="new",
            name="t",
            args="[]",
            kwargs="{}",
            options=None,
            lease_ttl=30,
            max_recoveries=5,
            message='{"v": 1}',
        )
    )
    assert store.get("new").message == '{"v": 1}'


def test_a_version_4_database_gains_the_transition_totals_and_keeps_its_audit_trail(make_store):
    store = make_store(migrate=False)
    store.migrate()
    full = schema_snapshot(store.engine, store.config.schema)
    ids = [
        store.submit(
            NewTask(
                id=f"old-{i}",
                name="t",
                args="[]",
                kwargs="{}",
                options=None,
                lease_ttl=30,
                max_recoveries=5,
            )
        )[0]
        for i in range(3)
    ]
    t = store.t
    tr = t.transitions
    with store.engine.begin() as conn:  # the database as schema version 4 left it
        _drop_origin(store, conn)
        t.purged.drop(conn)
        drop_follow_ups(store, conn)
        t.transition_totals.drop(conn)
        t.transition_watermark.drop(conn)
        conn.execute(t.version.delete().where(t.version.c.version >= 5))
        if not store.is_pg:  # a rowid audit table, without AUTOINCREMENT
            ddl = conn.exec_driver_sql(
                "SELECT sql FROM sqlite_master WHERE name = ?", (tr.name,)
            ).scalar_one()
            conn.exec_driver_sql(f"ALTER TABLE {tr.name} RENAME TO v4_audit")
            for index in tr.indexes:
                conn.exec_driver_sql(f"DROP INDEX {index.name}")
            conn.exec_driver_sql(ddl.replace(" AUTOINCREMENT", ""))
            conn.exec_driver_sql(f"INSERT INTO {tr.name} SELECT * FROM v4_audit")
            conn.exec_driver_sql("DROP TABLE v4_audit")
            for index in tr.indexes:
                index.create(conn)
            assert (
                "AUTOINCREMENT"
                not in conn.exec_driver_sql(
                    "SELECT sql FROM sqlite_master WHERE name = ?", (tr.name,)
                ).scalar_one()
            )
    assert store.schema_version() == 4

    assert store.migrate() == (4, SCHEMA_VERSION)
    assert schema_snapshot(store.engine, store.config.schema) == full
    assert [len(store.history(i)) for i in ids] == [1, 1, 1]
    with store.engine.begin() as conn:  # the newest task gone, and its audit row, the
        top = conn.execute(select(func.max(tr.c.id))).scalar_one()  # highest id
        conn.execute(tr.delete().where(tr.c.id == top))
        conn.execute(t.tasks.delete().where(t.tasks.c.id == ids[-1]))
    store.submit(
        NewTask(
            id="new", name="t", args="[]", kwargs="{}", options=None, lease_ttl=30, max_recoveries=5
        )
    )
    with store.engine.connect() as conn:
        assert conn.execute(select(func.max(tr.c.id))).scalar_one() > top
    # the reaper folds the trail that was there before the upgrade, and the new row
    assert store.fold_transitions(settle=0).rows == 3
    assert store.transition_totals(tail=0).counts == {(None, "PENDING"): 3}


def drop_follow_ups(store: Any, conn: Any) -> None:
    """Back to the tasks table before schema version 6: no ``follow_ups_at`` (nor its
    index)."""
    tasks = store.t.tasks
    next(i for i in tasks.indexes if i.name.endswith("_follow_ups")).drop(conn)
    table = store.engine.dialect.identifier_preparer.format_table(tasks)
    conn.exec_driver_sql(f"ALTER TABLE {table} DROP COLUMN follow_ups_at")


def _drop_held(store: Any, conn: Any) -> None:
    """Back to the tasks table before schema version 11: no ``held`` (nor its index)."""
    tasks = store.t.tasks
    next(i for i in tasks.indexes if i.name.endswith("_held_eta")).drop(conn)
    table = store.engine.dialect.identifier_preparer.format_table(tasks)
    conn.exec_driver_sql(f"ALTER TABLE {table} DROP COLUMN held")


def _drop_origin(store: Any, conn: Any) -> None:
    """Drop the ``origin`` columns schema version 8 added (an older database's shape),
    and the columns versions 11 and 12 added after them (a migration adds a column
    last: the columns after it must go too for the upgrade to give the same order)."""
    _drop_revision(store, conn)
    _drop_held(store, conn)
    preparer = store.engine.dialect.identifier_preparer
    for table in (store.t.tasks, store.t.workers):
        conn.exec_driver_sql(f"ALTER TABLE {preparer.format_table(table)} DROP COLUMN origin")


def _drop_revision(store: Any, conn: Any) -> None:
    """Drop the ``revision`` column schema version 12 added (and what version 13 added
    after it)."""
    _drop_concurrency(store, conn)
    table = store.engine.dialect.identifier_preparer.format_table(store.t.tasks)
    conn.exec_driver_sql(f"ALTER TABLE {table} DROP COLUMN revision")


def _drop_concurrency(store: Any, conn: Any) -> None:
    """Back to schema version 12: no slot columns on tasks, their indexes, nor the
    concurrency table."""
    tasks = store.t.tasks
    for index in tasks.indexes:
        if index.name.endswith(("_slot_running", "_slot_queue")):
            index.drop(conn)
    table = store.engine.dialect.identifier_preparer.format_table(tasks)
    conn.exec_driver_sql(f"ALTER TABLE {table} DROP COLUMN slot")
    conn.exec_driver_sql(f"ALTER TABLE {table} DROP COLUMN slot_key")
    store.t.concurrency.drop(conn)


def test_a_version_12_database_gains_the_concurrency_slots_and_keeps_its_rows(make_store):
    store = make_store(migrate=False)
    store.migrate()
    full = schema_snapshot(store.engine, store.config.schema)
    task = NewTask(
        id="old", name="t", args="[]", kwargs="{}", options=None, lease_ttl=30, max_recoveries=5
    )
    store.submit(task)
    t = store.t
    with store.engine.begin() as conn:  # the database as schema version 12 left it
        _drop_concurrency(store, conn)
        conn.execute(t.version.delete().where(t.version.c.version > 12))
    assert store.schema_version() == 12

    assert store.migrate() == (12, SCHEMA_VERSION)
    assert schema_snapshot(store.engine, store.config.schema) == full
    record = store.get("old")
    assert record is not None and record.state is State.PENDING


def _rows_of_a_limited_key(store: Any, more: tuple[str, ...] = ()) -> tuple[str, Slot, Claim]:
    """A worker and rows of task ``t`` in several states: ``pending``, ``running`` (the
    one slot of key ``k``), ``waiting`` for it, ``done`` and ``manual`` (WAIT_MANUAL),
    and ``more`` submitted and published, left to the caller. (The worker's id, the
    slot, the running row's claim.)"""
    owner = uuid.uuid4().hex
    store.register_worker(owner, "w@host", "host", 1)
    ids = ("pending", "running", "waiting", "done", "manual", *more)
    for task_id in ids:
        store.submit(
            NewTask(
                id=task_id,
                name="t",
                args="[]",
                kwargs="{}",
                options=None,
                lease_ttl=30,
                max_recoveries=5,
            )
        )
    store.mark_published(list(ids))
    slot = Slot("t", "k", 1)
    running = store.claim("running", owner, "w", slot=slot)
    assert isinstance(running, Claim)
    assert isinstance(store.claim("waiting", owner, "w", slot=slot), Refusal)
    for task_id, to in (("done", State.SUCCEEDED), ("manual", State.WAIT_MANUAL)):
        claim = store.claim(task_id, owner, "w")
        assert isinstance(claim, Claim)
        assert store.finish(claim.lease, to, actor="t", reason="ended")
    return owner, slot, running


def test_a_version_13_database_gains_the_rate_column_and_keeps_its_rows_and_slots(make_store):
    store = make_store(migrate=False)
    store.migrate()
    full = schema_snapshot(store.engine, store.config.schema)
    _, _, running = _rows_of_a_limited_key(store)
    before = {r.id: (r.state, r.attempt) for r in store.list_tasks(limit=100)}
    t = store.t
    with store.engine.begin() as conn:  # the database as schema version 13 left it
        table = store.engine.dialect.identifier_preparer.format_table(t.concurrency)
        # (and the columns versions 15 and 16 added after it: a migration adds a column
        # last)
        conn.exec_driver_sql(f"ALTER TABLE {table} DROP COLUMN changes")
        conn.exec_driver_sql(f"ALTER TABLE {table} DROP COLUMN last_start_at")
        conn.exec_driver_sql(f"ALTER TABLE {table} DROP COLUMN next_start_at")
        conn.execute(t.version.delete().where(t.version.c.version > 13))
    assert store.schema_version() == 13

    assert store.migrate() == (13, SCHEMA_VERSION)
    assert schema_snapshot(store.engine, store.config.schema) == full
    assert {r.id: (r.state, r.attempt) for r in store.list_tasks(limit=100)} == before
    # the slot taken before the migration still counts; the waiting row still waits
    (usage,) = store.slot_usage()
    assert (usage.key, usage.limit, usage.running, usage.waiting) == ("k", 1, 1, 1)
    assert store.finish(running.lease, State.SUCCEEDED, actor="t", reason="ok")
    assert [p.id for p in store.grant([("t", "k")])] == ["waiting"]


def test_a_version_14_database_gains_the_last_start_and_keeps_its_rows_slots_and_paces(
    make_store,
):
    store = make_store(migrate=False)
    store.migrate()
    full = schema_snapshot(store.engine, store.config.schema)
    owner, _, running = _rows_of_a_limited_key(store, more=("started", "paced"))
    # a rate-limited key: one start taken, the next delivery paced to a start 60 s on
    rate = Slot("t", "r", 0, interval=60.0)
    assert isinstance(store.claim("started", owner, "w", slot=rate), Claim)
    paced = store.claim("paced", owner, "w", slot=rate)
    assert isinstance(paced, Refusal) and paced.paced
    before = {r.id: (r.state, r.attempt) for r in store.list_tasks(limit=100)}
    t = store.t
    c = t.concurrency
    with store.engine.connect() as conn:
        next_start = conn.execute(select(c.c.next_start_at).where(c.c.key == "r")).scalar_one()
        paced_eta = conn.execute(select(t.tasks.c.eta).where(t.tasks.c.id == "paced")).scalar()
    with store.engine.begin() as conn:  # the database as schema version 14 left it
        table = store.engine.dialect.identifier_preparer.format_table(c)
        conn.exec_driver_sql(f"ALTER TABLE {table} DROP COLUMN changes")  # (version 16's)
        conn.exec_driver_sql(f"ALTER TABLE {table} DROP COLUMN last_start_at")
        conn.execute(t.version.delete().where(t.version.c.version > 14))
    assert store.schema_version() == 14

    assert store.migrate() == (14, SCHEMA_VERSION)
    assert schema_snapshot(store.engine, store.config.schema) == full
    assert {r.id: (r.state, r.attempt) for r in store.list_tasks(limit=100)} == before
    with store.engine.connect() as conn:
        rows = conn.execute(select(c.c.key, c.c.next_start_at, c.c.last_start_at)).all()
        paced_row = conn.execute(
            select(t.tasks.c.slot, t.tasks.c.eta).where(t.tasks.c.id == "paced")
        ).one()
    # the keys' next starts are kept; no last start is known from before the migration
    assert {r.key: (r.next_start_at, r.last_start_at) for r in rows} == {
        "k": (None, None),
        "r": (next_start, None),
    }
    assert tuple(paced_row) == ("paced", paced_eta)
    # the slot taken before the migration still counts; the waiting row still waits
    (usage,) = store.slot_usage()
    assert (usage.key, usage.limit, usage.running, usage.waiting) == ("k", 1, 1, 1)
    assert store.finish(running.lease, State.SUCCEEDED, actor="t", reason="ok")
    assert [p.id for p in store.grant([("t", "k")])] == ["waiting"]
    # the paced row, its start come, starts: on time, and takes no other start
    with store.engine.begin() as conn:
        conn.execute(
            update(t.tasks).where(t.tasks.c.id == "paced").values(eta=after(db_now(), -0.001))
        )
    assert isinstance(store.claim("paced", owner, "w", slot=rate), Claim)
    with store.engine.connect() as conn:
        last = conn.execute(select(c.c.last_start_at).where(c.c.key == "r")).scalar_one()
        assert conn.execute(select(c.c.next_start_at).where(c.c.key == "r")).scalar_one() == (
            next_start
        )
    assert last is not None  # its start is recorded


def test_a_version_15_database_gains_the_count_of_changes_and_keeps_its_slots(make_store):
    store = make_store(migrate=False)
    store.migrate()
    full = schema_snapshot(store.engine, store.config.schema)
    owner, slot, running = _rows_of_a_limited_key(store)
    before = {r.id: (r.state, r.attempt) for r in store.list_tasks(limit=100)}
    t = store.t
    c = t.concurrency
    with store.engine.begin() as conn:  # the database as schema version 15 left it
        table = store.engine.dialect.identifier_preparer.format_table(c)
        conn.exec_driver_sql(f"ALTER TABLE {table} DROP COLUMN changes")
        conn.execute(t.version.delete().where(t.version.c.version > 15))
    assert store.schema_version() == 15

    assert store.migrate() == (15, SCHEMA_VERSION)
    assert schema_snapshot(store.engine, store.config.schema) == full
    assert {r.id: (r.state, r.attempt) for r in store.list_tasks(limit=100)} == before
    with store.engine.connect() as conn:
        assert conn.execute(select(c.c.key, c.c.changes)).all() == [("k", 0)]
    # the slot taken before the migration still counts; the waiting row still waits
    (usage,) = store.slot_usage()
    assert (usage.key, usage.limit, usage.running, usage.waiting) == ("k", 1, 1, 1)
    assert store.finish(running.lease, State.SUCCEEDED, actor="t", reason="ok")
    assert [p.id for p in store.grant([("t", "k")])] == ["waiting"]
    # the key counts its changes from the migration on: the grant's, then the claim's
    with store.engine.connect() as conn:
        changes = conn.execute(select(c.c.changes)).scalar_one()
    assert changes > 0
    assert isinstance(store.claim("waiting", owner, "w", slot=slot), Claim)
    with store.engine.connect() as conn:
        assert conn.execute(select(c.c.changes)).scalar_one() == changes + 1


def test_a_version_11_database_gains_the_revision_column_and_keeps_its_rows(make_store):
    store = make_store(migrate=False)
    store.migrate()
    full = schema_snapshot(store.engine, store.config.schema)
    task = NewTask(
        id="old",
        name="t",
        args="[]",
        kwargs="{}",
        options=None,
        lease_ttl=30,
        max_recoveries=5,
        dedup_key="k",
    )
    store.submit(task)
    t = store.t
    with store.engine.begin() as conn:  # the database as schema version 11 left it
        _drop_revision(store, conn)
        conn.execute(t.version.delete().where(t.version.c.version > 11))
    assert store.schema_version() == 11

    assert store.migrate() == (11, SCHEMA_VERSION)
    assert schema_snapshot(store.engine, store.config.schema) == full
    assert store.submit(replace(task, id="new")) == ("old", False)


def test_a_version_5_database_gains_the_follow_ups_column_and_keeps_its_rows(make_store):
    store = make_store(migrate=False)
    store.migrate()
    full = schema_snapshot(store.engine, store.config.schema)
    task = NewTask(
        id="kept", name="t", args="[]", kwargs="{}", options=None, lease_ttl=30, max_recoveries=5
    )
    store.submit(task)
    t = store.t
    with store.engine.begin() as conn:  # the database as schema version 5 left it
        _drop_origin(store, conn)
        t.purged.drop(conn)
        drop_follow_ups(store, conn)
        conn.execute(t.version.delete().where(t.version.c.version >= 6))
    assert store.schema_version() == 5

    assert store.migrate() == (5, SCHEMA_VERSION)
    assert schema_snapshot(store.engine, store.config.schema) == full
    assert store.get("kept").state.value == "PENDING"
    # the new column works: an outcome with follow-ups records them until they are sent
    claim = store.claim("kept", "w", "worker:w")
    assert store.finish(claim.lease, State.SUCCEEDED, actor="t", reason="ok", follow_ups=True)
    with store.engine.connect() as conn:
        marked = conn.execute(select(t.tasks.c.follow_ups_at).where(t.tasks.c.id == "kept"))
        assert marked.scalar_one() is not None
    store.follow_ups_sent(["kept"])
    with store.engine.connect() as conn:
        marked = conn.execute(select(t.tasks.c.follow_ups_at).where(t.tasks.c.id == "kept"))
        assert marked.scalar_one() is None


def test_a_version_6_database_gains_the_purged_tombstones_and_keeps_its_rows(make_store):
    store = make_store(migrate=False)
    store.migrate()
    full = schema_snapshot(store.engine, store.config.schema)
    task = NewTask(
        id="old", name="t", args="[]", kwargs="{}", options=None, lease_ttl=30, max_recoveries=5
    )
    store.submit(task)
    t = store.t
    with store.engine.begin() as conn:  # the database as schema version 6 left it
        _drop_origin(store, conn)
        t.purged.drop(conn)
        conn.execute(t.version.delete().where(t.version.c.version >= 7))
    assert store.schema_version() == 6

    assert store.migrate() == (6, SCHEMA_VERSION)
    assert schema_snapshot(store.engine, store.config.schema) == full
    assert store.get("old") is not None and len(store.history("old")) == 1


def test_a_version_7_database_gains_the_origin_columns_and_keeps_its_rows(make_store):
    store = make_store(migrate=False)
    store.migrate()
    full = schema_snapshot(store.engine, store.config.schema)
    task = NewTask(
        id="old", name="t", args="[]", kwargs="{}", options=None, lease_ttl=30, max_recoveries=5
    )
    store.submit(task)
    t = store.t
    with store.engine.begin() as conn:  # the database as schema version 7 left it
        _drop_origin(store, conn)
        conn.execute(t.version.delete().where(t.version.c.version >= 8))
    assert store.schema_version() == 7

    assert store.migrate() == (7, SCHEMA_VERSION)
    assert schema_snapshot(store.engine, store.config.schema) == full
    assert store.get("old") is not None  # its origin unknown: every app may publish it


def _back_to_v8(store: Any, conn: Any) -> None:
    """The tasks table's indexes and storage as schema version 8 left them: an index on
    (name, state), a dedup index over every row, PostgreSQL's default fillfactor."""
    tasks = store.t.tasks
    preparer = store.engine.dialect.identifier_preparer
    table = preparer.format_table(tasks)

    def index(name: str) -> str:
        if tasks.schema is None:
            return preparer.quote(name)
        return f"{preparer.quote_schema(tasks.schema)}.{preparer.quote(name)}"

    dedup, by_name = f"{tasks.name}_dedup_key", f"{tasks.name}_name_state"
    conn.exec_driver_sql(f"DROP INDEX {index(dedup)}")
    conn.exec_driver_sql(f"CREATE UNIQUE INDEX {preparer.quote(dedup)} ON {table} (dedup_key)")
    conn.exec_driver_sql(f"CREATE INDEX {preparer.quote(by_name)} ON {table} (name, state)")
    if store.is_pg:
        conn.exec_driver_sql(f"ALTER TABLE {table} RESET (fillfactor)")
    conn.execute(store.t.version.delete().where(store.t.version.c.version >= 9))


def _rows(store: Any) -> dict[str, list[Any]]:
    t = store.t
    with store.engine.connect() as conn:
        return {
            "tasks": conn.execute(select(t.tasks).order_by(t.tasks.c.id)).all(),
            "steps": conn.execute(select(t.steps).order_by(t.steps.c.task_id)).all(),
            "audit": conn.execute(select(t.transitions).order_by(t.transitions.c.id)).all(),
        }


def test_a_version_8_database_narrows_its_indexes_and_keeps_every_row(make_store):
    store = make_store(migrate=False)
    store.migrate()
    full = schema_snapshot(store.engine, store.config.schema)
    t = store.t
    message = '{"v": 1, "headers": {"task": "t"}, "body": "[[1], {}, {}]"}'
    for state in State:  # a row in every state, with its message; steps and audit rows
        store.submit(
            NewTask(
                id=state.value.lower(),
                name="t",
                args="[1]",
                kwargs="{}",
                options="{}",
                message=message,
                dedup_key=f"key-{state.value}",
                lease_ttl=30,
                max_recoveries=5,
            )
        )
        with store.engine.begin() as conn:
            conn.execute(
                t.tasks.update()
                .where(t.tasks.c.id == state.value.lower())
                .values(
                    state=state.value,
                    attempt=0 if state is State.PENDING else 1,
                    token="a" * 32 if state is State.RUNNING else None,
                    reason=f"now {state.value}",
                )
            )
            if state is State.PENDING:
                continue
            # the audit rows of a legal path to the state, the step inside the lease
            path = [(State.PENDING, State.RUNNING)]
            if state is not State.RUNNING:
                path.append((State.RUNNING, state))
            for frm, to in path:
                conn.execute(
                    insert(t.transitions).values(
                        task_id=state.value.lower(),
                        from_state=frm.value,
                        to_state=to.value,
                        reason="set up",
                        actor="test",
                        attempt=1,
                        at=db_now(),
                    )
                )
                if to is State.RUNNING:
                    conn.execute(
                        insert(t.steps).values(
                            task_id=state.value.lower(),
                            name="charge",
                            state="DONE",
                            idempotent=True,
                            attempt=1,
                            result="1",
                            started_at=db_now(),
                        )
                    )
    with store.engine.begin() as conn:  # the database as schema version 8 left it
        _back_to_v8(store, conn)
    assert store.schema_version() == 8
    before = _rows(store)

    assert store.migrate() == (8, SCHEMA_VERSION)
    assert schema_snapshot(store.engine, store.config.schema) == full
    assert _rows(store) == before  # every row, step and audit row kept as it was
    if store.is_pg:
        with store.engine.connect() as conn:
            options = conn.exec_driver_sql(
                "SELECT array_to_string(reloptions, ',') FROM pg_class WHERE oid = to_regclass(%s)",
                (store.engine.dialect.identifier_preparer.format_table(t.tasks),),
            ).scalar_one()
        assert options == f"fillfactor={TASKS_FILLFACTOR}"

    for state in State:  # each can be shown
        record = store.get(state.value.lower())
        assert record is not None and record.state is state and record.message == message
    # the dedup keys still hold: a second submission with one gets the existing row
    again = NewTask(
        id="other",
        name="t",
        args="[]",
        kwargs="{}",
        options=None,
        lease_ttl=30,
        max_recoveries=5,
        dedup_key="key-RUNNING",
    )
    assert store.submit(again) == ("running", False)
    for state in (State.FAILED, State.TIMEOUT, State.WAIT_MANUAL):  # retried, published
        assert (
            store.operator_move(state.value.lower(), State.PENDING, actor="op", reason="r") is state
        )
    ids = [s.value.lower() for s in (State.PENDING, State.FAILED, State.TIMEOUT, State.WAIT_MANUAL)]
    published = {p.id: p.message for p in store.take_pending(ids)}
    assert published == dict.fromkeys(ids, message)


def test_a_version_10_database_gains_the_held_column_and_keeps_its_rows(make_store):
    store = make_store(migrate=False)
    store.migrate()
    full = schema_snapshot(store.engine, store.config.schema)
    store.submit(
        NewTask(
            id="old", name="t", args="[]", kwargs="{}", options=None, lease_ttl=30, max_recoveries=5
        )
    )
    t = store.t
    with store.engine.begin() as conn:  # the database as schema version 10 left it
        _drop_revision(store, conn)
        _drop_held(store, conn)
        conn.execute(t.version.delete().where(t.version.c.version >= 11))
    assert store.schema_version() == 10

    assert store.migrate() == (10, SCHEMA_VERSION)
    assert schema_snapshot(store.engine, store.config.schema) == full
    assert store.get("old") is not None
    with store.engine.connect() as conn:  # the rows written before are not held
        held = conn.execute(select(t.tasks.c.held).where(t.tasks.c.id == "old"))
        assert held.scalar_one() is False
    assert store.held() == []


def test_migrate_is_idempotent(make_store):
    store = make_store(migrate=False)
    store.migrate()
    before = schema_snapshot(store.engine, store.config.schema)
    assert store.migrate() == (SCHEMA_VERSION, SCHEMA_VERSION)
    assert make_store(migrate=False).migrate() == (SCHEMA_VERSION, SCHEMA_VERSION)
    assert schema_snapshot(store.engine, store.config.schema) == before
    assert store.schema_version() == SCHEMA_VERSION
    version = store.t.version
    with store.engine.connect() as conn:
        rows = conn.execute(select(version.c.version, version.c.description)).all()
    assert [r.version for r in rows] == [m.version for m in MIGRATIONS]
    assert all(r.description for r in rows)


def test_migrate_keeps_existing_rows(make_store):
    store = make_store()
    task = NewTask(
        id="kept", name="t", args="[]", kwargs="{}", options="{}", lease_ttl=1.0, max_recoveries=1
    )
    store.submit(task)
    store.migrate()
    assert store.get("kept") is not None


def test_concurrent_migrations_apply_each_step_once(make_store, lease_config, request):
    store = make_store(migrate=False)
    ctx = multiprocessing.get_context("spawn")
    n = 3
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [
        ctx.Process(target=migrate_in_process, args=(store.config, barrier, results))
        for _ in range(n)
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=90) for _ in procs]
    for p in procs:
        p.join(30)
    results.close()
    results.join_thread()
    assert all(p.exitcode == 0 for p in procs), outcomes
    assert sorted(outcomes, key=repr) == sorted(
        [(None, SCHEMA_VERSION)] + [(SCHEMA_VERSION, SCHEMA_VERSION)] * (n - 1), key=repr
    )
    with store.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(store.t.version)).scalar_one() == len(
            MIGRATIONS
        )


@pytest.mark.postgres
@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_migration_is_not_bounded_by_the_store_call_timeout(make_store):
    # another migrator holds the migration lock for three times lease_db_timeout: the
    # waiting migration neither gives up at the call deadline nor at the session's
    # lock_timeout, and applies every step once the lock is free
    store = make_store(migrate=False, db_timeout=0.5)
    holder = _engine(store.config.database_url)
    started = threading.Event()

    def hold() -> None:
        with holder.begin() as conn:
            conn.exec_driver_sql("SELECT pg_advisory_xact_lock(hashtext('celery_lease.migrate'))")
            started.set()
            conn.exec_driver_sql("SELECT pg_sleep(1.5)")

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert started.wait(30)
        assert store.migrate() == (None, SCHEMA_VERSION)
    finally:
        thread.join()
        holder.dispose()
    assert store.schema_version() == SCHEMA_VERSION


def test_table_prefixes_keep_apps_apart(make_store):
    a = make_store(table_prefix="app_a_")
    b = make_store(table_prefix="app_b_")
    task = NewTask(
        id="same-id",
        name="t",
        args="[]",
        kwargs="{}",
        options="{}",
        lease_ttl=1.0,
        max_recoveries=1,
    )
    assert a.submit(task) == ("same-id", True)
    assert b.submit(task) == ("same-id", True)
    assert b.get("same-id") is not None
    names = inspect(a.engine).get_table_names(schema=a.config.schema)
    assert {"app_a_tasks", "app_b_tasks"} <= set(names)


@pytest.mark.postgres
@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_ensure_schema_on_postgresql_without_tables_refuses(make_store):
    store = make_store(migrate=False)
    with pytest.raises(SchemaOutOfDate) as info:
        store.ensure_schema()
    assert isinstance(info.value, StoreError)
    assert info.value.current is None and info.value.expected == SCHEMA_VERSION
    assert "migrate" in str(info.value)
    assert store.schema_version() is None  # nothing was created
    assert inspect(store.engine).get_table_names(schema=store.config.schema) == []

    make_store(migrate=False, auto_migrate=True).ensure_schema()
    assert store.schema_version() == SCHEMA_VERSION


@pytest.mark.postgres
@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_ensure_schema_argument_overrides_the_setting(make_store):
    store = make_store(migrate=False, auto_migrate=False)
    store.ensure_schema(auto_migrate=True)
    assert store.schema_version() == SCHEMA_VERSION


@pytest.mark.postgres
@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_schema_error_does_not_show_the_password(make_store, lease_config):
    with_password = (
        make_url(lease_config.url).set(password="s3cret-pw").render_as_string(hide_password=False)
    )
    store = make_store(migrate=False, database_url=with_password)
    with pytest.raises(SchemaOutOfDate) as info:
        store.ensure_schema()
    assert "s3cret-pw" not in str(info.value)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_ensure_schema_creates_sqlite_tables(make_store):
    store = make_store(migrate=False, auto_migrate=False)
    store.ensure_schema()
    assert store.schema_version() == SCHEMA_VERSION


def test_a_newer_schema_is_refused_even_with_auto_migrate(make_store):
    store = make_store()
    with store.engine.begin() as conn:
        conn.execute(
            insert(store.t.version).values(
                version=SCHEMA_VERSION + 1, description="future", applied_at=db_now()
            )
        )
    fresh = make_store(migrate=False, auto_migrate=True)
    with pytest.raises(SchemaOutOfDate) as info:
        fresh.ensure_schema()
    assert info.value.current == SCHEMA_VERSION + 1
    # the code is older than the store: migrating cannot help, and it says which is needed
    message = str(info.value)
    assert "older than the store" in message and f"version {SCHEMA_VERSION + 1}" in message
    assert "lease migrate" not in message
    with pytest.raises(SchemaOutOfDate, match="older than the store"):
        fresh.migrate()
