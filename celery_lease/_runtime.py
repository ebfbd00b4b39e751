"""Per-app runtime: installation, settings, the store (one per process), the worker
incarnation and the record of the app's leased tasks (for the shortest TTL).

Everything here sits below the task, the worker and the reaper: it names the
worker's bootstep and the reaper's task by their dotted paths, never by import.
"""

from __future__ import annotations

import getpass
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

from celery import Celery

from . import config as _config
from ._apps import AppRegistry, real_app
from ._broker import bound_sockets
from ._incarnation import Incarnation, SharedFlags
from .notify import attach
from .pause import PauseCache
from .store import Store

#: The worker bootstep celery-lease adds (by path: the worker module sits above this one).
WORKER_STEP = "celery_lease.worker.main.bootstep:LeaseStep"
#: The beat entry that runs the reaper (it acts only where ``celery beat`` runs).
BEAT_ENTRY = "celery-lease-reap"

_install_lock = threading.Lock()
_runtimes: AppRegistry[Runtime] = AppRegistry()
_lock = threading.Lock()


class Runtime:
    """celery-lease state attached to one Celery app (created on first use)."""

    def __init__(self, app: Celery) -> None:
        # weakly: the registry's entry (and the store with its connections and threads)
        # goes when the app does (Celery's pytest fixtures make an app per test)
        self._app = weakref.ref(app)
        self.installed = False
        self.incarnation: Incarnation | None = None
        #: Names of the app's leased tasks (recorded as each binds to the app).
        self.leased: set[str] = set()
        self._config: _config.LeaseConfig | None = None
        self._store: Store | None = None
        self._store_pid = 0
        self._lock = threading.Lock()
        self._pauses: PauseCache | None = None
        #: Called with each store this process makes (the layers above add theirs).
        self._store_hooks: list[Callable[[Celery, Store], None]] = []

    @property
    def app(self) -> Celery:
        app = self._app()
        if app is None:
            raise RuntimeError("the app of this runtime is gone")
        return app

    @property
    def pauses(self) -> PauseCache:
        """What is paused, as this process last read it (see :mod:`celery_lease.pause`)."""
        if self._pauses is None:
            self._pauses = PauseCache(self.config.heartbeat_interval)
        return self._pauses

    @property
    def config(self) -> _config.LeaseConfig:
        if self._config is None:
            self._config = _config.from_mapping(self.app.conf)
        return self._config

    @property
    def store(self) -> Store:
        """This process's store; the schema is checked (SQLite: created) on first use."""
        store = self._store
        if store is None:
            with self._lock:
                if self._store is None:
                    created = Store(self.config)
                    created.ensure_schema()
                    # logs, result backend and Flower events for every transition it commits
                    attach(self.app, created)
                    for hook in self._store_hooks:
                        hook(self.app, created)
                    self._store = created
                    self._store_pid = os.getpid()
                store = self._store
        return store

    def add_store_hook(self, hook: Callable[[Celery, Store], None]) -> None:
        """Call ``hook(app, store)`` with this process's store, made now or later (once
        per hook): how a layer above this one (the concurrency slots' grants) attaches
        to the store without this module importing it."""
        with self._lock:
            if hook in self._store_hooks:
                return
            self._store_hooks.append(hook)
            store = self._store
        if store is not None:
            hook(self.app, store)

    def shortest_ttl(self) -> float:
        """The worker's self-fence limit: the shortest lease TTL among the default and
        the app's leased tasks, each task's options checked first.

        The heartbeat is one per worker, so the fence is too: after that long without a
        renewal the shortest lease it may hold can have been taken over, and the worker
        cannot tell which of its leases that is. Only checked values take part: a task
        whose options are invalid raises :class:`ConfigurationError` (naming the task
        and the option) and the worker refuses to start, so no invalid value can become
        every task's fence. A valid short TTL does fence the worker's other tasks
        sooner during an outage; route such tasks to workers of their own when that
        matters (see ``docs/settings.md``, ``lease_ttl``).
        """
        ttls = [self.config.ttl]
        for name in sorted(self.leased):
            options = getattr(self.app.tasks.get(name), "lease_options", None)
            if options is not None:
                ttls.append(float(options(self.config).lease_ttl))
        return min(ttls)

    def reset(self) -> None:
        """Forget settings and the store (tests; after changing ``app.conf``)."""
        with self._lock:
            if self._store is not None:
                self._store.dispose()
            self._store = None
            self._config = None


def runtime(app: Celery) -> Runtime:
    """The runtime of ``app`` (created on first call)."""
    rt = _runtimes.get(app)
    if rt is None:
        with _lock:
            rt = _runtimes.get(app)
            if rt is None:
                rt = _runtimes[app] = Runtime(real_app(app))
    return rt


def install(app: Celery) -> Runtime:
    """Hook celery-lease into ``app`` (idempotent).

    Called automatically when a ``LeasedTask`` binds to the app; call it yourself
    only to install before any leased task is defined. Adds the worker bootstep,
    the beat entry for the reaper and the signal handlers.
    """
    rt = runtime(app)
    with _install_lock:
        if rt.installed:
            return rt
        rt.installed = True
    app.steps["worker"].add(WORKER_STEP)
    if getattr(app, "configured", False):
        _configured(app)
    else:
        app.on_after_configure.connect(_on_configured, weak=False)
    return rt


def _on_configured(sender: Celery, **kwargs: Any) -> None:
    if runtime(sender).installed:
        _configured(sender)


def _configured(app: Celery) -> None:
    """What installing needs of a configured app: the reaper's beat entry, and broker
    connections that give up on a broker that stopped answering (see :mod:`._broker`)."""
    _add_beat_entry(app)
    bound_sockets(app, _config.from_mapping(app.conf).db_timeout)


def _add_beat_entry(app: Celery) -> None:
    cfg = _config.from_mapping(app.conf)
    if BEAT_ENTRY not in (app.conf.beat_schedule or {}):
        app.add_periodic_task(
            cfg.reaper_interval,
            app.signature("celery_lease.reap"),
            name=BEAT_ENTRY,
            expires=max(cfg.reaper_interval, 1.0),
        )


def default_actor() -> str:
    """The OS user, for operator actions without an explicit actor."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid:{os.getuid()}"


__all__ = [
    "BEAT_ENTRY",
    "Incarnation",
    "Runtime",
    "SharedFlags",
    "default_actor",
    "install",
    "runtime",
]
