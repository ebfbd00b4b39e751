"""The pytest plugin (entry point ``pytest11: celery_lease``): real workers per test.

Fixtures (all named ``lease_*``, so they sit beside pytest-celery's and
``celery.contrib.pytest``'s without shadowing either):

* ``lease_app``: the Celery app under test (ini ``lease_app``, or override the fixture);
* ``lease_store``: a migrated store no other test sees (SQLite file in ``tmp_path``, or a
  PostgreSQL schema of its own with ini ``lease_database``); the app in the test process
  uses it while the test runs;
* ``lease_worker``: a started ``celery -A <app> worker`` on that store (a
  :class:`~celery_lease.testing.LeaseWorker`); ``lease_workers(...)`` starts more;
* ``lease_effects``: the side-effect counter, ``lease_crash``: the armed crash points;
* ``lease_conf``: the ``app.conf`` settings applied in the test and its workers.
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .._runtime import runtime
from ..config import LeaseConfig
from ..store import Store
from ._crash import CrashPoints
from ._effects import EFFECTS_ENV, SideEffects
from ._redis_keys import BindingKeys
from ._worker import LeaseWorker, log_report

#: Short timings for tests: a lost lease is noticed within a second or two.
FAST_TIMINGS: dict[str, Any] = {
    "lease_ttl": 2.0,
    "lease_heartbeat_interval": 0.2,
    "lease_reaper_interval": 0.2,
    "lease_publish_grace": 1.0,
    "lease_republish_after": 3.0,
    # Celery waits this long (default 10 s) before it reports a dead pool process, in
    # case the process sent its result first, and looks again only every 5 s; the
    # outcome is in the lease store, so report it at once
    "worker_lost_wait": 0.0,
}

_WORKERS = pytest.StashKey[list[LeaseWorker]]()
#: Names only this test's broker objects contain (its queue, its workers' host part).
_TOKENS = pytest.StashKey[set[str]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "lease_app",
        "the Celery app lease_worker runs, as `celery -A` takes it (e.g. proj.celery:app)",
    )
    parser.addini(
        "lease_database",
        "store of each test: 'sqlite' (default: a file in tmp_path) or a PostgreSQL URL, "
        "where each test gets a schema of its own (env CELERY_LEASE_TESTING_DATABASE wins)",
    )
    parser.addini(
        "lease_broker_url",
        "broker of the workers and the test (default: the app's own; env "
        "CELERY_LEASE_TESTING_BROKER_URL wins)",
    )
    parser.addini("lease_pool", "pool of lease_worker (default prefork)", default="prefork")
    parser.addini("lease_concurrency", "pool processes of lease_worker (default 1)", default="1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "lease_worker(pool=..., concurrency=..., env=...): options of the lease_worker fixture",
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.failed:
        workers = item.stash.get(_WORKERS, None)
        if workers:
            report.sections.append(("celery-lease worker logs (tail)", log_report(workers)))
    return report


# -- which app ------------------------------------------------------------------------------


_SPECS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def app_path(app: Any) -> str:
    """What ``celery -A`` takes to import ``app``: the ini option it came from, or a
    module holding it (the one named like the app first; test modules last)."""
    with contextlib.suppress(TypeError):
        if app in _SPECS:
            return _SPECS[app]
    found = []
    for name, module in list(sys.modules.items()):
        if name == "__main__" or module is None or not getattr(module, "__file__", None):
            continue
        with contextlib.suppress(Exception):
            found += [f"{name}:{attr}" for attr, value in vars(module).items() if value is app]
    if not found:
        raise pytest.UsageError(
            f"cannot find a module that holds {app!r}: make lease_app return 'module:attr'"
        )

    def rank(path: str) -> tuple[bool, bool, str]:
        module = path.split(":")[0]
        base = module.rsplit(".", 1)[-1]
        return module != getattr(app, "main", None), base.startswith(("test_", "conftest")), path

    return sorted(found, key=rank)[0]


@pytest.fixture
def lease_app(request: pytest.FixtureRequest) -> Any:
    """The Celery app under test: the ini option ``lease_app`` (``module:attr``), or
    override this fixture to return the app (or its ``module:attr``)."""
    spec = str(request.config.getini("lease_app") or "").strip()
    if not spec:
        raise pytest.UsageError(
            "celery-lease: say which Celery app to test: `lease_app = proj.celery:app` in "
            "the pytest configuration, or a `lease_app` fixture returning the app"
        )
    from celery.app.utils import find_app

    app = find_app(spec)
    _SPECS[app] = spec
    return app


# -- the store ------------------------------------------------------------------------------


def _setting(request: pytest.FixtureRequest, ini: str, env: str) -> str:
    return (os.environ.get(env) or str(request.config.getini(ini) or "")).strip()


@pytest.fixture
def lease_database(request: pytest.FixtureRequest) -> str:
    """``"sqlite"`` or the PostgreSQL URL this test's schema goes in."""
    return _setting(request, "lease_database", "CELERY_LEASE_TESTING_DATABASE") or "sqlite"


