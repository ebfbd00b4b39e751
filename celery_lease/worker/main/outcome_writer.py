"""The outcome writer: executions' outcomes leave the pool's critical path in batches.

A pool child that finishes a task hands its outcome (SUCCEEDED, CANCELLED, or a
retry with its message, fenced by the execution's attempt and token) to the worker's
main process and goes on to its next task; the main process writes the outcomes that
arrived together in one statement (:meth:`~celery_lease.store.Store.finish_many`,
:meth:`~celery_lease.store.Store.retry_many`), then publishes the retries' messages,
each with what is left of its countdown: a retry's message goes out only once its
row is PENDING, as when the pool process wrote it.

The hand-over is one datagram on a Unix socket pair created before the pool forks,
so every child inherits the sending end: a datagram is queued whole or not at all
(a child killed mid-send leaves nothing half-written, and holds no lock), and once
``send`` returns the outcome is in the kernel's queue of the main process, which
outlives the child. The queue is bounded (the socket's send buffer) and so is the
writer's own buffer: when the database is slow or down the writer stops reading,
the queue fills, and the children's hand-over blocks, holding the pool back rather
than growing memory.

What a buffered outcome costs if the whole worker dies before it is written: the
row is still RUNNING under the dead worker's heartbeat, so its lease expires after
the TTL (at once if the worker restarts under the same name) and the task re-runs,
skipping every recorded step (crash-point matrix rows 7 and 20). For a buffered retry
that re-run is the retry, counted as a recovery. A retry written whose message the
writer could not publish (broker down, or the worker lost between the commit and
the publish) is an unpublished PENDING row: the reaper publishes it after
``lease_publish_grace`` (matrix row 1).

Written before the worker gives up its heartbeat row (shutdown), and before the main
process expires the lease of a child it saw die (the child may have handed its
outcome over just before).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import select
import socket
import threading
import time
from typing import Any

from celery import Celery

from ..._apps import AppRegistry
from ..._crashpoints import crash_point
from ...exceptions import StoreError
from ...producer import message as _message
from ...states import State
from ...store import Lease, Outcome, Store

logger = logging.getLogger("celery_lease")

#: Outcomes handed to the writer instead of being written by the pool process. FAILED
#: stays write-through: Celery reports FAILURE (result backend, ``link_error``, a
#: chord's error) in the child right after the outcome, and nothing may say FAILURE
#: unless the row is FAILED, even for a worker lost with the outcome buffered.
HANDED_OVER = frozenset({State.SUCCEEDED, State.CANCELLED, State.RETRY_WAIT})

#: Longest the writer sleeps, with a batch pending, before it reads what arrived and
#: checks the batch's size again (its age is checked when it is due).
_GLANCE = 0.01

#: Send buffer of the hand-over socket: room for a few hundred outcomes.
_SEND_BUFFER = 1 << 20
#: Largest outcome handed over (a result of the default ``lease_result_max_bytes``, 64
#: KiB, fits); a larger one is written by the pool process itself.
MAX_HAND_OVER = 256 * 1024

_writers: AppRegistry[OutcomeWriter] = AppRegistry()


def writer_for(app: Celery) -> OutcomeWriter | None:
    """The outcome writer of this app's worker (inherited by its pool children)."""
    return _writers.get(app)


