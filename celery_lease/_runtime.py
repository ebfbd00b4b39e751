"""Per-app runtime: settings, the store (one per process), the worker incarnation."""

from __future__ import annotations

import getpass
import mmap
import os
import struct
import threading
import time
import weakref
from typing import TYPE_CHECKING

from celery import Celery

from . import config as _config
from .notify import attach
from .store import Store

if TYPE_CHECKING:
    from .pause import PauseCache
    from .worker import WorkerService

_runtimes: weakref.WeakKeyDictionary[Celery, Runtime] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class SharedFlags:
    """A few bytes shared by a worker's main process and its (forked) pool children.

    Anonymous shared memory is inherited across ``fork``: the main process sets the
    fence flag when it cannot renew its heartbeat, and every child sees it at its
    next step boundary without a database round trip.

    It also holds the heartbeat's deadline: the monotonic time (system-wide, so the
    same clock in every process) by which the next renewal must succeed. Past it the
    worker is fenced even if the heartbeat thread never got to say so: a renewal stuck
    in a connect timeout, or a main process frozen while its children run, cannot
    keep a lease alive past its TTL.
    """

    _DEADLINE = struct.Struct("d")

    def __init__(self) -> None:
        self._mem = mmap.mmap(-1, 16)

    @property
    def fenced(self) -> bool:
        if self._mem[0] == 1:
            return True
        deadline = self.deadline
        return deadline > 0 and time.monotonic() >= deadline

    @fenced.setter
    def fenced(self, value: bool) -> None:
        self._mem[0] = 1 if value else 0

    @property
    def raised(self) -> bool:
        """Whether the heartbeat thread itself raised the flag (the deadline aside)."""
        return self._mem[0] == 1

    @property
    def deadline(self) -> float:
        """Monotonic time past which the leases are lost (0: no deadline yet)."""
        return float(self._DEADLINE.unpack_from(self._mem, 8)[0])

    @deadline.setter
    def deadline(self, value: float) -> None:
        self._DEADLINE.pack_into(self._mem, 8, value)


class Incarnation:
    """One start of one worker: a fresh id, with host and pid for humans."""

    def __init__(self, worker_id: str, nodename: str, hostname: str, pid: int) -> None:
        self.id = worker_id
        self.nodename = nodename
        self.hostname = hostname
        self.pid = pid
        self.flags = SharedFlags()

    @property
    def actor(self) -> str:
        return f"worker:{self.nodename}"


class Runtime:
    """celery-lease state attached to one Celery app (created on first use)."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.installed = False
        self.incarnation: Incarnation | None = None
        self.service: WorkerService | None = None
        self._config: _config.LeaseConfig | None = None
        self._store: Store | None = None
        self._store_pid = 0
        self._lock = threading.Lock()
        self._pauses: PauseCache | None = None

    @property
    def pauses(self) -> PauseCache:
        """What is paused, as this process last read it (see :mod:`celery_lease.pause`)."""
        if self._pauses is None:
            from .pause import PauseCache

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
                    self._store = created
                    self._store_pid = os.getpid()
                store = self._store
        return store

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
                rt = _runtimes[app] = Runtime(app)
    return rt


def default_actor() -> str:
    """The OS user, for operator actions without an explicit actor."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid:{os.getuid()}"