@pytest.fixture
def lease_queue() -> str:
    """A queue name of this test's own: a message left by another test is never consumed."""
    return f"lease-test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def lease_conf(
    lease_app: Any,
    lease_database: str,
    lease_queue: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> dict[str, Any]:
    """The ``app.conf`` settings this test's app and workers use (JSON values): this
    test's store and queue, the broker, and short timings (:data:`FAST_TIMINGS`).
    Override it to add yours: ``return {**lease_conf, "my_setting": 1}``."""
    conf: dict[str, Any] = dict(FAST_TIMINGS)
    if lease_database == "sqlite":
        conf["lease_database_url"] = f"sqlite:///{tmp_path / 'lease-store.sqlite3'}"
        conf["lease_schema"] = None
    elif lease_database.startswith("postgres"):
        conf["lease_database_url"] = lease_database
        conf["lease_schema"] = f"lease_test_{uuid.uuid4().hex[:12]}"
    else:
        raise pytest.UsageError(
            f"celery-lease: lease_database must be 'sqlite' or a PostgreSQL URL, "
            f"got {lease_database!r}"
        )
    broker = _setting(request, "lease_broker_url", "CELERY_LEASE_TESTING_BROKER_URL")
    conf["broker_url"] = broker or lease_app.conf.broker_url
    conf["task_default_queue"] = lease_queue
    return conf


@pytest.fixture
def lease_store(
    lease_app: Any, lease_conf: dict[str, Any], request: pytest.FixtureRequest
) -> Iterator[Store]:
    """A migrated store of this test's own, which ``lease_app`` uses in the test process
    until the test ends (its earlier settings are given back then). On a Redis broker,
    the binding keys the test's queue and workers added are removed afterwards: the
    broker is left as the test found it."""
    bindings = BindingKeys(str(lease_conf["broker_url"]))
    bindings.record()
    tokens = request.node.stash.setdefault(_TOKENS, set())
    tokens.add(str(lease_conf["task_default_queue"]))
    conf = lease_app.conf
    saved = {k: conf.changes[k] for k in lease_conf if k in conf.changes}
    conf.update(lease_conf)
    runtime(lease_app).reset()
    lease_app.close()  # a producer pool made for another broker must not be reused
    from ..config import from_mapping

    config: LeaseConfig = from_mapping(conf)
    store = Store(config)
    try:
        store.migrate()
        yield store
    finally:
        store.dispose()
        runtime(lease_app).reset()
        with contextlib.suppress(Exception):
            lease_app.close()
        for key in lease_conf:
            if key in saved:
                conf[key] = saved[key]
            else:
                conf.changes.pop(key, None)
        if config.schema is not None:
            store.drop_schema()
            store.dispose()
        bindings.restore(tokens)


# -- effects, crash points, workers --------------------------------------------------------