class OutcomeWriter:
    """The hand-over channel (both ends) and the writer thread of one worker.

    Created in the worker's main process before the pool forks; the children use
    :meth:`hand_over` only, the main process runs the thread and :meth:`flush`.
    """

    def __init__(
        self,
        app: Celery,
        store: Store,
        actor: str,
        *,
        batch_size: int,
        flush_interval: float,
        buffer: int,
        hand_over_timeout: float,
    ) -> None:
        self.store = store
        self.actor = actor
        self.batch_size = batch_size
        self.flush_interval = flush_interval
        self.capacity = max(buffer, batch_size)
        self._recv, self._send = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._send.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
        self._send.settimeout(hand_over_timeout)
        self._recv.setblocking(False)
        #: the worker's main process (the pool processes are forked from it)
        self.owner = os.getpid()
        # read into one buffer, larger than any hand-over (never truncated)
        self._chunk = bytearray(2 * MAX_HAND_OVER)
        #: guards the buffer and reading the socket (short holds)
        self._lock = threading.Lock()
        #: held while a batch is written: one write at a time, in arrival order
        self._write_lock = threading.Lock()
        self._buffer: collections.deque[_Buffered] = collections.deque()
        self._oldest = 0.0
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name="celery-lease-outcomes", daemon=True
        )
        #: outcomes written, and outcomes rejected because the lease was lost
        self.written = 0
        self.rejected = 0
        #: retries written whose message this writer could not publish (the reaper does)
        self.unpublished = 0
        #: set by :meth:`close`: later outcomes of this process are written through
        self.closed = False
        self._app = app
        _writers[app] = self

    # -- the pool side -------------------------------------------------------------

    def hand_over(self, outcome: Outcome, task_name: str) -> bool:
        """Give ``outcome`` to the main process's writer; ``False`` when it could not be
        (too large for one datagram, the writer gone or stuck past the timeout): the
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
            self._send.send(blob)
        except OSError as error:  # EMSGSIZE, a timeout (socket.timeout is an OSError)
            logger.warning(
                "task %s[%s]: outcome not handed to the writer (%s): written directly",
                task_name,
                lease.task_id,
                error,
            )
            return False
        return True

    # -- the main process ------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def _drain(self) -> None:
        """Move what the children sent into the buffer, up to its capacity (lock held)."""
        while len(self._buffer) < self.capacity:
            try:
                size = self._recv.recv_into(self._chunk)
            except (BlockingIOError, InterruptedError):
                return
            blob = self._chunk[:size]
            try:
                (task_id, attempt, token, to, reason, result, error, name, delay, message, at) = (
                    json.loads(blob)
                )
                lease = Lease(str(task_id), int(attempt), str(token))
                outcome = Outcome(
                    lease, State(to), str(reason), result, error, float(delay), message
                )
            except (ValueError, TypeError) as bad:  # never from our own children
                logger.error("celery-lease: unreadable outcome hand-over dropped: %s", bad)
                continue
            if not self._buffer:
                self._oldest = time.monotonic()
            self._buffer.append(_Buffered(outcome, str(name), float(at)))
            crash_point("outcome_buffered")

    def _due(self) -> bool:
        return bool(self._buffer) and (
            len(self._buffer) >= self.batch_size
            or time.monotonic() - self._oldest >= self.flush_interval
        )

    def _write_batch(self) -> int:
        """Write up to ``batch_size`` buffered outcomes; how many were written or
        rejected. Raises :class:`StoreError` (the batch stays buffered, in order)."""
        with self._write_lock:
            with self._lock:
                self._drain()
                batch = self._next_batch()
            if not batch:
                return 0
            retrying = batch[0].outcome.to is State.RETRY_WAIT
            outcomes = [b.outcome for b in batch]
            if retrying:
                # due when its pool process asked: the time spent in the buffer is taken
                # off the row's countdown, and the message goes out after the row with
                # the same countdown, so it is never due before the row is
                now = time.monotonic()
                outcomes = [
                    dataclasses.replace(o, delay=max(0.0, o.delay - (now - b.handed_at)))
                    for o, b in zip(outcomes, batch, strict=True)
                ]
            write = self.store.retry_many if retrying else self.store.finish_many
            answers = write(outcomes, actor=self.actor)
            with self._lock:
                for _ in batch:
                    self._buffer.popleft()
                if self._buffer:
                    self._oldest = time.monotonic()
            if retrying:
                crash_point("after_retry_recorded")
                self._publish([o for o, ok in zip(outcomes, answers, strict=True) if ok])
        for b, ok in zip(batch, answers, strict=True):
            if ok:
                self.written += 1
                continue
            self.rejected += 1
            logger.warning(
                "task %s[%s] attempt %d: %s rejected, the lease was lost (another "
                "attempt or a person owns the task now)",
                b.name,
                b.outcome.lease.task_id,
                b.outcome.lease.attempt,
                "retry" if b.outcome.to is State.RETRY_WAIT else f"outcome {b.outcome.to}",
            )
        return len(batch)

    def _next_batch(self) -> list[_Buffered]:
        """The oldest buffered outcomes, up to ``batch_size``, all retries or none: one
        statement writes them (lock held)."""
        batch: list[_Buffered] = []
        for b in self._buffer:
            if len(batch) == self.batch_size or (
                batch
                and (b.outcome.to is State.RETRY_WAIT) != (batch[0].outcome.to is State.RETRY_WAIT)
            ):
                break
            batch.append(b)
        return batch

    def _publish(self, retries: list[Outcome]) -> None:
        """Send the messages of retries just written (PENDING, not yet marked published),
        each with the countdown its row was written with; what cannot be sent is the
        reaper's."""
        sent: list[str] = []
        for n, o in enumerate(retries):
            if o.message is None:  # never from a retry() (it always carries its message)
                self.unpublished += 1
                continue
            try:
                _message.send_stored(
                    self._app, o.message, countdown=o.delay, timeout=self.store.config.db_timeout
                )
            except Exception as error:  # the broker: the row is the outbox
                self.unpublished += len(retries) - n
                logger.warning(
                    "celery-lease: outcome writer: %d retries recorded but not published "
                    "(%s): the reaper publishes them after lease_publish_grace",
                    len(retries) - n,
                    error,
                )
                break
            sent.append(o.lease.task_id)
        if sent:
            try:
                self.store.mark_published(sent)
            except StoreError as error:  # published twice at worst: dropped at claim
                logger.debug("retries published, not marked: %s", error)

    def flush(self) -> None:
        """Write everything handed over so far (the caller's thread waits).

        Raises:
            StoreError: the database did not answer; what is not written stays buffered.
        """
        while True:
            with self._lock:
                self._drain()
                empty = not self._buffer
            if empty:
                return
            self._write_batch()

    def buffered(self) -> int:
        """Outcomes read from the children and not written yet."""
        with self._lock:
            return len(self._buffer)

    def _loop(self) -> None:
        failing = False
        while not self._stopping.is_set():
            with self._lock:
                self._drain()
                due = self._due()
                if self._buffer and not due:
                    wait = max(0.0, self._oldest + self.flush_interval - time.monotonic())
                elif not self._buffer:
                    wait = 0.5
                else:
                    wait = 0.0
            if not due:
                # idle: woken by the first hand-over. With a batch pending: asleep for
                # _GLANCE at most, then what arrived meanwhile is read at once and the
                # batch's size and age checked again, instead of waking on every
                # hand-over (each wake-up costs the worker's main process, which also
                # runs Celery's event loop). A full buffer is not read either (the
                # children's hand-over blocks: back-pressure).
                if not self._buffer:
                    select.select([self._recv], [], [], wait)
                else:
                    self._stopping.wait(min(wait, _GLANCE))
                continue
            try:
                self._write_batch()
                if failing:
                    logger.warning("celery-lease: outcome writer: the database answers again")
                failing = False
            except StoreError as error:
                if not failing:
                    logger.warning(
                        "celery-lease: outcome writer: %s; %d outcomes kept, retrying (the "
                        "pool is held back once %d are buffered)",
                        error,
                        self.buffered(),
                        self.capacity,
                    )
                failing = True
                self._stopping.wait(0.5)
            except Exception:
                logger.exception("celery-lease: outcome writer: unexpected error (continuing)")
                self._stopping.wait(0.5)

    def close(self) -> int:
        """Stop the thread and write what is left; how many outcomes could not be
        written (their leases expire, and the tasks re-run skipping recorded steps)."""
        self.closed = True
        if _writers.get(self._app) is self:
            del _writers[self._app]
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        try:
            self.flush()
        except StoreError as error:
            left = self.buffered()
            logger.error(
                "celery-lease: %d outcomes not written at shutdown (%s): those tasks re-run "
                "after their lease expires, skipping recorded steps",
                left,
                error,
            )
            return left
        finally:
            self._recv.close()
            self._send.close()
        return 0


