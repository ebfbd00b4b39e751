"""One delivery of a leased task in a worker: the claim, the run, the outcome.

``LeasedTask.__call__`` hands every worker delivery to :func:`deliver`. It drops the
delivery without running any of the task's code when the worker is self-fenced, the
task is paused, or the claim is refused (a copy, a finished task, an early delivery);
otherwise it runs the task under an :class:`~celery_lease.worker.pool.execution.Execution` and
writes exactly one fenced outcome, or hands it to the worker's outcome writer.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
from typing import Any, Literal

from celery import Task
from celery.exceptions import Ignore, Reject, Retry

from ..._crashpoints import armed, step_crash_point, worker_crash_point
from ..._incarnation import Incarnation
from ..._runtime import Runtime, runtime
from ...exceptions import ConfigurationError, LeaseLost, NotSerializable, StoreError, TaskCancelled
from ...producer import follow_ups as _follow_ups
from ...producer import message as _message
from ...producer import publisher as _publisher
from ...producer import slots as _slots
from ...states import State
from ...store import (
    DUPLICATES_DROPPED,
    Claim,
    LeaseOptions,
    NewTask,
    Outcome,
    Refusal,
    Slot,
    Store,
    dumps,
)
from ..protocol import ask_claim, hand_over
from .execution import Execution, StoreDownDuringTask, encode

logger = logging.getLogger("celery_lease")

#: The execution running in this thread (prefork child, thread pool thread, solo worker).
current: contextvars.ContextVar[Execution | None] = contextvars.ContextVar(
    "celery_lease_execution", default=None
)

LeasedTask = Task[Any, Any]


def deliver(task: LeasedTask, options: LeaseOptions, args: tuple[Any, ...], kwargs: Any) -> Any:
    """Claim this delivery's row and run the task under its lease (the worker side of
    ``LeasedTask.__call__``)."""
    req = task.request
    rt = runtime(task.app)
    inc = rt.incarnation
    if inc is None:
        raise ConfigurationError(
            "celery-lease's worker bootstep is not running in this process: "
            "start workers with `celery -A proj worker` on an app that uses LeasedTask"
        )
    if not req.id:
        raise ConfigurationError(f"task {task.name}: a delivery without a task id")
    delivery = _Delivery(task, rt, inc, options)
    try:
        return delivery.run(args, dict(kwargs))
    except StoreError as error:
        raise StoreDownDuringTask(str(error), delivery.attempt) from error


class _Delivery:
    def __init__(
        self, task: LeasedTask, rt: Runtime, inc: Incarnation, options: LeaseOptions
    ) -> None:
        self.task = task
        self.rt = rt
        self.inc = inc
        self.store: Store = rt.store
        self.options = options
        self.req = task.request
        self.task_id: str = str(self.req.id)
        #: The attempt this delivery claimed (``None`` until its claim is known).
        self.attempt: int | None = None
        #: The concurrency slot this delivery's own claim took (``None``: none).
        self.slot: Slot | None = None

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        claim = self._asked() or self._claim(args, kwargs)
        self.attempt = claim.lease.attempt
        inc = self.inc
        execution = Execution(
            store=self.store,
            claim=claim,
            fenced=lambda: inc.flags.fenced,
            check_interval=self.rt.config.heartbeat_interval,
            holds_slot=self.slot is not None and self.slot.limit > 0,
        )
        self.req.retries = claim.retries
        token = current.set(execution)
        try:
            return self._run(execution, args, kwargs)
        finally:
            current.reset(token)

    def _asked(self) -> Claim | None:
        """The claim the worker's lease agent made for this delivery, ahead or now
        (``None``: this process claims it). Tasks with ``max_runtime`` or a manual
        ``on_timeout`` are never claimed ahead: claimed here, at their start."""
        options = self.options
        if options.max_runtime is not None or options.on_timeout != "retry":
            return None
        if options.concurrency_limit is not None:
            return None  # a limited task takes its slot (or its start) in its own claim
        if _message.revision_of(self.req) is not None:
            return None  # a replaced task's message: its claim checks the revision
        if not self.inc.flags.claimable(self.rt.config.heartbeat_interval):
            return None
        return ask_claim(self.task.app, self.task_id, self.rt.config.db_timeout * 3)

    def _claim(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Claim:
        """This process's own claim of the delivery (the lease agent made none);
        raises :class:`Ignore` when the delivery is dropped without running."""
        task, req, store, inc = self.task, self.req, self.store, self.inc
        # The heartbeat lapsed for a TTL and has not been renewed since: a lease claimed
        # now would be lost at once (at the first boundary, or expired with the others
        # when the heartbeat recovers), a recovery counted against max_recoveries for a
        # task that never ran. Leave a PENDING row PENDING and publish it again, due after
        # the next heartbeat (if the database does not answer, the StoreError reaches
        # LeasedRequest.on_failure and the main process does it later). Any other
        # delivery goes on to the claim, which drops a copy or adopts a message without
        # a row.
        interval = self.rt.config.heartbeat_interval
        if not inc.flags.claimable(interval) and self._publish_again(interval):
            logger.info(
                "task %s[%s]: delivery dropped without running (worker %s is self-fenced)",
                task.name,
                req.id,
                inc.nodename,
            )
            raise Ignore()
        if self._held_by_pause():
            raise Ignore()
        self.slot = self._slot(args, kwargs)
        claim = store.claim(
            self.task_id,
            inc.id,
            inc.actor,
            adopt=lambda: self._adoption(args, kwargs),
            revision=_message.revision_of(self.req),
            slot=self.slot,
        )
        if isinstance(claim, Refusal):
            if claim.early or (claim.paced and not claim.held):
                self._publish_again()  # due at its ETA: the start reserved for it
            elif not (claim.waiting or claim.paced):
                # a waiting row is published when a slot frees, a held paced one by the
                # reaper when its start comes
                _count_duplicate(store)
            logger.info(
                "task %s[%s]: delivery dropped without running (%s)", task.name, req.id, claim.why
            )
            raise Ignore()
        return claim

    def _slot(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Slot | None:
        """The concurrency slot this delivery's claim must take (``None``: no limit).
        A delivery whose key cannot be made (a message sent by name, never checked at
        submission) counts under the key ``""``, which every such delivery shares: the
        limit still holds for them, together."""
        limit = _slots.limit_of(self.task)
        if limit is None:
            return None
        try:
            return limit.slot_of(args, kwargs)
        except (TypeError, ValueError) as error:
            logger.error(
                "task %s[%s]: %s; counted under the key '' that all such deliveries share",
                self.task.name,
                self.task_id,
                error,
            )
            return Slot(limit.task, "", limit.limit, limit.interval)

    def _held_by_pause(self) -> bool:
        """A delivery of a paused task name (or prefetched from a paused queue) is not
        run: its PENDING row is marked for publishing again and waits for the pause to end
        (:mod:`celery_lease.pause`). Whether this delivery was held."""
        queue = (self.req.delivery_info or {}).get("routing_key")
        pause = self.rt.pauses.match(self.store, self.task.name, queue)
        if pause is None or not self.store.hold_for_pause(self.task_id):
            return False
        logger.info(
            "task %s[%s]: delivery dropped without running: %s %s is paused (%s); "
            "published again when it is resumed",
            self.task.name,
            self.task_id,
            pause.kind,
            pause.target,
            pause.reason,
        )
        return True

    def _publish_again(self, delay: float | None = None) -> bool:
        """Publish the task's message again if its row is PENDING (this delivery was not
        claimed), due in ``delay`` seconds at the earliest; whether it was."""
        rows = self.store.take_pending([self.task_id])
        if delay is not None:
            rows = [dataclasses.replace(r, countdown=max(r.countdown or 0.0, delay)) for r in rows]
        _publisher.publish(self.task.app, self.store, rows)
        return bool(rows)

    def _run(self, execution: Execution, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        task = self.task
        try:
            # a cancel requested before this attempt was claimed (while a retry waited)
            # stops it before any of its code runs again
            execution.boundary()
            retval = task.run(*args, **kwargs)
            if armed():
                step_crash_point("before_outcome", task.name)
        except Retry:
            raise
        except LeaseLost as lost:
            logger.warning(
                "task %s[%s]: %s; stopping, nothing more written", task.name, self.task_id, lost
            )
            # A lease lost in the database is already someone else's: giving it up is a
            # no-op (fenced by token). A lease given up because this worker self-fenced may
            # still be ours in the database (claimed as the heartbeat recovered, after it
            # expired our other leases): expire it now, or it stays RUNNING under a live
            # heartbeat forever. If the database does not answer, the StoreError reaches
            # LeasedRequest.on_failure, which expires it from the main process.
            self.store.give_up(execution.lease, actor=self.inc.actor, reason=str(lost))
            raise Ignore() from lost
        except TaskCancelled as cancelled:
            outcome(
                task,
                execution,
                State.CANCELLED,
                reason=f"cancelled: {cancelled.reason or 'an operator asked for it'}",
            )
            raise Ignore() from cancelled
        except Ignore:
            outcome(
                task, execution, State.SUCCEEDED, reason="task raised Ignore: recorded as succeeded"
            )
            raise
        except Reject as reject:
            if isinstance(getattr(reject, "reason", None), StoreError):
                # Celery's retry() wraps a failed publication of the retry: the store did
                # not answer while the retry was recorded
                raise reject.reason from reject  # type: ignore[attr-defined]
            if getattr(reject, "requeue", False):
                # the broker keeps the message and delivers it again: the row waits for it
                retry_outcome(
                    task,
                    execution,
                    0.0,
                    "task rejected its message with requeue: retried at once",
                    repr(reject),
                    requeued=True,
                )
            else:
                outcome(
                    task,
                    execution,
                    State.FAILED,
                    reason="task rejected its message without requeue",
                    error=repr(reject),
                )
            raise
        except StoreError:
            # the database failed, not the task: no outcome can be written now, and the
            # row must not stay RUNNING under this worker's live heartbeat. The worker's
            # main process (LeasedRequest.on_failure) expires the lease as soon as the
            # database answers; the policy then retries, or hands the task to a person if
            # a non-idempotent step was in flight.
            raise
        except Exception as error:
            outcome(
                task,
                execution,
                State.FAILED,
                reason=f"task raised {type(error).__name__}",
                error=f"{type(error).__name__}: {error}",
            )
            raise
        stored, reason = _encode_result(retval, self.rt.config.result_max_bytes)
        if stored is None:
            refused = self._backend_refuses(retval)
            if refused is not None:
                # Celery's tracer will fail to store this result and report FAILURE
                # (EncodeError): the row says the same, not SUCCEEDED
                outcome(
                    task,
                    execution,
                    State.FAILED,
                    reason="the result backend cannot serialize the result",
                    error=refused,
                )
                return retval
        # what this success sends is recorded with it (the reaper sends it if this
        # worker dies before it does); a result not stored cannot be replayed, and is
        # left to Celery's tracer, as before
        follow_ups = stored is not None and _follow_ups.recorded(self.req)
        if not outcome(
            task, execution, State.SUCCEEDED, reason=reason, result=stored, follow_ups=follow_ups
        ):
            raise Ignore()
        if follow_ups:
            worker_crash_point("before_follow_ups", self.inc.pid)
            _follow_ups.send_taken(task, self.store, _follow_ups.take(self.req), retval)
        return retval

    def _backend_refuses(self, value: Any) -> str | None:
        """Why the app's result backend cannot store ``value`` (``None``: it can, or it
        stores nothing)."""
        from celery.backends.base import DisabledBackend

        task, req = self.task, self.req
        ignored = req.ignore_result if req.ignore_result is not None else task.ignore_result
        backend = task.backend
        if ignored or isinstance(backend, DisabledBackend):
            return None
        try:
            backend.encode(backend.prepare_value(value))
        except Exception as error:
            return f"{type(error).__name__}: {error}"
        return None

    def _adoption(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> NewTask:
        """The row to create if this message was sent without one (e.g. by name)."""
        task, req = self.task, self.req
        args_text: str | None
        kwargs_text: str | None
        try:  # exactly, or not at all: without a message the row is published from them
            args_text, kwargs_text = _message.arguments_text(args, kwargs, exact=True)
        except (TypeError, ValueError):
            args_text = kwargs_text = None
        info = req.delivery_info or {}
        routing = {"exchange": info.get("exchange"), "routing_key": info.get("routing_key")}
        message: str | None = None
        if args_text is not None:
            # the message as Celery rebuilds it from a request (what its retry() sends):
            # chain, callbacks, chord, limits and headers of the delivery survive
            try:
                sig = task.signature_from_request(req, args, kwargs)
                options = {k: v for k, v in sig.options.items() if k != "task_id"}
                message = _message.build(
                    task, sig.args, sig.kwargs, self.task_id, add_to_parent=False, **options
                ).stored()
            except Exception as error:  # adopting must not fail on the message
                logger.warning("task %s[%s]: message not stored: %s", task.name, req.id, error)
        return NewTask.of(
            self.options,
            id=self.task_id,
            name=task.name,
            args=args_text,
            kwargs=kwargs_text,
            options=dumps({k: v for k, v in routing.items() if v}),
            message=message,
        )


def outcome(
    task: LeasedTask,
    execution: Execution,
    to: State,
    *,
    reason: str,
    result: str | None = None,
    error: str | None = None,
    follow_ups: bool = False,
) -> bool:
    """Write the outcome once, fenced; ``False`` when the lease was lost meanwhile.
    ``follow_ups``: a success whose follow-ups are recorded with it (written through:
    the writer never takes a task with callbacks, a chain or a chord)."""
    rt = _finishing(task, execution)
    if rt is None or rt.incarnation is None:
        return False
    written = Outcome(execution.lease, to, reason, result, error)
    fenced = rt.incarnation.flags.fenced
    if hand_over(task.app, task.request, fenced, task.name, written, execution.holds_slot):
        return True  # written by the worker's outcome writer, with others
    try:
        ok = rt.store.finish(
            execution.lease,
            to,
            actor=rt.incarnation.actor,
            reason=reason,
            result=result,
            error=error,
            follow_ups=follow_ups,
            holds_slot=execution.holds_slot,
        )
    except StoreError:
        if _kept_by_writer(task, execution, rt, written):
            return True
        raise
    if not ok:
        logger.warning(
            "task %s[%s] attempt %d: outcome %s rejected, the lease was lost (another "
            "attempt or a person owns the task now)",
            task.name,
            execution.task_id,
            execution.attempt,
            to,
        )
    return ok


#: What :func:`retry_outcome` did: ``"written"`` (the caller publishes the retry's
#: message), ``"handed_over"`` (the worker's outcome writer writes the row, then
#: publishes the message), ``"held"`` (written, due far ahead: the reaper publishes it
#: when due), ``"lost"`` (the lease was lost: nothing written).
RetryRecorded = Literal["written", "handed_over", "held", "lost"]


def retry_outcome(
    task: LeasedTask,
    execution: Execution,
    delay: float,
    reason: str,
    error: str | None,
    *,
    message: str | None = None,
    requeued: bool = False,
) -> RetryRecorded:
    """RUNNING -> RETRY_WAIT -> PENDING once, fenced, due in ``delay`` seconds; held in
    the row when that is more than ``lease_hold_eta_after`` ahead (as a submission is)."""
    rt = _finishing(task, execution)
    if rt is None or rt.incarnation is None:
        return "lost"
    # a requeued delivery stays in the broker; a retry without its message cannot be
    # published later from the row
    held = not requeued and message is not None and rt.store.holds(delay, None)
    retry = Outcome(
        execution.lease, State.RETRY_WAIT, reason, None, error, delay, message, held=held
    )
    fenced = rt.incarnation.flags.fenced
    if not requeued and hand_over(
        task.app, task.request, fenced, task.name, retry, execution.holds_slot
    ):
        return "handed_over"
    try:
        written = rt.store.schedule_retry(
            execution.lease,
            delay,
            actor=rt.incarnation.actor,
            reason=reason,
            error=error,
            message=message,
            requeued=requeued,
            held=held,
        )
    except StoreError:
        if not requeued and _kept_by_writer(task, execution, rt, retry):
            return "handed_over"
        raise
    if not written:
        return "lost"
    return "held" if held else "written"


def _kept_by_writer(task: LeasedTask, execution: Execution, rt: Runtime, kept: Outcome) -> bool:
    """A run holding a concurrency slot writes its outcome itself (it frees the slot
    before this pool process takes its next delivery); when the database does not
    answer, the outcome goes to the worker's outcome writer after all, which keeps it
    and writes it once the database answers, as for any other task (crash-point
    matrix row 37): the slot stays in use meanwhile. Whether the writer took it (not
    once this worker has fenced itself meanwhile)."""
    if not execution.holds_slot or rt.incarnation is None:
        return False
    fenced = rt.incarnation.flags.fenced
    return hand_over(task.app, task.request, fenced, task.name, kept)


def _finishing(task: LeasedTask, execution: Execution) -> Runtime | None:
    """The runtime to write an execution's one outcome with; ``None``: it was written."""
    if execution.finished:
        return None
    execution.finished = True
    return runtime(task.app)


def _encode_result(value: Any, limit: int) -> tuple[str | None, str]:
    try:
        return encode("result", value, limit), "succeeded"
    except NotSerializable as error:
        return None, f"succeeded, but the result was not stored: {error}"


def _count_duplicate(store: Store) -> None:
    """Raise the ``duplicates_dropped`` counter; a failure to count never changes what
    happens to the delivery."""
    try:
        store.add_counts({DUPLICATES_DROPPED: 1})
    except StoreError as error:
        logger.debug("duplicate delivery not counted: %s", error)
