"""A worker incarnation and the flags its main process shares with its pool children.

Lowest of the worker layers: the runtime records the incarnation, the heartbeat
raises its flags, the task reads them at each step boundary.
"""

from __future__ import annotations

import mmap
import struct
import time
from datetime import datetime


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
        self._mem = mmap.mmap(-1, 24)

    @property
    def fenced(self) -> bool:
        if self._mem[0] == 1:
            return True
        deadline = self.deadline
        return deadline > 0 and time.monotonic() >= deadline

    @fenced.setter
    def fenced(self, value: bool) -> None:
        self._mem[0] = 1 if value else 0

    def claimable(self, interval: float) -> bool:
        """Whether a claim may be made now: not fenced, and the heartbeat's deadline far
        enough away that the next renewal (every ``interval`` seconds) can land before
        the new lease could lapse: at least ``min(interval, ttl - interval)`` seconds,
        which a heartbeat renewing on time always leaves. A claim made just before the
        deadline passes would be expired by any reaper as soon as it is made and its
        run repeated; its delivery waits for the next heartbeat instead."""
        if self._mem[0] == 1:
            return False
        deadline = self.deadline
        if deadline <= 0:
            return True
        margin = max(0.0, min(interval, self.ttl - interval))
        return time.monotonic() < deadline - margin

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

    @property
    def ttl(self) -> float:
        """The heartbeat's TTL: how far each renewal moves the deadline."""
        return float(self._DEADLINE.unpack_from(self._mem, 16)[0])

    @ttl.setter
    def ttl(self, value: float) -> None:
        self._DEADLINE.pack_into(self._mem, 16, value)


class Incarnation:
    """One start of one worker: a fresh id, with host and pid for humans."""

    def __init__(self, worker_id: str, nodename: str, hostname: str, pid: int) -> None:
        self.id = worker_id
        self.nodename = nodename
        self.hostname = hostname
        self.pid = pid
        self.flags = SharedFlags()
        #: When its row was registered, by the database's clock (set once registered):
        #: the heartbeat registers it again as it was should a failover lose the row.
        self.registered_at: datetime | None = None

    @property
    def actor(self) -> str:
        return f"worker:{self.nodename}"
