"""What a worker's main process and its pool processes hand each other.

The one module both sides import; neither side imports the other. Besides the
incarnation and its shared flags (:mod:`celery_lease._incarnation`, inherited at the
fork), there are two hand-offs:

- **A claim**, lease agent to pool process: the worker's lease agent
  (:mod:`celery_lease.worker.main.agent`, a process of its own) claims the
  deliveries the main process reserved; a pool process asks it for its delivery's
  claim as the task starts (:func:`ask_claim`, over a sequenced-packet Unix socket
  in Linux's abstract namespace, :func:`agent_address`) and runs under the answer,
  or claims for itself when the answer is "not claimed".
- **An outcome**, pool process to main process: one datagram on a Unix socket pair
  made before the pool forks (:class:`OutcomeChannel`), so every child inherits the
  sending end. A datagram is queued whole or not at all (a child killed mid-send
  leaves nothing half-written, and holds no lock), and once ``send`` returns the
  outcome is in the kernel's queue of the main process, which outlives the child. The
  queue is bounded (the socket's send buffer): when the main process's writer stops
  reading, the children's hand-over blocks, holding the pool back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from typing import Any

from celery import Celery

from .._apps import AppRegistry
from .._incarnation import Incarnation
from ..states import State
from ..store import Claim, Lease, Outcome

logger = logging.getLogger("celery_lease")

# -- a claim: the lease agent -> pool process ----------------------------------------

#: The lease agent's address for each app's worker (inherited by its pool children).
_agents: AppRegistry[bytes] = AppRegistry()
#: This process's (this thread's) connection to the agent: (pid, address, socket).
_agent_conn = threading.local()


def agent_address(inc: Incarnation) -> bytes:
    """The lease agent's socket: in Linux's abstract namespace (no file to clean up),
    named by the incarnation."""
    return b"\0celery-lease-agent-" + inc.id.encode()


def use_agent(app: Celery, address: bytes | None) -> None:
    """Send this worker's pool processes to the agent at ``address`` for their claims
    (``None``: there is none, or it is gone: each claims for itself)."""
    if address is None:
        if _agents.get(app) is not None:
            del _agents[app]
    else:
        _agents[app] = address


def encode_claim(claim: Claim | None) -> bytes:
    """The agent's answer to an ask: the claim, or ``N`` (claim it yourself)."""
    if claim is None:
        return b"N"
    lease = claim.lease
    return "\x1f".join(
        (
            "C",
            lease.task_id,
            str(lease.attempt),
            lease.token,
            str(claim.retries),
            str(claim.recoveries),
            "1" if claim.resumed else "0",
            "1" if claim.cancel_requested else "0",
        )
    ).encode()


def decode_claim(data: bytes, task_id: str) -> Claim | None:
    fields = data.decode().split("\x1f")
    if fields[0] != "C" or fields[1] != task_id:
        return None
    return Claim(
        lease=Lease(task_id, int(fields[2]), fields[3]),
        retries=int(fields[4]),
        recoveries=int(fields[5]),
        resumed=fields[6] == "1",
        cancel_requested=fields[7] == "1",
    )


class _AgentConnection:
    """One thread's connection to the lease agent; closed when the thread ends (its
    thread-local value is dropped) or when the thread connects to another agent."""

    __slots__ = ("address", "pid", "sock")

    def __init__(self, address: bytes, sock: socket.socket) -> None:
        self.pid = os.getpid()
        self.address = address
        self.sock = sock

    def close(self) -> None:
        # a forked child closing its copy of the descriptor leaves its parent's open
        with contextlib.suppress(OSError):
            self.sock.close()

    def __del__(self) -> None:
        self.close()


def _connection(address: bytes) -> socket.socket | None:
    conn: _AgentConnection | None = getattr(_agent_conn, "value", None)
    if conn is not None and conn.pid == os.getpid() and conn.address == address:
        return conn.sock
    _drop_connection()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(address)
    except OSError:
        sock.close()
        return None
    _agent_conn.value = _AgentConnection(address, sock)
    return sock


def _drop_connection() -> None:
    conn: _AgentConnection | None = getattr(_agent_conn, "value", None)
    _agent_conn.value = None
    if conn is not None:
        conn.close()


def ask_claim(app: Celery, task_id: str, timeout: float) -> Claim | None:
    """Ask the worker's lease agent for the claim of ``task_id`` (a pool process, as
    the task starts, before any of its code runs): the claim it made ahead, or one it
    makes now with the other asks of the moment. ``None``: the caller claims for
    itself (no agent, the agent did not claim it, or did not answer in ``timeout``
    seconds; then it is told to give back a claim it makes later)."""
    address = _agents.get(app)
    if address is None:
        return None
    sock = _connection(address)
    if sock is None:
        return None
    try:
        sock.settimeout(timeout)
        sock.send(b"A\x1f" + task_id.encode())
        data = sock.recv(512)
    except TimeoutError:
        with contextlib.suppress(OSError):
            sock.send(b"X\x1f" + task_id.encode())
        _drop_connection()  # a late answer must not be read as the next one's
        logger.warning("task %s: the lease agent did not answer: claimed here", task_id)
        return None
    except OSError:
        _drop_connection()
        return None
    if not data:
        _drop_connection()
        return None
    return decode_claim(data, task_id)


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
                outcome.held,
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
        (task_id, attempt, token, to, reason, result, error, name, delay, message, held, at) = (
            json.loads(blob)
        )
        lease = Lease(str(task_id), int(attempt), str(token))
        outcome = Outcome(
            lease, State(to), str(reason), result, error, float(delay), message, bool(held)
        )
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
    holds_slot: bool = False,
) -> bool:
    """Hand a pool process's outcome to its worker's main process; ``False``: the
    caller writes it itself (write-through).

    Written through: outcomes other than SUCCEEDED, CANCELLED and a retry carrying its
    message, every outcome with ``lease_outcome_write_through`` (no channel is open),
    a self-fenced worker's (its leases are being expired), the outcome of an attempt
    that ``holds_slot`` (its claim took a concurrency slot: the outcome frees it, and
    must be committed before this pool process takes its next delivery, whose claim
    would otherwise find the slot still taken, wait, and go through the broker again
    once the batch is written; if the database does not answer, the pool process
    hands it over after all, with ``holds_slot`` false), the final outcome of a task
    with callbacks, a chain or a chord (its follow-ups are recorded with the outcome
    and published right after it, by the pool process, so the row must be final first,
    or a worker lost with the outcome buffered would run them again; a retry runs none
    of them: see :mod:`celery_lease.producer.follow_ups`), and a task run in the
    worker's main process itself (solo and threads pools, and
    ``celery.contrib.pytest``'s in-process worker): there the caller that sees
    Celery's result may read the row next, and it must be final.
    """
    if outcome.to not in HANDED_OVER or fenced or holds_slot:
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
    "HANDED_OVER",
    "MAX_HAND_OVER",
    "OutcomeChannel",
    "agent_address",
    "ask_claim",
    "decode_claim",
    "encode_claim",
    "hand_over",
    "use_agent",
]
