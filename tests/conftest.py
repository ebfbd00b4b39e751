"""Shared fixtures: real PostgreSQL/SQLite stores, real brokers, real worker processes.

Backends
    ``backend`` is parametrized ``sqlite`` / ``postgresql`` (the latter marked
    ``postgres``), so ``-k sqlite`` or ``-m "not postgres"`` select one side.
    ``lease_config(**overrides) -> LeaseConfig`` gives tables nobody else sees:
    SQLite, a file in ``tmp_path``; PostgreSQL, a schema of its own (created by the
    migration, dropped at teardown) in a database created for the test session.
    ``store`` is a migrated :class:`~celery_lease.store.Store` on it whose audit trail
    is checked at teardown; ``make_store(**overrides)`` makes more (disposed at teardown).

Brokers
    ``redis_url`` (db index 9, flushed before and after), ``amqp_url`` (RabbitMQ; the
    test's queue is deleted after), ``broker_url`` parametrized over both, and
    ``queue_name`` (unique per test).

Workers
    ``celery_project(source, ...) -> WorkerProject``; ``project.worker(...)`` starts a
    real ``celery worker`` subprocess. Everything started is SIGKILLed at teardown, and
    the tail of each worker's log is added to the report of a failing test.

Override service addresses with ``CELERY_LEASE_TEST_PG_ADMIN_URL``,
``CELERY_LEASE_TEST_REDIS_URL`` and ``CELERY_LEASE_TEST_AMQP_URL``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import uuid
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings as hypothesis_settings

from celery_lease.check import check
from celery_lease.config import LeaseConfig
from celery_lease.store import Store

from .helpers import (
    EXTERNAL_ENV,
    ExternalSystem,
    ProcessRegistry,
    WorkerProject,
    check_audit,
    lease_settings,
)
from .stalls import WATCH, describe

# -- running in parallel (pytest-xdist) ----------------------------------------------------

#: This process's xdist worker ("gw0", "gw1", ...; "" when tests run in one process).
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
XDIST_INDEX = int(XDIST_WORKER[2:]) if XDIST_WORKER.startswith("gw") else 0
#: Redis databases of each xdist worker: (the tests' broker and results, the Django
#: project's broker). Every test flushes its database, so no two workers share one.
_REDIS_DBS = ((9, 14), (11, 12), (13, 10))


def _worker_redis_url(variable: str, default_db: int, which: int) -> str:
    """The Redis URL of ``variable`` (default: db ``default_db``), moved to this xdist
    worker's own database, and exported so that workers and subprocesses use it too."""
    from sqlalchemy.engine import make_url

    url = os.environ.get(variable, f"redis://127.0.0.1:6379/{default_db}")
    if XDIST_WORKER:
        if XDIST_INDEX not in range(len(_REDIS_DBS)):
            raise pytest.UsageError(
                f"at most {len(_REDIS_DBS)} xdist workers (each has Redis databases of its own)"
            )
        base = make_url(url).database or str(default_db)
        db = int(base) + _REDIS_DBS[XDIST_INDEX][which] - _REDIS_DBS[0][which]
        url = make_url(url).set(database=str(db)).render_as_string(hide_password=False)
        os.environ[variable] = url
    return url


