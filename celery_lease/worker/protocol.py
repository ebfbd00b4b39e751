"""What a worker's main process and its pool processes hand each other.

The one module both sides import; neither side imports the other. Besides the
incarnation and its shared flags (:mod:`celery_lease._incarnation`, inherited at the
fork), there are two hand-offs:

- **A claim made ahead**, main process to pool process: the main process claims a
  reserved delivery (``lease_claim_ahead``) and puts the claim in the request it
  hands to the pool (:data:`CLAIM_KEY`, written by :func:`claim_header`); the pool
  process takes it off the request (:func:`claimed_ahead`) and runs under it.
- **An outcome**, pool process to main process: one datagram on a Unix socket pair
  made before the pool forks (:class:`OutcomeChannel`), so every child inherits the
  sending end. A datagram is queued whole or not at all (a child killed mid-send
  leaves nothing half-written, and holds no lock), and once ``send`` returns the
  outcome is in the kernel's queue of the main process, which outlives the child. The
  queue is bounded (the socket's send buffer): when the main process's writer stops
  reading, the children's hand-over blocks, holding the pool back.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any

from celery import Celery

from .._apps import AppRegistry
from .._incarnation import Incarnation
from ..states import State
from ..store import Claim, Lease, Outcome

logger = logging.getLogger("celery_lease")

# -- a claim made ahead: main process -> pool process ---------------------------------

#: The request key that carries a claim made ahead to the pool process.
CLAIM_KEY = "lease_claim"


def claim_header(claim: Claim, inc: Incarnation) -> dict[str, Any]:
    """A claim as the request carries it to the pool process."""
    return {
        "owner": inc.id,
        "task_id": claim.lease.task_id,
        "attempt": claim.lease.attempt,
        "token": claim.lease.token,
        "retries": claim.retries,
        "recoveries": claim.recoveries,
        "resumed": claim.resumed,
        "cancel_requested": claim.cancel_requested,
    }


def claimed_ahead(request: Any, inc: Incarnation, task_id: str, enabled: bool) -> Claim | None:
    """The claim the main process made ahead for this delivery (``None``: the pool
    process claims it). Taken off the request, so that nothing Celery builds from the
    request (a retry's message) carries it; only ever trusted from a worker that claims
    ahead (``enabled``), whose main process removes any such key a message brings."""
    found = vars(request).pop(CLAIM_KEY, None)
    if not enabled or not isinstance(found, dict):
        return None
    if found.get("owner") != inc.id or found.get("task_id") != task_id:
        return None  # not this worker's claim for this delivery: claim it here
    return Claim(
        lease=Lease(task_id, int(found["attempt"]), str(found["token"])),
        retries=int(found["retries"]),
        recoveries=int(found["recoveries"]),
        resumed=bool(found["resumed"]),
        cancel_requested=bool(found["cancel_requested"]),
    )


# -- an outcome: pool process -> main process -----------------------------------------

#: Outcomes handed to the main process instead of being written by the pool process.
#: FAILED stays write-through: Celery reports FAILURE (result backend, ``link_error``,
#: a chord's error) in the child right after the outcome, and nothing may say FAILURE
#: unless the row is FAILED, even for a worker lost with the outcome buffered.
HANDED_OVER = frozenset({State.SUCCEEDED, State.CANCELLED, State.RETRY_WAIT})

#: Send buffer of the hand-over socket: room for a few hundred outcomes.
_SEND_BUFFER = 1 << 20
#: Largest outcome handed over (a result of the default ``lease_result_max_bytes``, 64
#: KiB, fits); a larger one is written by the pool process itself.
MAX_HAND_OVER = 256 * 1024

#: The open channel of each app's worker (inherited by its pool children).
_channels: AppRegistry[OutcomeChannel] = AppRegistry()


class OutcomeChannel:
    """The hand-over socket pair of one worker, opened in its main process before the
    pool forks: the children :meth:`send`, the main process's writer reads
    :attr:`receiving` and :meth:`decode` s what it reads."""

    def __init__(self, app: Celery, timeout: float) -> None:
        self.receiving, self._sending = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sending.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
        self._sending.settimeout(timeout)
        self.receiving.setblocking(False)
        #: the worker's main process (the pool processes are forked from it)
        self.owner = os.getpid()
        #: set by :meth:`close`: later outcomes of this process are written through
        self.closed = False
        self._app = app
        _channels[app] = self

    def send(self, outcome: Outcome, task_name: str) -> bool:
        """Give ``outcome`` to the main process; ``False`` when it could not be (too
        large for one datagram, the main process gone or stuck past the timeout): the
        caller then writes it itself."""
        lease = outcome.lease
        blob = json.dumps(
            [
                lease.task_id,
                lease.attempt,
                lease.token,
                outcome.to.value,
                outcome.reason,
                outcome.result,
                outcome.error,
                task_name,
                outcome.delay,
                outcome.message,
                time.monotonic(),  # the system's clock: the same in every process
            ],
            separators=(",", ":"),
        ).encode()
        if len(blob) > MAX_HAND_OVER:
            return False
        try:
            self._sending.send(blob)
        except OSError as error:  # EMSGSIZE, a timeout (socket.timeout is an OSError)
            logger.warning(
                "task %s[%s]: outcome not handed to the writer (%s): written directly",
                task_name,
                lease.task_id,
                error,
            )
            return False
        return True

    @staticmethod
    def decode(blob: bytes | bytearray) -> tuple[Outcome, str, float]:
        """An outcome as :meth:`send` sent it: the outcome, its task's name, and when
        it was handed over (``time.monotonic()`` in the child).

        Raises:
            ValueError, TypeError: not a hand-over (never from our own children).
        """
        (task_id, attempt, token, to, reason, result, error, name, delay, message, at) = json.loads(
            blob
        )
        lease = Lease(str(task_id), int(attempt), str(token))
        outcome = Outcome(lease, State(to), str(reason), result, error, float(delay), message)
        return outcome, str(name), float(at)

    def retire(self) -> None:
        """Take no more hand-overs: this process's later outcomes are written through
        (what was sent before can still be read)."""
        self.closed = True
        if _channels.get(self._app) is self:
            del _channels[self._app]

    def close(self) -> None:
        """Retire the channel and close both ends (the main process, at shutdown)."""
        self.retire()
        self.receiving.close()
        self._sending.close()


def hand_over(
    app: Celery,
    request: Any,
    fenced: bool,
    task_name: str,
    outcome: Outcome,
) -> bool:
    """Hand a pool process's outcome to its worker's main process; ``False``: the
    caller writes it itself (write-through).

    Written through: outcomes other than SUCCEEDED, CANCELLED and a retry carrying its
    message, every outcome with ``lease_outcome_write_through`` (no channel is open),
    a self-fenced worker's (its leases are being expired), the final outcome of a task
    with callbacks, a chain or a chord (its follow-ups are recorded with the outcome
    and published right after it, by the pool process, so the row must be final first,
    or a worker lost with the outcome buffered would run them again; a retry runs none
    of them: see :mod:`celery_lease.producer.follow_ups`), and a task run in the
    worker's main process itself (solo and threads pools, and
    ``celery.contrib.pytest``'s in-process worker): there the caller that sees
    Celery's result may read the row next, and it must be final.
    """
    if outcome.to not in HANDED_OVER or fenced:
        return False
    retry = outcome.to is State.RETRY_WAIT
    if retry and outcome.message is None:
        return False
    channel = _channels.get(app)
    if channel is None or channel.closed or os.getpid() == channel.owner:
        return False
    if not retry and (request.chord or request.callbacks or request.errbacks or request.chain):
        return False
    return channel.send(outcome, task_name)


__all__ = [
    "CLAIM_KEY",
    "HANDED_OVER",
    "MAX_HAND_OVER",
    "OutcomeChannel",
    "claim_header",
    "claimed_ahead",
    "hand_over",
]
