"""Leave a Redis broker as a test found it: the binding keys kombu leaves behind.

kombu's Redis transport keeps each exchange's bindings in sets
(``_kombu.binding.<exchange>``, ``_kombu.binding_permanent.<exchange>``) and the
deadlines of expiring ones in a sorted set (``_kombu.binding_deadlines``). Declaring a
queue adds members; deleting the queue removes them only through the channel that
declared it, and a worker that is SIGKILLed removes nothing. So a test's queue and its
workers' control queues would stay bound, test after test, in the user's Redis.

:class:`BindingKeys` records the ``_kombu.*`` keys before a test and afterwards removes
what the test added, and only that: the members naming one of the test's own
``tokens`` (its queue name, its workers' host names: unique per test), and the
deadlines that came with them. Another test's bindings, or the application's, are
never touched, even when they share a key. Nothing is done for other transports.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

#: What kombu's Redis transport names its binding keys with.
PREFIX = "_kombu.binding"
DEADLINES = "_kombu.binding_deadlines"


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class BindingKeys:
    """The binding keys of a Redis broker as they were when :meth:`record` ran."""

    def __init__(self, broker_url: str) -> None:
        self.broker_url = broker_url
        self.before: dict[str, set[str]] | None = None

    def _client(self, conn: Any) -> Any | None:
        """The Redis client of ``conn`` (``None``: not a Redis broker)."""
        if conn.transport.driver_type != "redis":
            return None
        return conn.default_channel.client

    def _read(self, client: Any) -> dict[str, set[str]]:
        found: dict[str, set[str]] = {}
        for raw in client.scan_iter(match=f"{PREFIX}*", count=1000):
            key = _text(raw)
            kind = _text(client.type(key))
            if kind == "set":
                found[key] = {_text(m) for m in client.smembers(key)}
            elif kind == "zset":
                found[key] = {_text(m) for m in client.zrange(key, 0, -1)}
        return found

    def record(self) -> None:
        """Remember the binding keys and their members now (best effort)."""
        from kombu import Connection

        with contextlib.suppress(Exception), Connection(self.broker_url, connect_timeout=3) as c:
            client = self._client(c)
            if client is not None:
                self.before = self._read(client)

    def restore(self, tokens: Iterable[str]) -> None:
        """Remove the bindings added since :meth:`record` that name one of ``tokens``,
        then the deadlines of binding tables no longer there (best effort)."""
        from kombu import Connection

        before = self.before
        mine = [t for t in tokens if t]
        if before is None or not mine:
            return
        with contextlib.suppress(Exception), Connection(self.broker_url, connect_timeout=3) as c:
            client = self._client(c)
            if client is None:
                return
            now = self._read(client)
            joined = set()  # exchanges another process bound a queue to meanwhile
            for key, members in now.items():
                if key == DEADLINES:
                    continue
                added = members - before.get(key, set())
                ours = [m for m in added if any(t in m for t in mine)]
                if ours:
                    client.srem(key, *ours)
                if len(ours) < len(added):
                    joined.add(key.removeprefix(f"{PREFIX}.").removeprefix(f"{PREFIX}_permanent."))
            # a deadline is per exchange: it is the test's if it came with the test's
            # bindings and nobody else's (another process's refresh adds it back anyway)
            for exchange in now.get(DEADLINES, set()) - before.get(DEADLINES, set()):
                if exchange not in joined:
                    client.zrem(DEADLINES, exchange)


__all__ = ["BindingKeys"]
