"""The lease tables, defined once (SQLAlchemy Core), and the dialect-aware SQL they are
written in: database time, interval arithmetic, GREATEST.

``build(prefix, schema)`` returns the tables for one table prefix and schema;
the migration steps create exactly these, and a test checks that they agree.

Timestamps are ``timestamptz`` on PostgreSQL and REAL epoch seconds on SQLite
(SQLite has no time type, and sub-second precision matters for short leases).
Python sees timezone-aware UTC datetimes on both. Every "now" in a decision is
:class:`db_now`, evaluated by the database, never a worker's clock.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    and_,
    case,
    false,
    func,
    literal,
    or_,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import ColumnElement, FunctionElement
from sqlalchemy.types import TypeDecorator, TypeEngine

from ..config import MAX_SECONDS

# -- dialect SQL ----------------------------------------------------------------------------


class DbTime(TypeDecorator[datetime]):
    """A point in time: ``timestamptz`` on PostgreSQL, epoch seconds (REAL) on SQLite."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "sqlite":
            return dialect.type_descriptor(Float())
        return dialect.type_descriptor(DateTime(timezone=True))

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> Any:
        if value is None:
            return None
        if dialect.name == "sqlite":
            return value.timestamp()
        return value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if dialect.name == "sqlite":
            return datetime.fromtimestamp(float(value), timezone.utc)
        if isinstance(value, datetime) and value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        # the driver's value for a timestamptz column: an aware datetime
        return cast("datetime | None", value)


class db_now(FunctionElement[datetime]):
    """The database's current time."""

    type = DbTime()
    inherit_cache = True


