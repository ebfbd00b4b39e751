"""Claims made ahead, in batches, by the worker's main process (``lease_claim_ahead``).

Without it, each pool process claims its delivery itself as it starts: one
statement per task on the task's critical path. With it, a prefork worker's main
process claims the deliveries it has reserved (prefetched) and will start next, many
in one statement (:meth:`~celery_lease.store.Store.claim_many`), on a thread of its
own. When Celery hands such a delivery to a free pool process, the claim travels in
the request and the pool process runs the task under it at once. The claim still
comes before any of the task's code runs.

Celery hands a delivery to the pool only when a pool process is free; the ones it
reserved beyond that wait in the worker. A row claimed ahead is RUNNING from its
claim, while its delivery waits for a pool process. So only the deliveries that
start next are claimed ahead: one round of them (as many as there are pool
processes, which take them as the running tasks end), and beyond that as many as
this worker starts within ``claim_ahead_window`` (1 s) at its recent rate.
What that wait changes:

- tasks with ``max_runtime`` (the wait would count against their limit) and tasks
  whose ``on_timeout`` is ``'manual'`` (a lost worker would hand a person a run that
  never began) are never claimed ahead: their pool processes claim them;
- a worker lost with deliveries claimed ahead expires them with its other leases and
  retries them, counting a recovery and an attempt although none of their code ran
  (crash-matrix row 9 with deliveries claimed ahead, in the crash suite);
- a delivery claimed ahead that Celery drops before it runs gives its claim back to
  the lease: at once when it is revoked or expired, within ``_STRANDED_AFTER``
  seconds when a lost broker connection cleared the worker's reservations; its row is
  expired, then cancelled or retried.

What is not claimed ahead goes to its pool process unclaimed, which claims it as it
always did: a delivery outside the window, one the batch did not claim (no row yet,
not due, a copy of a task already running, a race), a paused task, every delivery of
a self-fenced worker and every delivery while the database does not answer.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import threading
import time
import uuid
import weakref
from typing import Any

from celery.concurrency import prefork
from celery.worker import state as worker_state

from ..._incarnation import Incarnation
from ..._runtime import Runtime
from ...exceptions import StoreError
from ...store import Claim
from ..protocol import CLAIM_KEY, claim_header

logger = logging.getLogger("celery_lease.worker")

#: A job for the pool, as a request hands it over: (the pool's apply_async, target,
#: args, kwargs, options).
_Call = tuple[Any, Any, Any, Any, dict[str, Any]]

#: Seconds a claim made ahead may wait for its delivery to reach the pool before the
#: claimer checks that Celery still holds the delivery.
_STRANDED_AFTER = 5.0

#: Seconds over which the rate of starts is measured.
_RATE_SPAN = 2.0

QUEUED, ASKING, CLAIMED, UNCLAIMED = "queued", "asking", "claimed", "unclaimed"


@dataclasses.dataclass
class _Entry:
    """A reserved delivery of a task that may be claimed ahead."""

    request: Any
    status: str = QUEUED
    claim: Claim | None = None
    #: The pool job, when Celery handed it over while its claim was being made.
    call: _Call | None = None
    reserved_at: float = dataclasses.field(default_factory=time.monotonic)
    claimed_at: float = 0.0
    #: Celery dropped the delivery while its claim was being made.
    dropped: str | None = None


class Claimer:
    """A worker main process's claims made ahead: a thread that claims reserved
    deliveries in batches; the worker's event loop (its hub) hands them to the pool."""

    def __init__(self, rt: Runtime, inc: Incarnation, hub: Any, concurrency: int) -> None:
        cfg = rt.config
        self.rt = rt
        self.inc = inc
        self.hub = hub
        self.concurrency = max(1, concurrency)
        self.batch_size = cfg.claim_batch_size
        self.interval = cfg.claim_interval
        self.window = cfg.claim_ahead_window
        self._lock = threading.Lock()
        self._wake = threading.Event()
        #: Reserved deliveries by request id, in the order Celery reserved them.
        self._entries: dict[str, _Entry] = {}
        #: What the hub's thread does next: hand a job to the pool, give a claim back.
        self._hub_work: collections.deque[tuple[_Entry, str | None]] = collections.deque()
        #: When deliveries were handed to the pool in the last ``_RATE_SPAN`` seconds.
        self._starts: collections.deque[float] = collections.deque()
        self._checked_at = 0.0
        self.closed = False
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        self._thread = threading.Thread(target=self._run, name="celery-lease-claimer", daemon=True)
        #: Statements run and deliveries claimed ahead (for the benchmarks and tests).
        self.batches = 0
        self.claimed = 0

    def start(self) -> None:
        self.hub.add_reader(self._rfd, self._on_hub_work)
        self._thread.start()

    def stop(self) -> None:
        """Claim nothing more (at shutdown). Claims made ahead for deliveries that never
        reached the pool are expired with the incarnation's other leases."""
        if self.closed:
            return
        self.closed = True
        self._wake.set()
        self._thread.join(timeout=self.rt.config.db_timeout + 1.0)
        with contextlib.suppress(Exception):  # the hub may be closed already
            self.hub.remove_reader(self._rfd)
        for fd in (self._rfd, self._wfd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def takes(self, task: Any) -> bool:
        """Whether deliveries of ``task`` may be claimed ahead (see the module's text)."""
        if not hasattr(task, "lease_options"):
            return False
        options = task.lease_options(self.rt.config)
        return bool(options.max_runtime is None and options.on_timeout == "retry")

    # -- the hub's thread: Celery's calls ---------------------------------------------

    def reserved(self, request: Any) -> None:
        """Celery reserved ``request`` (before it waits for a pool process)."""
        _strip(getattr(request, "_request_dict", None))
        if self.closed or not self.takes(request.task):
            return
        with self._lock:
            self._entries[request.id] = _Entry(request)
        self._wake.set()

    def wrap(self, apply_async: Any) -> Any:
        """The pool's ``apply_async`` as Celery's requests call it once a pool process
        is free: a delivery claimed ahead goes with its claim, one whose claim is being
        made waits for it, any other goes unclaimed (its pool process claims it)."""

        def with_claims(target: Any, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
            request = getattr(options.get("accept_callback"), "__self__", None)
            request_dict = args[2] if isinstance(args, tuple) and len(args) > 2 else None
            _strip(request_dict)
            entry = None
            if request is not None:
                with self._lock:
                    entry = self._entries.get(request.id)
                    if entry is not None and entry.request is not request:
                        entry = None
                    if entry is not None and entry.status == ASKING:
                        entry.call = (apply_async, target, args, kwargs, options)
                        return None  # handed to the pool when its claim is made
                    if entry is not None:
                        del self._entries[request.id]
            self._starts.append(time.monotonic())
            if entry is not None and entry.claim is not None and isinstance(request_dict, dict):
                request_dict[CLAIM_KEY] = claim_header(entry.claim, self.inc)
            return apply_async(target, args, kwargs, **options)

        return with_claims

    def dropped(self, task_id: str, why: str) -> None:
        """Celery dropped the delivery of ``task_id`` before it ran (revoked, expired:
        its ``task_revoked`` signal names the request's context, not the request): a
        claim made ahead for it goes back to the lease (expired, then retried or
        cancelled)."""
        with self._lock:
            entry = self._entries.get(task_id)
            if entry is None:
                return
            if entry.status == ASKING:
                entry.dropped = why  # given back when the claim is made
                return
            del self._entries[task_id]
        if entry.claim is not None:
            entry.request.lease_lost(why)

    def _on_hub_work(self, *_: Any) -> None:
        with contextlib.suppress(OSError):
            while os.read(self._rfd, 4096):
                pass
        while self._hub_work:
            entry, lost = self._hub_work.popleft()
            if lost is not None:
                entry.request.lease_lost(lost)
                continue
            assert entry.call is not None
            apply_async, target, args, kwargs, options = entry.call
            self._starts.append(time.monotonic())
            if entry.claim is not None:
                args[2][CLAIM_KEY] = claim_header(entry.claim, self.inc)
            try:
                result = apply_async(target, args, kwargs, **options)
            except Exception as error:  # Celery's worker logs and drops it the same way
                logger.critical("Internal error: %r: task %s not run", error, entry.request.id)
                if entry.claim is not None:
                    entry.request.lease_lost(f"not handed to the pool after its claim: {error!r}")
                continue
            entry.request._apply_result = None if result is None else weakref.ref(result)

    def _to_hub(self, work: list[tuple[_Entry, str | None]]) -> None:
        if not work:
            return
        self._hub_work.extend(work)
        with contextlib.suppress(BlockingIOError, InterruptedError, OSError):
            os.write(self._wfd, b"c")

    # -- the claimer's thread ---------------------------------------------------------

    def _run(self) -> None:
        while not self.closed:
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            if self.closed:
                break
            if self.interval:
                time.sleep(self.interval)  # let the deliveries arriving together gather
            try:
                self._claim_batch()
                if time.monotonic() - self._checked_at >= 1.0:
                    self._checked_at = time.monotonic()
                    self._give_back_stranded()
            except Exception:
                logger.exception("celery-lease: claims ahead failed; pool processes claim")

    def _start_rate(self) -> float:
        """Deliveries this worker handed to its pool per second, lately."""
        starts, since = self._starts, time.monotonic() - _RATE_SPAN
        while starts and starts[0] < since:
            starts.popleft()
        return len(starts) / _RATE_SPAN

    def _claim_batch(self) -> None:
        rt, inc = self.rt, self.inc
        # one round ahead (as many as there are pool processes: they start as the running
        # tasks end), and beyond that as many as this worker starts within the window
        ahead = max(self.concurrency, int(self._start_rate() * self.window))
        with self._lock:
            asked: list[_Entry] = []
            for position, entry in enumerate(self._entries.values()):
                if position >= ahead or len(asked) >= self.batch_size:
                    break
                if entry.status == QUEUED:
                    asked.append(entry)
            if inc.flags.fenced:
                asked = []
            for entry in asked:
                entry.status = ASKING
        if not asked:
            return
        tokens = {uuid.uuid4().hex: entry for entry in asked if not self._paused(entry.request)}
        claims: dict[str, Claim] = {}
        if tokens:
            try:
                claims = rt.store.claim_many(
                    [(entry.request.id, token) for token, entry in tokens.items()],
                    inc.id,
                    inc.actor,
                )
            except StoreError as error:
                logger.warning(
                    "celery-lease: %d deliveries not claimed ahead (%s): their pool "
                    "processes claim them",
                    len(tokens),
                    error,
                )
            except Exception:
                # never leave a delivery waiting for a claim that will not come: each
                # goes to its pool process unclaimed, which claims it there
                logger.exception("celery-lease: claims ahead failed; pool processes claim")
            self.batches += 1
            self.claimed += len(claims)
        by_entry = {id(entry): claims.get(token) for token, entry in tokens.items()}
        now = time.monotonic()
        work: list[tuple[_Entry, str | None]] = []
        with self._lock:
            for entry in asked:
                entry.claim = by_entry.get(id(entry))
                entry.status = CLAIMED if entry.claim is not None else UNCLAIMED
                entry.claimed_at = now
                if entry.dropped is not None:
                    self._entries.pop(entry.request.id, None)
                    if entry.claim is not None:
                        work.append((entry, entry.dropped))
                elif entry.call is not None:
                    self._entries.pop(entry.request.id, None)
                    work.append((entry, None))
        self._to_hub(work)

    def _give_back_stranded(self) -> None:
        """Claims made ahead for deliveries Celery no longer holds (a lost broker
        connection clears its reservations) go back to the lease."""
        now = time.monotonic()
        reserved = {r.id for r in list(worker_state.reserved_requests)}
        work: list[tuple[_Entry, str | None]] = []
        with self._lock:
            for task_id, entry in list(self._entries.items()):
                if entry.status == ASKING or task_id in reserved:
                    continue
                if now - max(entry.reserved_at, entry.claimed_at) <= _STRANDED_AFTER:
                    continue
                del self._entries[task_id]
                if entry.claim is not None:
                    work.append(
                        (entry, "claimed ahead, and the worker no longer holds its delivery")
                    )
        self._to_hub(work)

    def _paused(self, request: Any) -> bool:
        queue_name = (request.delivery_info or {}).get("routing_key")
        try:
            return self.rt.pauses.match(self.rt.store, request.name, queue_name) is not None
        except Exception:  # unknown (the database, or anything): the pool process decides
            return True


def _strip(request_dict: Any) -> None:
    """A claim comes from this worker's main process, never with a message."""
    if isinstance(request_dict, dict):
        request_dict.pop(CLAIM_KEY, None)


def start_for(worker: Any, rt: Runtime, inc: Incarnation) -> Claimer | None:
    """Start the claimer of a worker that claims ahead: ``lease_claim_ahead`` set, a
    prefork pool driven by the worker's event loop. ``None`` for any other worker (its
    pool processes, or its own threads, claim each delivery)."""
    if not rt.config.claim_ahead:
        return None
    hub = getattr(worker, "hub", None)
    pool = getattr(worker, "pool", None)
    consumer = getattr(worker, "consumer", None)
    if hub is None or consumer is None or not isinstance(pool, prefork.TaskPool):
        logger.info(
            "celery-lease: worker %s claims each delivery in its pool process "
            "(lease_claim_ahead needs the prefork pool and the worker's event loop)",
            inc.nodename,
        )
        return None
    claimer = Claimer(rt, inc, hub, worker.concurrency or 1)
    # Before the consumer starts: Celery's request classes take the pool's apply_async,
    # and its task strategies the consumer's on_task_request, when they are made (at
    # the consumer's start).
    vars(pool)["apply_async"] = claimer.wrap(pool.apply_async)
    on_task_request = consumer.on_task_request

    def reserve_then_request(request: Any) -> Any:
        claimer.reserved(request)
        return on_task_request(request)

    consumer.on_task_request = reserve_then_request
    claimer.start()
    logger.info(
        "celery-lease: worker %s claims deliveries ahead, within %.1f s of their start, "
        "in batches of up to %d",
        inc.nodename,
        claimer.window,
        claimer.batch_size,
    )
    return claimer


__all__ = ["Claimer", "start_for"]