@pytest.fixture
def lease_effects(tmp_path: Path) -> SideEffects:
    """The side-effect counter; task code in the test's workers gets it from
    :func:`celery_lease.testing.side_effects`."""
    return SideEffects(tmp_path / "side-effects.sqlite3")


@pytest.fixture
def lease_crash(tmp_path: Path) -> CrashPoints:
    """The crash points this test arms (its workers watch them)."""
    return CrashPoints(tmp_path / "crash-points")


def _pythonpath() -> list[str]:
    """The test process's own import path (not the interpreter's), for the workers."""
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    out = []
    for entry in sys.path:
        if not entry or not os.path.isdir(entry):
            continue
        real = os.path.realpath(entry)
        if not any(real == p or real.startswith(p + os.sep) for p in prefixes):
            out.append(real)
    return list(dict.fromkeys(out))


@pytest.fixture
def lease_workers(
    lease_app: Any,
    lease_store: Store,
    lease_conf: dict[str, Any],
    lease_effects: SideEffects,
    lease_crash: CrashPoints,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> Iterator[Callable[..., LeaseWorker]]:
    """``lease_workers(name="w1", *, pool=None, concurrency=None, env=None, start=True,
    **options) -> LeaseWorker``: start a worker of the app on this test's store (and
    wait until it is ready). Every worker and every process it started is SIGKILLed at
    teardown; a failing test's report shows each worker's log tail."""
    made: list[LeaseWorker] = []
    request.node.stash[_WORKERS] = made
    app = lease_app if isinstance(lease_app, str) else app_path(lease_app)
    ini_pool = str(request.config.getini("lease_pool") or "prefork")
    ini_concurrency = int(str(request.config.getini("lease_concurrency") or "1"))
    host = f"lease-test-{uuid.uuid4().hex[:8]}"
    request.node.stash.setdefault(_TOKENS, set()).add(f"@{host}.")

    def start(
        name: str = "w1",
        *,
        pool: str | None = None,
        concurrency: int | None = None,
        env: dict[str, str] | None = None,
        start: bool = True,
        **options: Any,
    ) -> LeaseWorker:
        worker = LeaseWorker(
            app,
            store=lease_store,
            crash=lease_crash,
            run_dir=tmp_path / f"worker-{name}",
            conf=lease_conf,
            cwd=request.config.rootpath,
            env={EFFECTS_ENV: str(lease_effects.path), **(env or {})},
            pool=pool or ini_pool,
            concurrency=concurrency or ini_concurrency,
            # a host part of the test's own: brokers shared by concurrent test runs keep
            # one control queue per node name (RabbitMQ refuses a second one)
            nodename=options.pop("nodename", f"{name}@{host}"),
            pythonpath=_pythonpath(),
            **options,
        )
        made.append(worker)
        if start:
            worker.start()
            worker.wait_ready()
        return worker

    try:
        yield start
    finally:
        for worker in made:
            worker.terminate_now()
        _delete_queue(lease_conf)


def _delete_queue(conf: dict[str, Any]) -> None:
    """Best effort: drop the test's queue (and what a killed worker left in it)."""
    from kombu import Connection

    with contextlib.suppress(Exception), Connection(conf["broker_url"], connect_timeout=3) as conn:
        channel: Any = conn.default_channel
        channel.queue_delete(conf["task_default_queue"])


@pytest.fixture
def lease_worker(
    lease_workers: Callable[..., LeaseWorker], request: pytest.FixtureRequest
) -> LeaseWorker:
    """A started ``celery -A <lease_app> worker`` on this test's store (prefork, one
    pool process, unless ``@pytest.mark.lease_worker(pool=..., concurrency=...)`` or the
    ini options ``lease_pool`` / ``lease_concurrency`` say otherwise)."""
    marker = request.node.get_closest_marker("lease_worker")
    options = dict(marker.kwargs) if marker is not None else {}
    return lease_workers(**options)