@dataclasses.dataclass(frozen=True)
class _Buffered:
    """One outcome read from a pool process: whose task, and when it was handed over
    (``time.monotonic()`` in the child: a retry's countdown runs from then)."""

    outcome: Outcome
    name: str
    handed_at: float


def writer_config(cfg: Any) -> dict[str, Any]:
    """The writer's settings from a :class:`~celery_lease.config.LeaseConfig`."""
    return {
        "batch_size": cfg.outcome_batch_size,
        "flush_interval": cfg.outcome_flush_interval,
        "buffer": cfg.outcome_buffer,
        "hand_over_timeout": cfg.db_timeout * 3,
    }


def hand_over(
    app: Celery,
    request: Any,
    fenced: bool,
    task_name: str,
    outcome: Outcome,
) -> bool:
    """Hand a pool process's outcome to its worker's writer; ``False``: the caller
    writes it itself (write-through).

    Written through: outcomes other than SUCCEEDED, CANCELLED and a retry carrying its
    message, every outcome with ``lease_outcome_write_through``, a self-fenced
    worker's (its leases are being expired), the final outcome of a task with
    callbacks, a chain or a chord (its follow-ups are recorded with the outcome and
    published right after it, by the pool process, so the row must be final first, or
    a worker lost with the outcome buffered would run them again; a retry runs none of
    them: see :mod:`celery_lease._follow_ups`), and
    a task run in the worker's main process itself (solo and threads pools, and
    ``celery.contrib.pytest``'s in-process worker): there the caller that sees
    Celery's result may read the row next, and it must be final.
    """
    if outcome.to not in HANDED_OVER or fenced:
        return False
    retry = outcome.to is State.RETRY_WAIT
    if retry and outcome.message is None:
        return False
    writer = _writers.get(app)
    if writer is None or writer.closed or os.getpid() == writer.owner:
        return False
    if not retry and (request.chord or request.callbacks or request.errbacks or request.chain):
        return False
    return writer.hand_over(outcome, task_name)
