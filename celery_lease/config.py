"""All ``lease_*`` settings, read from ``app.conf`` and validated once.

Settings are lowercase keys on the Celery configuration, so with Django's
``namespace="CELERY"`` they are written ``CELERY_LEASE_DATABASE_URL`` and so on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import warnings
from typing import Any, ClassVar
from urllib.parse import parse_qsl, quote, quote_plus, unquote

from .exceptions import CeleryLeaseDeprecationWarning, ConfigurationError

#: The store when ``lease_database_url`` is not set: a SQLite file in the directory the
#: process was started in (as Celery's own ``celerybeat-schedule``), resolved to an
#: absolute path once, when the settings are read (see :func:`resolve_database_url`).
DEFAULT_DATABASE_URL = "sqlite:///celery-lease.sqlite3"


#: The ``dialect+driver`` part of a database URL.
_SCHEME = re.compile(r"[\w+]+")


def resolve_database_url(url: str) -> str:
    """``url`` with a relative SQLite path made absolute against the current directory.

    Resolved once, when the settings are read: a process that changes directory later
    (a daemonized worker does) keeps the file it started with, and the absolute path is
    what the worker prints and what ``celery lease check`` compares. Other URLs, and
    URLs that do not parse (reported when the store is created), are returned as given.
    """
    if not url.startswith("sqlite"):
        return url
    # dialect+driver://[authority]/database[?query]: only the database part changes
    scheme, sep, rest = url.partition("://")
    authority, slash, tail = rest.partition("/")
    if not sep or not slash or "?" in authority or not _SCHEME.fullmatch(scheme):
        return url
    raw, _, query = tail.partition("?")
    database = unquote(raw)
    if not database or database == ":memory:" or database.startswith("file:"):
        return url
    path = os.path.expanduser(database)
    if os.path.isabs(path) and path == database:
        return url
    absolute = quote(os.path.abspath(path), safe=" +/")
    # the query as the store's URL parser renders it back: keys sorted, blanks dropped
    pairs = sorted(parse_qsl(query), key=lambda pair: pair[0])
    query = "&".join(f"{quote_plus(key)}={quote_plus(value)}" for key, value in pairs)
    return f"{scheme}://{authority}/{absolute}{'?' if query else ''}{query}"


def sqlite_file(url: str) -> str | None:
    """The file a SQLite ``url`` names (``None``: not SQLite, or not a plain file)."""
    if not url.startswith("sqlite"):
        return None
    _, sep, rest = url.partition("://")
    authority, slash, tail = rest.partition("/")
    if not sep or not slash or "?" in authority:
        return None
    database = unquote(tail.partition("?")[0])
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return os.path.expanduser(database)


def database_url_origin(conf: Any) -> str:
    """How ``lease_database_url`` was chosen for ``conf`` (as :func:`from_mapping` does),
    in words for a message: the setting, the environment, or the default file."""
    try:
        given = conf.get("lease_database_url")
    except (KeyError, AttributeError):
        given = None
    if given:
        return "set by lease_database_url"
    if os.environ.get("CELERY_LEASE_DATABASE_URL"):
        return "set by the CELERY_LEASE_DATABASE_URL environment variable"
    return (
        "lease_database_url is not set: the default is celery-lease.sqlite3 in the "
        f"directory the command runs in ({os.getcwd()})"
    )


#: Default ``lease_retention``: finished rows are kept a week.
DEFAULT_RETENTION = 7 * 86400.0

#: Longest duration any setting or task option may take: ten years. Every database's
#: interval arithmetic and every timer of the standard library holds it, so no stored
#: value can make a sweep's statement fail (PostgreSQL refuses ``1e300 seconds`` as an
#: interval, for every row of the statement). The store also clamps to it, for rows an
#: older version wrote unchecked.
MAX_SECONDS = 10 * 365 * 86400.0
#: Longest of the database waits (``lease_db_timeout`` and the connect timeout and SQLite
#: lock wait derived from it): a day. Drivers take them as 32-bit milliseconds.
MAX_DB_WAIT = 86400.0


def check_seconds(
    name: str, value: Any, *, zero: bool = False, maximum: float = MAX_SECONDS
) -> float:
    """``value`` as a number of seconds, or :class:`ConfigurationError` naming ``name``.

    A duration is a finite number, more than 0 (or at least 0 with ``zero``) and at
    most ``maximum``: ``inf``, ``nan``, ``1e300``, negatives and text that is not a
    number are refused where they are given, never met later by a sweep.
    """
    lowest = "at least 0" if zero else "more than 0"
    wanted = f"a number of seconds, {lowest} and at most {maximum:g}"
    if isinstance(value, bool):
        raise ConfigurationError(f"{name} must be {wanted}, got {value!r}")
    try:
        seconds = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigurationError(f"{name} must be {wanted}, got {value!r}") from None
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not zero):
        raise ConfigurationError(f"{name} must be {wanted}, got {value!r}")
    if seconds > maximum:
        raise ConfigurationError(f"{name} must be {wanted}, got {value!r}")
    return seconds


#: Environment variable through which the project's tests (and only they) change the
#: internal sizes and waits of :class:`Tuning` in every process of a test, worker
#: subprocesses included: ``"reaper_batch_size=2,claim_interval=0.3"``. Not a setting:
#: no compatibility is promised for it.
TUNING_ENV = "CELERY_LEASE_TUNING"


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The internal sizes and waits: constants, or derived from the settings a user
    sets. None is a setting: each is read as an attribute of :class:`LeaseConfig`."""

    #: Rows handled per reaper batch (each batch one short transaction, at most 20 a sweep).
    reaper_batch_size: int = 100
    #: Rows deleted per retention batch.
    retention_batch_size: int = 1000
    #: Audit ids folded into the transition totals per batch (at most 20 a sweep).
    totals_batch_size: int = 50_000
    #: An audit row is folded into the totals once a row at least as high is this many
    #: seconds old: a transaction still open may commit a lower id than a fresh row.
    totals_settle: float = 60.0
    #: Audit ids above the totals' watermark a Prometheus scrape counts at most (about a
    #: minute of transitions at 1,000 tasks a second); past it the scrape reports them.
    metrics_tail_rows: int = 200_000
    #: Most outcomes the worker's outcome writer puts in one statement.
    outcome_batch_size: int = 100
    #: Longest an outcome waits in the writer for others to share its statement.
    outcome_flush_interval: float = 0.05
    #: Outcomes the writer holds unwritten before the pool's hand-over waits.
    outcome_buffer: int = 1000
    #: Most deliveries one claim made ahead holds.
    claim_batch_size: int = 100
    #: Longest a delivery waits for others to share its claim made ahead.
    claim_interval: float = 0.005
    #: Deliveries beyond one round are claimed ahead only if expected to start within
    #: this many seconds (from the rate at which the worker starts tasks).
    claim_ahead_window: float = 1.0
    #: Retries of a transaction after a transient database error (within the call's
    #: ``lease_db_timeout``, which ends them sooner).
    db_retries: int = 3
    #: Longest opening one PostgreSQL connection may take (``None``: half of
    #: ``lease_db_timeout``; libpq rounds up to at least 2 s).
    db_connect_timeout: float | None = None
    #: Seconds a SQLite writer waits for the file lock (``None``: three times
    #: ``lease_db_timeout``, at most :data:`MAX_DB_WAIT`).
    sqlite_busy_timeout: float | None = None

    @classmethod
    def from_env(cls, text: str | None = None) -> Tuning:
        """The tuning :data:`TUNING_ENV` names (the defaults when it is not set)."""
        text = os.environ.get(TUNING_ENV, "") if text is None else text
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, _, raw = item.partition("=")
            name = name.strip()
            if name not in kinds:
                raise ConfigurationError(f"{TUNING_ENV}: no such tuning {name!r}")
            try:
                values[name] = (int if "int" in str(kinds[name]) else float)(raw)
            except ValueError:
                raise ConfigurationError(f"{TUNING_ENV}: {name} must be a number") from None
        return cls(**values)


