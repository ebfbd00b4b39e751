"""The outcome writer: executions' outcomes leave the pool's critical path in batches.

A pool child that finishes a task hands its outcome (SUCCEEDED, CANCELLED, or a
retry with its message, fenced by the execution's attempt and token) to the worker's
main process over the worker's :class:`~celery_lease.worker.protocol.OutcomeChannel`
and goes on to its next task; the main process writes the outcomes that arrived
together in one statement (:meth:`~celery_lease.store.Store.finish_many`,
:meth:`~celery_lease.store.Store.retry_many`), then publishes the retries' messages,
each with what is left of its countdown: a retry's message goes out only once its
row is PENDING, as when the pool process wrote it.

The writer's own buffer is bounded, and so is the channel: when the database is slow
or down the writer stops reading, the channel fills, and the children's hand-over
blocks, holding the pool back rather than growing memory.

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
import logging
import select
import threading
import time
from typing import Any

from celery import Celery

from ..._crashpoints import crash_point
from ...exceptions import StoreError
from ...producer import message as _message
from ...states import State
from ...store import Outcome, Store
from ..protocol import MAX_HAND_OVER, OutcomeChannel

logger = logging.getLogger("celery_lease")

#: Longest the writer sleeps, with a batch pending, before it reads what arrived and
#: checks the batch's size again (its age is checked when it is due).
_GLANCE = 0.01


class OutcomeWriter:
    """The writer thread of one worker, and the channel it reads.

    Created in the worker's main process before the pool forks, so that the children
    inherit the channel's sending end; the main process runs the thread and
    :meth:`flush`.
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
        self.channel = OutcomeChannel(app, hand_over_timeout)
        self._recv = self.channel.receiving
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
        self._app = app

    @property
    def owner(self) -> int:
        """The worker's main process (the pool processes are forked from it)."""
        return self.channel.owner

    @owner.setter
    def owner(self, pid: int) -> None:
        self.channel.owner = pid

    def hand_over(self, outcome: Outcome, task_name: str) -> bool:
        """Send ``outcome`` over the channel as a pool process does (tests, benchmarks)."""
        return self.channel.send(outcome, task_name)

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
            try:
                outcome, name, at = OutcomeChannel.decode(self._chunk[:size])
            except (ValueError, TypeError) as bad:  # never from our own children
                logger.error("celery-lease: unreadable outcome hand-over dropped: %s", bad)
                continue
            if not self._buffer:
                self._oldest = time.monotonic()
            self._buffer.append(_Buffered(outcome, name, at))
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
        retries = [o for o in retries if not o.held]  # due far ahead: the reaper's, when due
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

    def in_hand(self) -> set[str] | None:
        """The tasks whose outcomes this writer holds and has not written yet (the batch
        being written among them: it leaves the buffer once committed), after reading
        everything the children sent so far; ``None`` when the buffer is full (the
        channel may hold more than it can take: unknown). For the worker's
        reconciliation (:mod:`.reconcile`)."""
        with self._lock:
            self._drain()
            if len(self._buffer) >= self.capacity:
                return None
            return {b.outcome.lease.task_id for b in self._buffer}

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
        self.channel.retire()
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
            self.channel.close()
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