PG_ADMIN_URL = os.environ.get(
    "CELERY_LEASE_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
REDIS_URL = _worker_redis_url("CELERY_LEASE_TEST_REDIS_URL", 9, 0)
_worker_redis_url("CELERY_LEASE_TEST_DJANGO_BROKER_URL", 14, 1)
if XDIST_WORKER:
    # Django's test database (created and dropped by its runner): one per xdist worker
    os.environ.setdefault("CELERY_LEASE_DJANGO_TEST_DB", f"test_celery_lease_django_{XDIST_WORKER}")
AMQP_URL = os.environ.get("CELERY_LEASE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
if XDIST_INDEX > 0:
    # a RabbitMQ virtual host per further xdist worker: workers of two tests may share a
    # node name (w1@lease-test), and remote control and events fan out over a vhost
    AMQP_URL = os.environ["CELERY_LEASE_TEST_AMQP_URL"] = (
        AMQP_URL.rsplit("/", 1)[0] + f"/lease-test-{XDIST_WORKER}"
    )
_vhost_ready: list[str] = []


def _ensure_vhost(url: str) -> None:
    """Create the virtual host of ``url`` (and grant its user) with ``rabbitmqctl``,
    once per process; "/" always exists."""
    import shutil
    import subprocess
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(url)
    vhost = unquote(parts.path[1:]) or "/"
    if vhost == "/" or url in _vhost_ready:
        return
    ctl = shutil.which("rabbitmqctl")
    if ctl is None:
        pytest.fail(
            f"xdist worker {XDIST_WORKER} needs the RabbitMQ virtual host {vhost!r} and there "
            "is no rabbitmqctl to create it: create it, or run the tests with -n 0",
            pytrace=False,
        )
    for argv in (
        [ctl, "-q", "add_vhost", vhost],
        [ctl, "-q", "set_permissions", "-p", vhost, parts.username or "guest", ".*", ".*", ".*"],
    ):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        if proc.returncode != 0 and "already_exists" not in proc.stderr + proc.stdout:
            pytest.fail(f"{' '.join(argv)} failed: {proc.stderr.strip()}", pytrace=False)
    _vhost_ready.append(url)


#: Short timings for every test store (override per test through ``lease_config``).
TEST_TIMINGS: dict[str, Any] = {
    "ttl": 1.0,
    "heartbeat_interval": 0.2,
    "reaper_interval": 0.2,
    "publish_grace": 0.5,
    "republish_after": 2.0,
}

#: The testing kit's plugin loads through its pytest11 entry point; an installation made
#: before that entry point existed (pip install -e . not run again) loads it from here.
KIT_PLUGIN = "celery_lease.testing.plugin"
if not any(ep.name == "celery_lease" for ep in entry_points(group="pytest11")):
    pytest_plugins = [KIT_PLUGIN]

# shared CI machines are slow now and then: no per-example deadline
hypothesis_settings.register_profile("celery_lease", deadline=None, max_examples=100)
hypothesis_settings.load_profile("celery_lease")


# -- nothing left behind in the checkout ------------------------------------------------

#: Left by the tools themselves, not by tests.
_TOOL_LEFTOVERS = ("__pycache__", ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache")
_LEFT_BEHIND = pytest.StashKey[set[str]]()


def _untracked_files() -> set[str] | None:
    """Untracked paths of the checkout, ignored ones too (``None``: not a git checkout)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    out: set[str] = set()
    for extra in ([], ["--ignored"]):
        try:
            proc = subprocess.run(
                [
                    "git",
                    "-C",
                    str(root),
                    "ls-files",
                    "--others",
                    "--exclude-standard",
                    "--directory",
                    *extra,
                ],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        if proc.returncode != 0:
            return None
        out.update(proc.stdout.splitlines())
    return {
        p
        for p in out
        if not p.startswith(".venv") and not any(part in _TOOL_LEFTOVERS for part in p.split("/"))
    }


def pytest_sessionstart(session: pytest.Session) -> None:
    WATCH.start()
    if XDIST_WORKER:
        return  # the controlling process checks the whole run
    before = _untracked_files()
    if before is not None:
        session.stash[_LEFT_BEHIND] = before


_STALLS = pytest.StashKey[list[Any]]()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """An xdist worker ended: keep what its stall watch noted (see ``tests/stalls.py``)."""
    stalls = node.config.stash.setdefault(_STALLS, [])
    stalls += getattr(node, "workeroutput", {}).get("stalls", [])


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Every stall of a test process the run noted (any test, failed or not)."""
    config = terminalreporter.config
    noted = [*config.stash.get(_STALLS, []), *WATCH.noted]
    if noted:
        terminalreporter.section("stalls of the test processes")
        for line in sorted(describe(n) for n in noted):
            terminalreporter.write_line(line)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A test run leaves no file in the checkout (a store in the current directory, a
    log, a build): fail the run if one appeared."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: its controller reports them
        workeroutput["stalls"] = [list(n) for n in WATCH.noted]
        WATCH.noted.clear()
    before = session.stash.get(_LEFT_BEHIND, None)
    after = _untracked_files() if before is not None else None
    if before is None or after is None:
        return
    new = sorted(after - before)
    if new:
        print("\nERROR: the test run left files in the checkout: " + ", ".join(new))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# -- teardown in a fixed order ------------------------------------------------------------


@dataclasses.dataclass
class Harness:
    """Everything one test started, torn down in a safe order: processes first (they
    hold connections and locks), then engines, then schemas, queues and Redis keys."""

    registry: ProcessRegistry = dataclasses.field(default_factory=ProcessRegistry)
    stores: list[Store] = dataclasses.field(default_factory=list)
    finalizers: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    #: Where the PostgreSQL server's log stood when the test began (see pg_log_since).
    pg_log_at: int | None = dataclasses.field(default_factory=lambda: _pg_log_size())
    #: How many stalls of this process were noted before the test began.
    stalls_at: int = dataclasses.field(default_factory=lambda: len(WATCH.noted))

    def track(self, store: Store) -> Store:
        self.stores.append(store)
        return store

    def close(self) -> None:
        errors: list[BaseException] = []
        steps: list[Callable[[], None]] = [self.registry.close]
        steps += [s.dispose for s in self.stores]
        steps += list(reversed(self.finalizers))
        for step in steps:
            try:
                step()
            except Exception as exc:  # keep tearing down; report at the end
                errors.append(exc)
        if errors:
            raise errors[0]


_HARNESS = pytest.StashKey["Harness | None"]()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "exclusive_services" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.exclusive)


#: Non-empty while this process holds its turn (a nested request is a no-op).
_turn_held: list[bool] = []


def _turn_record(folder: Path, line: str) -> None:
    """Append one line to the run's record of turns (one ``write`` in append mode: the
    lines of several processes never interleave)."""
    fd = os.open(folder / "turns", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _turns_overlapping(folder: Path, since: float) -> list[str]:
    """The turns of other processes held at some moment from ``since`` until now, read
    from the run's record: ``begin`` lines with no ``end`` line yet count as held."""
    held: dict[tuple[str, str], tuple[float, str]] = {}
    found = []
    me = str(os.getpid())
    for line in (folder / "turns").read_text().splitlines():
        what, pid, seq, at, label = line.split(" ", 4)
        if pid == me:
            continue
        if what == "begin":
            held[(pid, seq)] = (float(at), label)
        else:
            _start, _label = held.pop((pid, seq), (0.0, label))
            if float(at) >= since:
                found.append(f"{_label} (process {pid}) ended {float(at) - since:+.3f} s")
    found += [f"{label} (process {pid}) still held" for (pid, _), (_, label) in held.items()]
    return found


@contextlib.contextmanager
def turn(exclusive: bool, label: str = "") -> Iterator[None]:
    """A readers-writer lock over the xdist workers of one run: a test holds it shared,
    an ``exclusive`` test alone. An exclusive test takes the gate first and keeps it
    while it waits for the running tests to end, so no new test starts meanwhile.

    Every turn is recorded in the run's folder, and an exclusive turn checks at its end
    that no other process held one meanwhile: a test that restarts a service while
    another runs would break that other test in ways that point nowhere near here."""
    import fcntl
    import tempfile
    import time

    if not XDIST_WORKER or _turn_held:
        yield  # one process, or this process has its turn already
        return
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "solo")
    folder = Path(tempfile.gettempdir()) / f"celery-lease-tests-{run}"
    folder.mkdir(exist_ok=True)
    kind = "exclusive" if exclusive else "shared"
    seq = uuid.uuid4().hex[:8]
    with open(folder / "gate", "a") as gate, open(folder / "lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)
        _turn_held.append(exclusive)
        since = time.time()
        _turn_record(folder, f"begin {os.getpid()} {seq} {since:.6f} {kind}:{label}")
        try:
            yield
        finally:
            others = _turns_overlapping(folder, since) if exclusive else []
            _turn_record(folder, f"end {os.getpid()} {seq} {time.time():.6f} {kind}:{label}")
            _turn_held.clear()
            fcntl.flock(lock, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)
            assert not others, f"{label} ran beside other turns: " + "; ".join(others)


@pytest.fixture(autouse=True)
def parallel_turn(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under pytest-xdist, a test marked ``exclusive`` (it restarts a shared service)
    runs while no other worker runs a test; the others run side by side. Held around
    everything the test starts (``harness`` depends on it)."""
    exclusive = request.node.get_closest_marker("exclusive") is not None
    with turn(exclusive, request.node.nodeid):
        yield


@pytest.fixture(autouse=True)
def harness(request: pytest.FixtureRequest, parallel_turn: None) -> Iterator[Harness]:
    WATCH.current = request.node.nodeid
    h = Harness()
    request.node.stash[_HARNESS] = h
    try:
        yield h
        h.close()
    finally:
        WATCH.current = "(between tests)"
        # the test's item lives as long as the session, and the harness with it (its
        # stash): its stores, their engines, tables and statement caches must not,
        # or every test adds to what each full garbage collection of this process
        # walks (collections of seconds by the end of a run, during which nothing of
        # this process runs: not a store call's deadline, not a worker's heartbeat)
        h.stores.clear()
        h.finalizers.clear()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    h = item.stash.get(_HARNESS, None)
    if report.when == "teardown":
        item.stash[_HARNESS] = None  # see the harness fixture: nothing of it is needed now
    if report.failed:
        if h is not None and h.registry.workers:
            report.sections.append(("celery worker logs (tail)", h.registry.failure_report()))
        if h is not None and h.pg_log_at is not None:
            report.sections.append(
                ("PostgreSQL server log since the test began", pg_log_since(h.pg_log_at))
            )
        if h is not None:
            stalls = WATCH.since(h.stalls_at)
            report.sections.append(
                ("stalls of this test process", "\n".join(stalls) if stalls else "(none)")
            )
    return report


#: The PostgreSQL server's log (Debian's cluster log; the session database logs lock
#: waits and slow statements there, see ``pg_url``): a failed test shows what the
#: server logged meanwhile, from every session, so a stall names its cause.
_PG_LOGS = sorted(Path("/var/log/postgresql").glob("postgresql-*-main.log"))
_PG_LOG = _PG_LOGS[-1] if _PG_LOGS else None
#: Most lines of it a failed test's report shows (the last ones).
_PG_LOG_LINES = 120


def _pg_log_size() -> int | None:
    if _PG_LOG is None:
        return None
    try:
        return _PG_LOG.stat().st_size
    except OSError:
        return None


def pg_log_since(offset: int) -> str:
    """What the server logged after ``offset`` (its last lines); a log rotated or
    truncated meanwhile is read from its start."""
    assert _PG_LOG is not None
    try:
        with _PG_LOG.open("rb") as f:
            if f.seek(0, os.SEEK_END) < offset:
                offset = 0
            f.seek(offset)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError as error:
        return f"(not readable: {error})"
    if not lines:
        return "(nothing)"
    skipped = len(lines) - _PG_LOG_LINES
    shown = lines[-_PG_LOG_LINES:]
    return "\n".join(([f"({skipped} earlier lines not shown)"] if skipped > 0 else []) + shown)


# -- PostgreSQL ---------------------------------------------------------------------------


def pg_execute(url: str, *statements: Any) -> None:
    """Run statements in autocommit mode (CREATE/DROP DATABASE or SCHEMA)."""
    import psycopg

    with psycopg.connect(_libpq_url(url), autocommit=True, connect_timeout=5) as conn:
        for statement in statements:
            conn.execute(statement)


def _libpq_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


_SESSION_DB_PREFIX = "celery_lease_test_"


def _drop_stale_session_databases() -> None:
    """Drop session databases left by test runs that were killed (their pid is gone)."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(_libpq_url(PG_ADMIN_URL), autocommit=True, connect_timeout=5) as conn:
        names = [
            row[0]
            for row in conn.execute(
                "SELECT datname FROM pg_database WHERE datname LIKE %s",
                (_SESSION_DB_PREFIX + "%",),
            )
        ]
        for name in names:
            suffix = name.removeprefix(_SESSION_DB_PREFIX)
            if suffix.isdigit() and not Path(f"/proc/{suffix}").exists():
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A PostgreSQL database created for this test session (dropped at its end)."""
    import psycopg
    from psycopg import sql
    from sqlalchemy.engine import make_url

    name = f"{_SESSION_DB_PREFIX}{os.getpid()}"
    ident = sql.Identifier(name)
    try:
        with turn(exclusive=False, label="pg_url"):  # never while a service restarts
            _drop_stale_session_databases()
            pg_execute(
                PG_ADMIN_URL,
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident),
                sql.SQL("CREATE DATABASE {}").format(ident),
                # a wait for a lock longer than deadlock_timeout (1 s) and a statement
                # longer than 2 s are logged, with what they waited for: shown in the
                # report of a test that fails (see pg_log_since)
                sql.SQL("ALTER DATABASE {} SET log_lock_waits = on").format(ident),
                sql.SQL("ALTER DATABASE {} SET log_min_duration_statement = 2000").format(ident),
            )
    except psycopg.OperationalError as exc:
        pytest.fail(
            f"PostgreSQL is not reachable at {make_url(PG_ADMIN_URL).render_as_string()}: {exc}\n"
            "start it (.ci/run does) or deselect these tests with -m 'not postgres'",
            pytrace=False,
        )
    yield make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    with turn(exclusive=False, label="pg_url teardown"):
        pg_execute(PG_ADMIN_URL, sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))


def drop_pg_schema(url: str, schema: str) -> None:
    from psycopg import sql

    pg_execute(
        url,
        "SET lock_timeout = '20s'",
        sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)),
    )


# -- the store under test -----------------------------------------------------------------


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgresql", id="postgresql", marks=pytest.mark.postgres),
    ]
)
def backend(request: pytest.FixtureRequest) -> str:
    """``"sqlite"`` or ``"postgresql"``: every test using a store runs on both."""
    return str(request.param)


@pytest.fixture
def store_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """The database URL of this test's store (SQLite: a file in ``tmp_path``)."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'lease.sqlite3'}"
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture
def store_schema(backend: str, store_url: str, harness: Harness) -> str | None:
    """PostgreSQL: a schema name for this test alone (created by the migration, dropped
    at teardown). SQLite: ``None``."""
    if backend == "sqlite":
        return None
    schema = f"t_{uuid.uuid4().hex[:12]}"
    harness.finalizers.append(lambda: drop_pg_schema(store_url, schema))
    return schema


class ConfigFactory:
    """``make_config(**overrides) -> LeaseConfig`` for this test's isolated tables."""

    def __init__(self, backend: str, url: str, schema: str | None) -> None:
        self.backend = backend
        self.url = url
        self.schema = schema

    @property
    def is_pg(self) -> bool:
        return self.backend == "postgresql"

    def __call__(self, *, tuning: dict[str, Any] | None = None, **overrides: Any) -> LeaseConfig:
        """``tuning``: internal sizes and waits to change (see ``LeaseConfig.tuned``)."""
        values: dict[str, Any] = {**TEST_TIMINGS, "database_url": self.url, "schema": self.schema}
        values.update(overrides)
        config = LeaseConfig(**values)
        return config.tuned(**tuning) if tuning else config


@pytest.fixture
def lease_config(backend: str, store_url: str, store_schema: str | None) -> ConfigFactory:
    """Factory of :class:`LeaseConfig` for this test's tables, with short timings
    (ttl 1.0, heartbeat 0.2, reaper 0.2, publish_grace 0.5, republish_after 2.0)."""
    return ConfigFactory(backend, store_url, store_schema)


@pytest.fixture
def make_store(
    lease_config: ConfigFactory, harness: Harness, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Store]]:
    """``make_store(migrate=True, **config_overrides) -> Store``, disposed at teardown.

    At teardown (after every worker process is gone) the audit trail of every task in
    each store that has tables is checked with :func:`tests.helpers.check_audit`, and
    the invariant checker (:func:`celery_lease.check.check`, safety invariants) must
    find nothing. A test that builds violations on purpose (the checker's own tests)
    says so with ``@pytest.mark.violations``.
    """
    made: list[Store] = []

    def make(migrate: bool = True, **overrides: Any) -> Store:
        store = harness.track(Store(lease_config(**overrides)))
        made.append(store)
        if migrate:
            store.migrate()
        return store

    yield make
    harness.registry.close()  # nothing may move rows while they are checked
    checked: set[tuple[str, str | None, str]] = set()
    for s in made:
        key = (s.config.database_url, s.config.schema, s.config.table_prefix)
        if key not in checked and s.schema_version() is not None:
            checked.add(key)
            check_audit(s)
            if request.node.get_closest_marker("violations") is None:
                found = check(s, liveness=False)
                assert found == [], "invariant violations at teardown:\n" + "\n".join(
                    map(str, found)
                )


@pytest.fixture
def store(make_store: Callable[..., Store]) -> Store:
    """A migrated store (its audit trail is checked at teardown, see ``make_store``)."""
    return make_store()


# -- brokers ------------------------------------------------------------------------------


@pytest.fixture
def queue_name() -> str:
    """A queue name no other test uses."""
    return f"lease-test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def redis_url(harness: Harness) -> str:
    """Redis db 9 (by default), flushed before and after the test."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=5)
    try:
        client.flushdb()
    except redis.ConnectionError as exc:
        client.close()
        pytest.fail(f"Redis is not reachable at {REDIS_URL}: {exc}", pytrace=False)

    def flush() -> None:
        try:
            client.flushdb()
        finally:
            client.close()

    harness.finalizers.append(flush)
    return REDIS_URL


@pytest.fixture
def amqp_url(queue_name: str, harness: Harness) -> str:
    """RabbitMQ; the test's queue (``queue_name``) is deleted after the test."""
    from kombu import Connection

    def connect() -> Any:
        return Connection(AMQP_URL, connect_timeout=5)

    _ensure_vhost(AMQP_URL)
    try:
        with connect() as conn:
            conn.ensure_connection(max_retries=1)
    except Exception as exc:
        pytest.fail(f"RabbitMQ is not reachable at {AMQP_URL}: {exc}", pytrace=False)

    def delete_queue() -> None:
        with connect() as conn, contextlib.suppress(Exception):
            conn.default_channel.queue_delete(queue_name)

    harness.finalizers.append(delete_queue)
    return AMQP_URL


@pytest.fixture(params=["redis", "amqp"])
def broker_url(request: pytest.FixtureRequest) -> str:
    """Each real broker in turn (``redis_url``, then ``amqp_url``)."""
    return str(request.getfixturevalue(f"{request.param}_url"))


# -- external system and worker processes -------------------------------------------------


@pytest.fixture
def external(tmp_path: Path) -> ExternalSystem:
    """The counting stub of an external system; workers of ``celery_project`` see it as
    ``ExternalSystem.from_env()``."""
    return ExternalSystem(tmp_path / "external.sqlite3")


@pytest.fixture
def celery_project(
    tmp_path: Path,
    harness: Harness,
    external: ExternalSystem,
    queue_name: str,
    request: pytest.FixtureRequest,
) -> Callable[..., WorkerProject]:
    """``celery_project(source, *, broker_url=None, config=None, settings=None, env=None)``.

    Writes a project module into ``tmp_path`` whose app uses ``broker_url`` (default:
    ``redis_url``) and ``queue_name``, with ``lease_*`` settings from ``config`` (a
    LeaseConfig) and then ``settings``, followed by ``source``. Workers get the
    external stub's path in ``CELERY_LEASE_TEST_EXTERNAL``.
    """
    count = 0

    def make(
        source: str,
        *,
        broker_url: str | None = None,
        config: LeaseConfig | None = None,
        settings: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
    ) -> WorkerProject:
        nonlocal count
        count += 1
        merged: dict[str, Any] = lease_settings(config) if config is not None else {}
        merged.update(settings or {})
        return WorkerProject(
            tmp_path / f"project{count}",
            broker_url=broker_url or str(request.getfixturevalue("redis_url")),
            queue=queue_name,
            source=source,
            settings=merged,
            env={EXTERNAL_ENV: str(external.path), **(env or {})},
            registry=harness.registry,
        )

    return make


@pytest.fixture
def lease_env(
    celery_project: Callable[..., Any],
    lease_config: Callable[..., Any],
    make_store: Callable[..., Any],
    external: ExternalSystem,
    harness: Harness,
    tmp_path: Path,
) -> Any:
    """Leased projects on this test's store and brokers (see
    :class:`tests.crash.support.LeaseEnv`)."""
    from .crash.support import LeaseEnv

    return LeaseEnv(
        celery_project, lease_config, make_store, external, harness.finalizers, tmp_path
    )