#: Beat's catch-up policies (``lease_catchup``) and overlap policies (``lease_overlap``).
CATCHUP_POLICIES = ("skip", "latest", "all")
OVERLAP_POLICIES = ("allow", "skip", "buffer_one")


@dataclasses.dataclass(frozen=True)
class LeaseConfig:
    """Validated settings of one Celery app (seconds are floats; fractions allowed)."""

    #: SQLAlchemy URL of the store. Default: ``celery-lease.sqlite3`` in the directory the
    #: process started in; a relative SQLite path is made absolute once, at read time.
    database_url: str = DEFAULT_DATABASE_URL
    #: Prefix of every table name (lets several apps share one database).
    table_prefix: str = "lease_"
    #: PostgreSQL schema holding the tables (``None``: the connection's search_path).
    schema: str | None = None
    #: Default lease TTL of a task: its lease is alive while its owner's heartbeat is younger.
    ttl: float = 30.0
    #: How often a worker renews its heartbeat row.
    heartbeat_interval: float = 5.0
    #: How often the reaper sweeps (beat entry and embedded reaper).
    reaper_interval: float = 5.0
    #: Run the reaper inside every worker's main process, behind a database lock.
    embedded_reaper: bool = True
    #: A PENDING row published but not claimed for this long is published again (its
    #: message was lost); each further re-publish of the same row waits twice as long.
    republish_after: float = 60.0
    #: A PENDING row whose producer never marked it published is published after this grace.
    publish_grace: float = 10.0
    #: Lease expiries tolerated before a task goes to WAIT_MANUAL instead of retrying.
    max_recoveries: int = 5
    #: A task older than this (seconds since submission) is never recovered automatically.
    max_age: float | None = None
    #: Default ``max_runtime`` of tasks (``None``: no limit).
    max_runtime: float | None = None
    #: Results larger than this (JSON bytes) are not stored; a note is stored instead.
    result_max_bytes: int = 65536
    #: Largest arguments of a submission (args and kwargs as JSON bytes, together); a
    #: larger submission raises ``ArgumentsTooLarge`` before anything is written.
    args_max_bytes: int = 1048576
    #: Create or upgrade the schema automatically (always done for SQLite).
    auto_migrate: bool = False
    #: SQLAlchemy connection pool size per process.
    pool_size: int = 5
    #: Longest a store call may take, retries included: past it the call ends with
    #: ``StoreUnavailable`` (PostgreSQL: also the session's statement and lock timeouts).
    db_timeout: float = 10.0
    #: A worker started while the database is unreachable waits and retries, with
    #: backoff, for up to ``db_startup_timeout`` seconds before it exits (0: at once).
    db_startup_timeout: float = 60.0
    #: Seconds a SUCCEEDED, FAILED or CANCELLED row is kept after ``finished_at``; the
    #: reaper then deletes it with its steps and audit rows (and so frees its dedup
    #: key). ``None`` keeps every row. It must exceed the longest time a message can be
    #: redelivered (a Redis ``visibility_timeout``), or a late copy would run again.
    retention: float | None = DEFAULT_RETENTION
    #: Send Celery task events (task-timeout, task-wait-manual, ...) for the transitions
    #: Celery cannot see, for Flower and ``celery events``.
    send_events: bool = True
    #: Write those transitions' states to the app's result backend, if it has one.
    result_backend_sync: bool = True
    #: Outcomes (SUCCEEDED, CANCELLED) are written by the pool process itself, one
    #: commit per task, instead of by the worker's outcome writer in batches.
    outcome_write_through: bool = False
    #: A ``group(...).apply_async()`` (a chord's header too) with leased members writes
    #: their rows in multi-row statements, as inside ``celery_lease.bulk()``.
    batch_groups: bool = True
    #: The broker this app publishes to (``lease_origin``; default: its ``broker_url``
    #: without the password, ``None``: not known). Every row and worker row records it,
    #: and a reaper publishes only the rows of its own broker, so apps on different
    #: brokers can share one store and table prefix (see :func:`broker_origin`). Set it
    #: alike in every process of an app whose processes reach one broker by different
    #: addresses (a proxy, another host name).
    origin: str | None = None
    #: Beat (``celery_lease.beat``): the default catch-up policy of a leased periodic
    #: entry, for slots missed while no beat ran: ``"skip"``, ``"latest"`` or ``"all"``.
    catchup: str = "latest"
    #: Beat: missed slots older than this (seconds) are never run, only counted.
    catchup_window: float = 86400.0
    #: Beat: with ``catchup="all"``, the most missed slots run at once (the latest ones).
    catchup_max: int = 10
    #: Beat: a slot whose previous run has not finished: ``"allow"``, ``"skip"`` or
    #: ``"buffer_one"``.
    overlap: str = "allow"
    #: A leased task submitted with an ETA (``eta``/``countdown``) more than this many
    #: seconds away (database time) is written to its row, *held*, and not published:
    #: the reaper publishes its stored message when it is due. No broker visibility
    #: timeout can redeliver it meanwhile and no worker's memory holds it. ``None``:
    #: every task is published at once, its ETA waited for by a worker, as in Celery.
    hold_eta_after: float | None = 60.0

    _tuning: ClassVar[Tuning]

    def __post_init__(self) -> None:
        object.__setattr__(self, "database_url", resolve_database_url(self.database_url))
        object.__setattr__(self, "_tuning", Tuning.from_env())
        for key, seconds, zero, maximum in (
            ("lease_ttl", self.ttl, False, MAX_SECONDS),
            ("lease_heartbeat_interval", self.heartbeat_interval, False, MAX_SECONDS),
            ("lease_reaper_interval", self.reaper_interval, False, MAX_SECONDS),
            ("lease_republish_after", self.republish_after, False, MAX_SECONDS),
            ("lease_publish_grace", self.publish_grace, False, MAX_SECONDS),
            ("lease_db_timeout", self.db_timeout, False, MAX_DB_WAIT),
            ("lease_db_startup_timeout", self.db_startup_timeout, True, MAX_SECONDS),
            ("lease_max_age", self.max_age, False, MAX_SECONDS),
            ("lease_max_runtime", self.max_runtime, False, MAX_SECONDS),
            ("lease_retention", self.retention, False, MAX_SECONDS),
            ("lease_catchup_window", self.catchup_window, True, MAX_SECONDS),
            ("lease_hold_eta_after", self.hold_eta_after, True, MAX_SECONDS),
        ):
            if seconds is not None:
                check_seconds(key, seconds, zero=zero, maximum=maximum)
        if self.heartbeat_interval >= self.ttl:
            raise ConfigurationError(
                f"lease_heartbeat_interval ({self.heartbeat_interval}) must be shorter than "
                f"lease_ttl ({self.ttl}), or every lease would look expired between heartbeats"
            )
        for key, ivalue in {
            "lease_result_max_bytes": self.result_max_bytes,
            "lease_args_max_bytes": self.args_max_bytes,
            "lease_pool_size": self.pool_size,
            "lease_catchup_max": self.catchup_max,
        }.items():
            if ivalue < 1:
                raise ConfigurationError(f"{key} must be at least 1, got {ivalue!r}")
        if self.catchup not in CATCHUP_POLICIES:
            raise ConfigurationError(
                f"lease_catchup must be one of {CATCHUP_POLICIES}, got {self.catchup!r}"
            )
        if self.overlap not in OVERLAP_POLICIES:
            raise ConfigurationError(
                f"lease_overlap must be one of {OVERLAP_POLICIES}, got {self.overlap!r}"
            )
        if self.max_recoveries < 0:
            raise ConfigurationError("lease_max_recoveries must be >= 0")
        if self.schema is not None and self.database_url.startswith("sqlite"):
            raise ConfigurationError(
                "lease_schema is for PostgreSQL only; on SQLite use lease_table_prefix"
            )
        if self.origin is not None and not 0 < len(self.origin) <= 255:
            raise ConfigurationError(
                f"lease_origin must be 1 to 255 characters, got {len(self.origin)}"
            )
        if not self.table_prefix.replace("_", "").isalnum():
            raise ConfigurationError(
                "lease_table_prefix must be letters, digits and underscores, "
                f"got {self.table_prefix!r}"
            )

    # -- what is derived, not set ---------------------------------------------------------

    def tuned(self, **changes: Any) -> LeaseConfig:
        """This configuration with some of its :class:`Tuning` changed (the worker's
        heartbeat bounds its own connection so; tests shrink batches so)."""
        copy = dataclasses.replace(self)
        object.__setattr__(copy, "_tuning", dataclasses.replace(self._tuning, **changes))
        return copy

    @property
    def tuning(self) -> Tuning:
        """The internal sizes and waits of this configuration."""
        return self._tuning

    @property
    def db_retry_on_startup(self) -> bool:
        """A starting worker waits for the database (``lease_db_startup_timeout`` > 0)."""
        return self.db_startup_timeout > 0

    @property
    def db_connect_timeout(self) -> float:
        found = self._tuning.db_connect_timeout
        return self.db_timeout / 2 if found is None else found

    @property
    def sqlite_busy_timeout(self) -> float:
        found = self._tuning.sqlite_busy_timeout
        return min(self.db_timeout * 3, MAX_DB_WAIT) if found is None else found

    @property
    def db_retries(self) -> int:
        return self._tuning.db_retries

    @property
    def reaper_batch_size(self) -> int:
        return self._tuning.reaper_batch_size

    @property
    def retention_batch_size(self) -> int:
        return self._tuning.retention_batch_size

    @property
    def totals_batch_size(self) -> int:
        return self._tuning.totals_batch_size

    @property
    def totals_settle(self) -> float:
        return self._tuning.totals_settle

    @property
    def metrics_tail_rows(self) -> int:
        return self._tuning.metrics_tail_rows

    @property
    def outcome_batch_size(self) -> int:
        return self._tuning.outcome_batch_size

    @property
    def outcome_flush_interval(self) -> float:
        return self._tuning.outcome_flush_interval

    @property
    def outcome_buffer(self) -> int:
        return self._tuning.outcome_buffer

    @property
    def claim_batch_size(self) -> int:
        return self._tuning.claim_batch_size

    @property
    def claim_interval(self) -> float:
        return self._tuning.claim_interval

    @property
    def claim_ahead_window(self) -> float:
        return self._tuning.claim_ahead_window