@compiles(db_now)
def _now_default(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return "CURRENT_TIMESTAMP"


@compiles(db_now, "postgresql")
def _now_pg(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    # statement time, not transaction start: a long sweep transaction must not age its "now"
    return "statement_timestamp()"


@compiles(db_now, "sqlite")
def _now_sqlite(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    # julianday('now') is stable within one statement and has millisecond precision
    return "((julianday('now') - 2440587.5) * 86400.0)"


class after(FunctionElement[datetime]):
    """``ts + seconds``: a time plus a (possibly fractional, possibly column) number of seconds."""

    type = DbTime()
    inherit_cache = True

    def __init__(self, ts: ColumnElement[Any], seconds: ColumnElement[Any] | float) -> None:
        super().__init__(ts, seconds)


@compiles(after)
def _after_default(element: after, compiler: SQLCompiler, **kw: Any) -> str:
    ts, seconds = list(element.clauses)
    return f"({compiler.process(ts, **kw)} + {compiler.process(seconds, **kw)})"


@compiles(after, "postgresql")
def _after_pg(element: after, compiler: SQLCompiler, **kw: Any) -> str:
    ts, seconds = list(element.clauses)
    # clamped to the longest duration a setting or option may take: a row written
    # unchecked (an older version, a hand edit) with 1e300, Infinity or NaN seconds
    # would otherwise fail the whole statement ("interval out of range") and stop the
    # sweep for every row (PostgreSQL orders NaN above every number: it clamps high)
    return (
        f"({compiler.process(ts, **kw)} + GREATEST(LEAST("
        f"CAST({compiler.process(seconds, **kw)} AS DOUBLE PRECISION), {MAX_SECONDS!r}), "
        f"{-MAX_SECONDS!r}) * INTERVAL '1 second')"
    )


class seconds_between(FunctionElement[float]):
    """``later - earlier`` in seconds (float)."""

    type = Float()
    inherit_cache = True

    def __init__(self, later: ColumnElement[Any], earlier: ColumnElement[Any]) -> None:
        super().__init__(later, earlier)


@compiles(seconds_between)
def _between_default(element: seconds_between, compiler: SQLCompiler, **kw: Any) -> str:
    later, earlier = list(element.clauses)
    return f"({compiler.process(later, **kw)} - {compiler.process(earlier, **kw)})"


@compiles(seconds_between, "postgresql")
def _between_pg(element: seconds_between, compiler: SQLCompiler, **kw: Any) -> str:
    later, earlier = list(element.clauses)
    return (
        f"EXTRACT(EPOCH FROM ({compiler.process(later, **kw)} - "
        f"{compiler.process(earlier, **kw)}))::double precision"
    )


class greatest(FunctionElement[Any]):
    """The larger of two values (``GREATEST`` on PostgreSQL, scalar ``max`` on SQLite)."""

    inherit_cache = True

    def __init__(self, a: ColumnElement[Any], b: ColumnElement[Any]) -> None:
        super().__init__(a, b)
        self.type = a.type


@compiles(greatest)
def _greatest_default(element: greatest, compiler: SQLCompiler, **kw: Any) -> str:
    a, b = list(element.clauses)
    return f"GREATEST({compiler.process(a, **kw)}, {compiler.process(b, **kw)})"


@compiles(greatest, "sqlite")
def _greatest_sqlite(element: greatest, compiler: SQLCompiler, **kw: Any) -> str:
    a, b = list(element.clauses)
    return f"max({compiler.process(a, **kw)}, {compiler.process(b, **kw)})"


# -- the tables -----------------------------------------------------------------------------

#: The schema version these definitions describe; migrations bring a database here.
SCHEMA_VERSION = 16

#: PostgreSQL's fillfactor of the tasks table (schema version 9): part of each page is
#: left free when rows are inserted, so that the updates of a task's lifecycle (the
#: "published" mark, the claim, the outcome) mostly put the row's new version on the
#: same page as the old one, where PostgreSQL writes to the WAL only the bytes that
#: changed, not the message and arguments again. Measured (``benchmarks/wal_breakdown.py``,
#: docs/benchmarks.md): 50 wrote less WAL in batches but left one row per page when rows
#: came one by one; 85 and 100 wrote more.
TASKS_FILLFACTOR = 70

#: The states retention deletes, written out as SQL so that a query naming them in the
#: same words can use the partial index on ``finished_at`` whatever plan it gets.
FINISHED_SQL = "state IN ('SUCCEEDED', 'FAILED', 'CANCELLED')"

#: The held rows (schema version 11), in the words each database's planner matches
#: against a query's ``held = true`` (PostgreSQL simplifies it to ``held``; SQLite
#: stores a boolean as 1 and matches the term as written).
HELD_SQL = {"postgresql": "held", "sqlite": "held = 1"}

#: The RUNNING rows of limited tasks (schema version 13): the slots in use.
SLOT_RUNNING_SQL = "slot_key IS NOT NULL AND state = 'RUNNING'"

_ID = String(255)


@dataclasses.dataclass(frozen=True)
class Tables:
    """The lease tables of one prefix/schema."""

    metadata: MetaData
    tasks: Table
    transitions: Table
    steps: Table
    workers: Table
    locks: Table
    version: Table
    counters: Table
    pauses: Table
    pause_log: Table
    transition_totals: Table
    transition_watermark: Table
    purged: Table
    schedules: Table
    beats: Table
    concurrency: Table


def build(prefix: str = "lease_", schema: str | None = None, origin: str | None = None) -> Tables:
    """Define the tables with ``prefix`` in ``schema`` (``None``: default schema);
    ``origin`` (the app's broker, see :func:`celery_lease.config.broker_origin`) is what
    every task and worker row this store inserts records."""
    md = MetaData(schema=schema)
    running = text("state = 'RUNNING'")
    tasks = Table(
        f"{prefix}tasks",
        md,
        Column("id", _ID, primary_key=True),
        Column("name", String(255), nullable=False),
        Column("state", String(16), nullable=False),
        # attempt counts claims; token names one execution and fences its writes
        Column("attempt", Integer, nullable=False, server_default="0"),
        Column("token", String(32)),
        Column("owner", String(64)),
        Column("recoveries", Integer, nullable=False, server_default="0"),
        Column("retries", Integer, nullable=False, server_default="0"),
        Column("dedup_key", String(255)),
        Column("args", Text),
        Column("kwargs", Text),
        Column("options", Text),
        Column("eta", DbTime()),
        Column("lease_ttl", Float, nullable=False),
        Column("max_runtime", Float),
        Column("max_retries", Integer),
        Column("on_timeout", String(8), nullable=False, server_default="retry"),
        Column("on_exhausted", String(8), nullable=False, server_default="fail"),
        Column("max_recoveries", Integer, nullable=False),
        Column("created_at", DbTime(), nullable=False),
        Column("updated_at", DbTime(), nullable=False),
        Column("published_at", DbTime()),
        Column("publish_count", Integer, nullable=False, server_default="0"),
        Column("started_at", DbTime()),
        Column("progress_at", DbTime()),
        Column("finished_at", DbTime()),
        Column("next_retry_at", DbTime()),
        Column("result", Text),
        Column("error", Text),
        Column("reason", Text),
        Column("progress", Text),
        Column("cancel_requested_at", DbTime()),
        Column("cancel_actor", String(255)),
        Column("cancel_reason", Text),
        # the message Celery built for the task (JSON: headers, properties, body):
        # every publication sends it, so chains, callbacks and limits survive. Last, as
        # the migration that added it left it
        Column("message", Text),
        # a SUCCEEDED row's follow-ups (chain, link callbacks, chord part-return) were
        # recorded with its outcome and are not yet published: since when (or since a
        # reaper last took them). NULL: none, or all published
        Column("follow_ups_at", DbTime()),
        # the broker the row's app publishes to (URL without password): a reaper only
        # publishes its own broker's rows (apps on other brokers may share the store)
        Column("origin", String(255), default=origin),
        # a PENDING row whose ETA was far away when it was submitted, written and not
        # published: the reaper publishes it when its ETA is due (schema version 11)
        Column("held", Boolean, nullable=False, server_default=false()),
        # a PENDING row whose arguments a later submission replaced (``on_conflict=
        # "replace"``): the revision its current message carries in a header; a claim by
        # a message without it (sent before the replacement) is refused, and the claim
        # clears it. NULL on every other row (schema version 12)
        Column("revision", String(32)),
        # a task with a concurrency limit (schema version 13): the key its last claim
        # counted it under (``""``: the task's one global limit), and where it stands
        # for a slot while PENDING: ``waiting`` (its delivery found none: acked, not in
        # the broker, published when one frees) or ``granted`` (a slot freed and is kept
        # for it: published, not claimed yet); with a global_rate_limit (version 14),
        # ``paced`` (its delivery came before the key's next start: a later start was
        # reserved for it, its ETA). NULL on every row of an unlimited task
        Column("slot_key", String(255)),
        Column("slot", String(8)),
        # only the rows that have a dedup key (most have none): a row without one adds
        # no entry at its insert, nor at each of its updates (schema version 9)
        Index(
            f"{prefix}tasks_dedup_key",
            "dedup_key",
            unique=True,
            postgresql_where=text("dedup_key IS NOT NULL"),
            sqlite_where=text("dedup_key IS NOT NULL"),
        ),
        # the live counts (metrics), the backlog and ``lease list --state``; there is no
        # index on (name, state) since version 9: only listings by name read it, and it
        # cost every state change an index entry
        Index(f"{prefix}tasks_state_created", "state", "created_at"),
        # partial indexes: the reaper only ever scans these small subsets
        Index(
            f"{prefix}tasks_running_owner",
            "owner",
            postgresql_where=running,
            sqlite_where=running,
        ),
        Index(
            f"{prefix}tasks_retry_due",
            "next_retry_at",
            postgresql_where=text("state = 'RETRY_WAIT'"),
            sqlite_where=text("state = 'RETRY_WAIT'"),
        ),
        Index(
            f"{prefix}tasks_pending_published",
            "published_at",
            postgresql_where=text("state = 'PENDING'"),
            sqlite_where=text("state = 'PENDING'"),
        ),
        # the reaper's sweep of follow-ups recorded and not published
        Index(
            f"{prefix}tasks_follow_ups",
            "follow_ups_at",
            postgresql_where=text("follow_ups_at IS NOT NULL"),
            sqlite_where=text("follow_ups_at IS NOT NULL"),
        ),
        # the reaper's sweep of held rows, by ETA: only the held rows have an entry, so
        # the sweep reads the rows that are due and no other
        Index(
            f"{prefix}tasks_held_eta",
            "eta",
            postgresql_where=text(HELD_SQL["postgresql"]),
            sqlite_where=text(HELD_SQL["sqlite"]),
        ),
        # a limited task's slots in use: its RUNNING rows, counted by a claim under the
        # key's lock (rows of unlimited tasks have no entry)
        Index(
            f"{prefix}tasks_slot_running",
            "name",
            "slot_key",
            postgresql_where=text(SLOT_RUNNING_SQL),
            sqlite_where=text(SLOT_RUNNING_SQL),
        ),
        # a limited task's rows waiting for a slot, or granted one, in submission order
        Index(
            f"{prefix}tasks_slot_queue",
            "name",
            "slot_key",
            "slot",
            "created_at",
            postgresql_where=text("slot IS NOT NULL"),
            sqlite_where=text("slot IS NOT NULL"),
        ),
        # retention and the health figures read finished rows by finish time; name and
        # state let the per-task counts of a window be read from the index alone
        Index(
            f"{prefix}tasks_finished",
            "finished_at",
            "name",
            "state",
            postgresql_where=text(FINISHED_SQL),
            sqlite_where=text(FINISHED_SQL),
        ),
    )
    transitions = Table(
        f"{prefix}transitions",
        md,
        Column(
            "id",
            BigInteger().with_variant(Integer, "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        Column("task_id", _ID, nullable=False),
        Column("from_state", String(16)),
        Column("to_state", String(16), nullable=False),
        Column("reason", Text),
        Column("actor", String(255), nullable=False),
        Column("attempt", Integer, nullable=False),
        Column("at", DbTime(), nullable=False),
        Index(f"{prefix}transitions_task", "task_id", "id"),
        # SQLite: ids never reused, even after the highest row is deleted (the
        # transition totals' watermark relies on every new row getting a higher id)
        sqlite_autoincrement=True,
    )
    steps = Table(
        f"{prefix}steps",
        md,
        Column("task_id", _ID, primary_key=True),
        Column("name", String(255), primary_key=True),
        Column("state", String(16), nullable=False),
        Column("idempotent", Boolean, nullable=False),
        # a check= callable can tell whether a started call happened: safe to retry
        Column("checkable", Boolean, nullable=False, server_default=false()),
        Column("attempt", Integer, nullable=False),
        Column("result", Text),
        Column("started_at", DbTime(), nullable=False),
        Column("finished_at", DbTime()),
    )
    workers = Table(
        f"{prefix}workers",
        md,
        Column("id", String(64), primary_key=True),
        Column("nodename", String(255), nullable=False),
        Column("hostname", String(255), nullable=False),
        Column("pid", Integer, nullable=False),
        Column("started_at", DbTime(), nullable=False),
        Column("heartbeat_at", DbTime(), nullable=False),
        Column("stopped_at", DbTime()),
        Column("stop_reason", Text),
        Column("origin", String(255), default=origin),
        Index(f"{prefix}workers_nodename", "nodename"),
    )
    locks = Table(
        f"{prefix}locks",
        md,
        Column("name", String(64), primary_key=True),
        Column("holder", String(64)),
        Column("expires_at", DbTime()),
    )
    version = Table(
        f"{prefix}schema_version",
        md,
        Column("version", Integer, primary_key=True),
        Column("applied_at", DbTime(), nullable=False),
        Column("description", Text, nullable=False),
    )
    # monotonic totals of events that leave no row behind (rows purged, duplicate
    # deliveries dropped, messages re-published): read by the metrics at scrape time
    counters = Table(
        f"{prefix}counters",
        md,
        Column("name", String(64), primary_key=True),
        Column("value", BigInteger().with_variant(Integer, "sqlite"), nullable=False),
        Column("updated_at", DbTime(), nullable=False),
    )
    # durable pauses: a row per paused queue or task name, while it is paused
    pauses = Table(
        f"{prefix}pauses",
        md,
        Column("kind", String(8), primary_key=True),  # "queue" or "task"
        Column("target", String(255), primary_key=True),
        Column("actor", String(255), nullable=False),
        Column("reason", Text, nullable=False),
        Column("paused_at", DbTime(), nullable=False),
    )
    # every pause and resume, with who and why (the pauses' audit trail)
    pause_log = Table(
        f"{prefix}pause_log",
        md,
        Column(
            "id",
            BigInteger().with_variant(Integer, "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        Column("kind", String(8), nullable=False),
        Column("target", String(255), nullable=False),
        Column("action", String(8), nullable=False),  # "pause" or "resume"
        Column("actor", String(255), nullable=False),
        Column("reason", Text, nullable=False),
        Column("at", DbTime(), nullable=False),
        Index(f"{prefix}pause_log_target", "kind", "target", "id"),
    )
    # the audit table's transitions counted: the reaper folds settled audit rows in
    # bounded id ranges into these totals, so a scrape reads a handful of rows plus the
    # audit rows above the watermark (a task's creation has from_state '')
    transition_totals = Table(
        f"{prefix}transition_totals",
        md,
        Column("from_state", String(16), primary_key=True),
        Column("to_state", String(16), primary_key=True),
        Column("total", BigInteger().with_variant(Integer, "sqlite"), nullable=False),
    )
    # one row (id 1): every audit row with an id up to ``upto`` is in the totals, and
    # none above it (except those deleted, which were added when they were deleted)
    transition_watermark = Table(
        f"{prefix}transition_watermark",
        md,
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("upto", BigInteger().with_variant(Integer, "sqlite"), nullable=False),
        Column("folded_at", DbTime()),
    )
    # tombstones of purged rows: a message that arrives after its row was deleted (a
    # cancelled task's queued countdown, a redelivery) must not be adopted as a new
    # task; each is kept until no message of it is expected any more, then deleted
    purged = Table(
        f"{prefix}purged",
        md,
        Column("id", _ID, primary_key=True),
        Column("purged_at", DbTime(), nullable=False),
        Column("keep_until", DbTime(), nullable=False),
        Index(f"{prefix}purged_keep_until", "keep_until"),
    )
    # one row per (task name, concurrency key) ever claimed with a limit: its lock (a
    # claim, a grant take it, so a slot is counted and taken by one at a time) and the
    # limit the last claim's code gave (schema version 13)
    concurrency = Table(
        f"{prefix}concurrency",
        md,
        Column("name", _ID, primary_key=True),
        Column("key", String(255), primary_key=True),
        Column("max_slots", Integer, nullable=False),
        # the last time a waiting row was granted a slot: the keys take turns
        Column("served_at", DbTime()),
        Column("updated_at", DbTime(), nullable=False),
        # global_rate_limit: the earliest start not yet given out (schema version 14);
        # each start, or a start reserved for a paced row, moves it one interval on
        Column("next_start_at", DbTime()),
        # global_rate_limit: the last start taken (schema version 15); a paced row late
        # for its reserved start takes it only when none was taken within an interval
        Column("last_start_at", DbTime()),
        # the key's changes (schema version 16): every claim, grant and waiting mark of
        # the key adds one under its lock, so a claim or a free made in one statement
        # can tell whether another changed the key between its snapshot and its lock
        # (see store._slots)
        Column("changes", BigInteger, nullable=False, server_default=text("0")),
    )
    schedules, beats = _schedule_tables(md, prefix)
    return Tables(
        md,
        tasks,
        transitions,
        steps,
        workers,
        locks,
        version,
        counters,
        pauses,
        pause_log,
        transition_totals,
        transition_watermark,
        purged,
        schedules,
        beats,
        concurrency,
    )


def _schedule_tables(md: MetaData, prefix: str) -> tuple[Table, Table]:
    """The beat's tables (schema version 10, :mod:`celery_lease.beat`)."""
    count = BigInteger().with_variant(Integer, "sqlite")
    # one row per periodic entry of a leased task: the slots up to ``last_slot`` are
    # decided (run, skipped or missed); a beat decides the next ones with the row locked
    schedules = Table(
        f"{prefix}schedules",
        md,
        Column("name", _ID, primary_key=True),
        Column("task", _ID, nullable=False),
        Column("last_slot", DbTime(), nullable=False),
        Column("last_run_slot", DbTime()),
        Column("last_task_id", _ID),
        # overlap "buffer_one": the slot waiting for the previous run to finish
        Column("buffered_slot", DbTime()),
        Column("missed", count, nullable=False),
        Column("skipped", count, nullable=False),
        Column("last_reason", Text),
        Column("updated_at", DbTime(), nullable=False),
        Column("updated_by", String(255)),
    )
    # the beat processes seen: one row per beat process (a fresh id per start)
    beats = Table(
        f"{prefix}beats",
        md,
        Column("id", String(64), primary_key=True),
        Column("host", String(255), nullable=False),
        Column("pid", Integer, nullable=False),
        Column("started_at", DbTime(), nullable=False),
        Column("seen_at", DbTime(), nullable=False),
        Index(f"{prefix}beats_seen", "seen_at"),
    )
    return schedules, beats


# -- conditions several operations share (each written once) ----------------------------


def lease_expired(tables: Tables) -> ColumnElement[bool]:
    """A RUNNING row's lease has expired: its owner is unknown, stopped, or silent for
    longer than the row's TTL (the row joined to its owner's worker row)."""
    t, w = tables.tasks, tables.workers
    return or_(
        w.c.id.is_(None),
        w.c.stopped_at.is_not(None),
        after(w.c.heartbeat_at, t.c.lease_ttl) < db_now(),
    )


def published_by(tables: Tables, origin: str | None) -> ColumnElement[bool]:
    """A row the app of broker ``origin`` may publish: one of its own broker, or one that
    records none (written before rows recorded it, or by an app whose broker is
    unknown). Another app's row goes to that app's broker, by that app's reaper."""
    t = tables.tasks
    if origin is None:
        return t.c.origin.is_(None)
    return or_(t.c.origin.is_(None), t.c.origin == origin)


def never_published(tables: Tables, grace: float) -> ColumnElement[bool]:
    """A PENDING row, not held, never marked published within ``grace`` seconds (the
    reaper's ``lease_publish_grace``, plus the checker's slack)."""
    t = tables.tasks
    return and_(
        t.c.published_at.is_(None),
        after(t.c.updated_at, grace) < db_now(),
        # a held row is published by the held sweep when due, not after the grace
        t.c.held == false(),
        not_waiting(tables),
    )


def not_waiting(tables: Tables) -> ColumnElement[bool]:
    """Not a row waiting for a concurrency slot: its message was delivered and acked on
    purpose, and it is published when a slot is granted to it, not when it looks lost."""
    t = tables.tasks
    return or_(t.c.slot.is_(None), t.c.slot != "waiting")


def message_lost(tables: Tables, republish_after: float, slack: float = 0.0) -> ColumnElement[bool]:
    """A PENDING row published but not claimed within ``republish_after`` seconds,
    doubled per publish and capped at 64 times (plus ``slack`` seconds, the checker's):
    a long backlog, which looks like a lost message, is duplicated a few times, not
    flooded."""
    t = tables.tasks
    backoff = case(
        (t.c.publish_count <= 1, literal(1)),
        (t.c.publish_count >= 7, literal(64)),
        else_=literal(1).op("<<")(t.c.publish_count - 1),
    )
    return and_(
        t.c.published_at.is_not(None),
        not_waiting(tables),
        after(
            greatest(func.coalesce(t.c.eta, t.c.published_at), t.c.published_at),
            literal(republish_after) * backoff + slack,
        )
        < db_now(),
    )
