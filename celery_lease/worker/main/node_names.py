"""One live worker per node name: telling a restart from a live duplicate.

A worker that starts under a node name expires its dead predecessors' leases at
once (no TTL wait); a second live worker under the same name is refused, since the
two would expire each other's leases.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from ..._incarnation import Incarnation
from ...exceptions import ConfigurationError
from ...store import Store

logger = logging.getLogger("celery_lease.worker")


def pid_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs on this host (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # someone else's process: alive
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return False  # no /proc (not Linux): alive as far as we can tell
    return stat[stat.rindex(")") + 2 :].startswith(("Z", "X"))


def dead_predecessors(store: Store, inc: Incarnation, ttl: float, interval: float) -> list[str]:
    """The earlier incarnations under this node name that are gone, so their leases can
    be expired at once; raises :class:`ConfigurationError` if one is alive.

    A restart under the same name must expire its dead predecessor's leases at once
    (no TTL wait), but a second live worker started under the same name must not:
    its tasks are running. An incarnation is gone when its heartbeat is older than
    the TTL (the reaper would expire it anyway), or when it ran on this host with a
    pid that is gone now (or is ours: a container restarted under the same host name
    starts at the same pid). One on another host with a fresh heartbeat is watched
    for up to a TTL: alive if its heartbeat moves, gone if it ages past the TTL.
    """
    dead: list[str] = []
    watched: dict[str, Any] = {}
    deadline = time.monotonic() + ttl + interval
    while True:
        alive = []
        for peer in store.peers(inc.nodename, inc.id):
            if peer.id in dead:
                continue
            if peer.heartbeat_age > ttl:
                dead.append(peer.id)
            elif peer.hostname == inc.hostname:
                if peer.pid == inc.pid or pid_gone(peer.pid):
                    dead.append(peer.id)
                else:
                    alive.append((peer, f"pid {peer.pid} is running on this host"))
            elif peer.id in watched and watched[peer.id] != peer.heartbeat_at:
                alive.append((peer, "its heartbeat is being renewed"))
            else:
                watched.setdefault(peer.id, peer.heartbeat_at)
        if alive:
            peer, why = alive[0]
            raise ConfigurationError(
                f"another worker named {inc.nodename} is running (incarnation {peer.id} on "
                f"host {peer.hostname}, pid {peer.pid}, heartbeat {peer.heartbeat_age:.1f} s "
                f"ago: {why}); two live workers under one name would expire each other's "
                "leases: give each worker a unique name (celery worker -n)"
            )
        pending = [w for w in watched if w not in dead]
        if not pending:
            return dead
        if time.monotonic() >= deadline:
            return dead + pending  # not renewed for a whole TTL: gone
        logger.warning(
            "worker %s: an earlier incarnation on another host has a fresh heartbeat; "
            "waiting up to %.1f s to tell a restart from a live duplicate",
            inc.nodename,
            deadline - time.monotonic(),
        )
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))


__all__ = ["dead_predecessors", "pid_gone"]