#: setting name on app.conf -> (field name, type)
_FIELDS: dict[str, tuple[str, type]] = {
    "lease_database_url": ("database_url", str),
    "lease_table_prefix": ("table_prefix", str),
    "lease_schema": ("schema", str),
    "lease_origin": ("origin", str),
    "lease_ttl": ("ttl", float),
    "lease_heartbeat_interval": ("heartbeat_interval", float),
    "lease_reaper_interval": ("reaper_interval", float),
    "lease_embedded_reaper": ("embedded_reaper", bool),
    "lease_republish_after": ("republish_after", float),
    "lease_publish_grace": ("publish_grace", float),
    "lease_max_recoveries": ("max_recoveries", int),
    "lease_max_age": ("max_age", float),
    "lease_max_runtime": ("max_runtime", float),
    "lease_result_max_bytes": ("result_max_bytes", int),
    "lease_args_max_bytes": ("args_max_bytes", int),
    "lease_auto_migrate": ("auto_migrate", bool),
    "lease_pool_size": ("pool_size", int),
    "lease_db_timeout": ("db_timeout", float),
    "lease_db_startup_timeout": ("db_startup_timeout", float),
    "lease_retention": ("retention", float),
    "lease_send_events": ("send_events", bool),
    "lease_result_backend_sync": ("result_backend_sync", bool),
    "lease_outcome_write_through": ("outcome_write_through", bool),
    "lease_batch_groups": ("batch_groups", bool),
    "lease_catchup": ("catchup", str),
    "lease_catchup_window": ("catchup_window", float),
    "lease_catchup_max": ("catchup_max", int),
    "lease_overlap": ("overlap", str),
    "lease_hold_eta_after": ("hold_eta_after", float),
}

SETTINGS: tuple[str, ...] = tuple(_FIELDS)

#: Settings whose ``None`` is a value of its own (not "unset, use the default").
_NONE_MEANS_OFF = frozenset({"lease_retention", "lease_hold_eta_after"})


def _coerce(key: str, value: Any, kind: type) -> Any:
    if value is None:
        return None
    if kind is bool:
        if isinstance(value, str):
            lowered = value.strip().lower()
            if lowered in {"1", "true", "yes", "on"}:
                return True
            if lowered in {"0", "false", "no", "off"}:
                return False
            raise ConfigurationError(f"{key} must be a boolean, got {value!r}")
        return bool(value)
    if kind in (int, float) and isinstance(value, bool):
        raise ConfigurationError(f"{key} must be a number, got {value!r}")
    try:
        return kind(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigurationError(f"{key} must be {kind.__name__}, got {value!r}") from exc


def _is_set(conf: Any, key: str) -> bool:
    """Whether ``key`` is present in ``conf`` (set to ``None`` on purpose)."""
    try:
        return key in conf
    except TypeError:
        return False


def broker_origin(broker_url: Any) -> str | None:
    """What a row records of the broker its app publishes to: the broker URL without its
    password (``redis://:**@host:6379/0``), at most 255 characters (longer: a digest)."""
    if not broker_url or not isinstance(broker_url, str):
        return None
    from kombu.utils.url import maybe_sanitize_url

    origin = str(maybe_sanitize_url(broker_url))
    if len(origin) > 255:
        import hashlib

        origin = origin[:200] + "#" + hashlib.sha256(origin.encode()).hexdigest()[:32]
    return origin


#: Settings that went away -> what replaced them. Still set, each gives a
#: :class:`~celery_lease.CeleryLeaseDeprecationWarning` and has no other effect.
DEPRECATED: dict[str, str] = {
    "lease_reaper_batch_size": "a constant (100 rows per reaper transaction)",
    "lease_retention_batch_size": "a constant (1000 rows per retention transaction)",
    "lease_totals_batch_size": "a constant (50000 audit ids per totals transaction)",
    "lease_totals_settle": "a constant (60 s)",
    "lease_metrics_tail_rows": "a constant (200000 audit ids per scrape)",
    "lease_outcome_batch_size": "a constant (100 outcomes per statement)",
    "lease_outcome_flush_interval": "a constant (0.05 s)",
    "lease_outcome_buffer": "a constant (1000 outcomes)",
    "lease_claim_batch_size": "a constant (100 deliveries per claim)",
    "lease_claim_interval": "a constant (0.005 s)",
    "lease_claim_ahead_window": "a constant (1 s)",
    "lease_claim_ahead": (
        "always on, on every pool: each worker's lease agent claims its deliveries in "
        "batches (a process of its own, not the worker's main process)"
    ),
    "lease_db_retries": "a constant (3 retries, within lease_db_timeout)",
    "lease_db_connect_timeout": "derived from lease_db_timeout (half of it)",
    "lease_sqlite_busy_timeout": "derived from lease_db_timeout (three times it)",
    "lease_db_retry_on_startup": (
        "lease_db_startup_timeout (set it to 0 for a worker that exits at once)"
    ),
    "lease_beat_reaper": (
        "always on (the celery-lease-reap entry acts only where celery beat runs, and is "
        "safe beside the embedded reaper)"
    ),
}


def warn_deprecated(conf: Any) -> None:
    """A :class:`~celery_lease.CeleryLeaseDeprecationWarning` for each removed setting
    ``conf`` still sets, naming what replaced it."""
    for key, replacement in DEPRECATED.items():
        try:
            present = conf.get(key) is not None
        except (KeyError, AttributeError):
            present = False
        if present:
            warnings.warn(
                f"{key} is no longer a setting and has no effect: it is now {replacement}",
                CeleryLeaseDeprecationWarning,
                # one place, so each setting's warning is shown once per process
                stacklevel=1,
            )


def from_mapping(conf: Any) -> LeaseConfig:
    """Build a validated :class:`LeaseConfig` from a Celery ``app.conf`` (or any mapping).

    ``CELERY_LEASE_DATABASE_URL`` in the environment overrides an unset database URL,
    which lets the same project point at another store without code changes.
    """
    warn_deprecated(conf)
    values: dict[str, Any] = {}
    for key, (field, kind) in _FIELDS.items():
        try:
            raw = conf.get(key)
        except (KeyError, AttributeError):
            raw = None
        if raw is None:
            if key in _NONE_MEANS_OFF and _is_set(conf, key):
                values[field] = None
            continue
        values[field] = _coerce(key, raw, kind)
    if "database_url" not in values and os.environ.get("CELERY_LEASE_DATABASE_URL"):
        values["database_url"] = os.environ["CELERY_LEASE_DATABASE_URL"]
    if "origin" not in values:
        with contextlib.suppress(KeyError, AttributeError):
            values["origin"] = broker_origin(conf.get("broker_url"))
    return LeaseConfig(**values)
