"""``LeasedTask``: the Celery task base class that gives every task a durable, fenced row."""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import hashlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar

from celery import Task
from celery.exceptions import Ignore, Reject, Retry
from celery.result import AsyncResult

from . import _message, _publisher, _submission
from ._crashpoints import armed, crash_point, step_crash_point
from ._execution import Execution, StoreDownDuringTask, encode
from ._outcome_writer import hand_over
from ._runtime import install, runtime
from ._submission import Submitted
from .config import LeaseConfig
from .exceptions import ConfigurationError, LeaseLost, NotSerializable, StoreError, TaskCancelled
from .states import State
from .store import NewTask, Outcome, Refusal, Store, dumps

logger = logging.getLogger("celery_lease")

_ON_TIMEOUT = ("retry", "manual")
_ON_EXHAUSTED = ("fail", "manual")


#: The execution running in this thread (prefork child, thread pool thread, solo worker).
_current: contextvars.ContextVar[Execution | None] = contextvars.ContextVar(
    "celery_lease_execution", default=None
)
#: Set while Celery's own ``retry()`` runs for this execution: the message it publishes
#: is the retry's, and goes through the row.
_retrying: contextvars.ContextVar[Execution | None] = contextvars.ContextVar(
    "celery_lease_retrying", default=None
)


def _aware_eta(app: Any, eta: Any) -> datetime | None:
    """An ETA as Celery's worker reads it: ISO text parsed, a naive time in the app's
    timezone."""
    if eta is None:
        return None
    if isinstance(eta, str):
        eta = datetime.fromisoformat(eta)
    if not isinstance(eta, datetime):
        raise TypeError(f"eta must be a datetime or an ISO 8601 string, got {eta!r}")
    if eta.tzinfo is None:
        eta = eta.replace(tzinfo=app.timezone)
    aware: datetime = eta
    return aware


class LeasedTask(Task[Any, Any]):
    """Base class for crash-safe tasks: ``@app.task(base=LeasedTask)``.

    Options (decorator keyword arguments or class attributes):

    * ``lease_ttl``: seconds the owner's heartbeat may be silent before the lease expires
      (default ``lease_ttl`` setting, 30 s).
    * ``max_runtime``: seconds without progress after which a live task goes to WAIT_MANUAL.
    * ``max_retries``: Celery's option; retries beyond it end in FAILED (or WAIT_MANUAL).
    * ``on_timeout``: ``"retry"`` (default) re-runs a task whose lease expired when it is
      safe; ``"manual"`` hands it to a person.
    * ``on_exhausted``: ``"fail"`` (default) or ``"manual"`` when retries run out.
    * ``max_recoveries``: lease expiries tolerated before WAIT_MANUAL (poison cap).
    """

    abstract = True
    Request = "celery_lease.worker:LeasedRequest"

    lease_ttl: ClassVar[float | None] = None
    max_runtime: ClassVar[float | None] = None
    on_timeout: ClassVar[str] = "retry"
    on_exhausted: ClassVar[str] = "fail"
    max_recoveries: ClassVar[int | None] = None

    # -- binding ----------------------------------------------------------------------

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Hook celery-lease into the app the first time a leased task binds to it, and
        record the task among the app's leased ones (the worker fences itself after the
        shortest TTL)."""
        rt = install(app)
        if cls.name is not None:
            rt.leased.add(cls.name)

    def lease_options(self, config: LeaseConfig) -> dict[str, Any]:
        """This task's lease options with the app's defaults applied, validated."""
        ttl = float(self.lease_ttl) if self.lease_ttl is not None else config.ttl
        max_runtime = self.max_runtime if self.max_runtime is not None else config.max_runtime
        recoveries = (
            int(self.max_recoveries) if self.max_recoveries is not None else config.max_recoveries
        )
        if not ttl > config.heartbeat_interval:
            raise ConfigurationError(
                f"task {self.name}: lease_ttl ({ttl}) must be longer than "
                f"lease_heartbeat_interval ({config.heartbeat_interval})"
            )
        if max_runtime is not None and not float(max_runtime) > 0:
            raise ConfigurationError(f"task {self.name}: max_runtime must be positive")
        if self.on_timeout not in _ON_TIMEOUT:
            raise ConfigurationError(
                f"task {self.name}: on_timeout must be one of {_ON_TIMEOUT}, "
                f"got {self.on_timeout!r}"
            )
        if self.on_exhausted not in _ON_EXHAUSTED:
            raise ConfigurationError(
                f"task {self.name}: on_exhausted must be one of {_ON_EXHAUSTED}, "
                f"got {self.on_exhausted!r}"
            )
        if recoveries < 0:
            raise ConfigurationError(f"task {self.name}: max_recoveries must be >= 0")
        return {
            "lease_ttl": ttl,
            "max_runtime": float(max_runtime) if max_runtime is not None else None,
            "max_retries": self.max_retries,
            "on_timeout": self.on_timeout,
            "on_exhausted": self.on_exhausted,
            "max_recoveries": recoveries,
        }

    # -- producer ---------------------------------------------------------------------

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        *,
        dedup_key: str | None = None,
        connection: Any = None,
        **options: Any,
    ) -> AsyncResult[Any]:
        """Write the task's row (PENDING) with the message Celery built, then publish it.

        ``dedup_key``: a second submission with the same key returns the first task's
        result handle and publishes nothing. ``connection``: a SQLAlchemy ``Connection``
        or ``Session`` on the store's database; the row joins its transaction and the
        message is published only after it commits.

        Raises:
            NotSerializable: the arguments cannot be stored as JSON (nothing is published).
            InvalidSubmission: an argument is outside the documented limits (a
                ``ValueError`` or ``TypeError`` naming it; nothing is written).
        """
        app = self.app
        if app.conf.task_always_eager:
            return super().apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, **options
            )
        retrying = _retrying.get()
        if retrying is not None and task_id == retrying.task_id:
            # Celery's own retry() publishing the retry's message: it goes through the row
            return self._publish_retry(
                retrying, args, kwargs, producer, link, link_error, shadow, options
            )
        return _submission.submit(
            self,
            args,
            kwargs,
            task_id,
            producer,
            link,
            link_error,
            shadow,
            dedup_key,
            connection,
            options,
        )

    def submit_many(
        self, items: Iterable[Sequence[Any] | Mapping[str, Any]], **options: Any
    ) -> list[Submitted]:
        """Submit this task once per item, the rows written in multi-row statements (a
        few hundred per statement), then the messages published.

        Each item is an ``(args, kwargs)`` pair or a dict with keys among ``args``,
        ``kwargs``, ``dedup_key``, ``countdown``, ``eta`` and ``task_id``; ``options``
        (``queue``, ``expires``, ...) apply to every item, as for ``apply_async``. Every
        item is checked and its message built before anything is written.

        Returns:
            One :class:`~celery_lease.Submitted` per item, in order: its result handle
            and whether it was created (``False``: a task with the same dedup key
            existed, and nothing was published for this item).

        Raises:
            TypeError: an item is neither a pair nor a dict of the keys above.
            NotSerializable, InvalidSubmission: as ``apply_async``, for the first bad
                item (nothing is written).
        """
        return _submission.submit_many(self, items, options)

    # -- worker: claim, run, outcome ---------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        req = self.request
        if req.called_directly or req.is_eager:
            return self.run(*args, **kwargs)
        rt = runtime(self.app)
        inc = rt.incarnation
        if inc is None:
            from .worker import start_in_process

            inc = start_in_process(rt, req.hostname)
        if inc is None:
            raise ConfigurationError(
                "celery-lease's worker bootstep is not running in this process: "
                "start workers with `celery -A proj worker` on an app that uses LeasedTask"
            )
        store = rt.store
        opts = self.lease_options(rt.config)
        adopt = functools.partial(self._adoption, req, args, kwargs, opts)
        task_id = req.id
        if not task_id:
            raise ConfigurationError(f"task {self.name}: a delivery without a task id")
        # The heartbeat lapsed for a TTL and has not been renewed since: a lease claimed
        # now would be lost at once (at the first boundary, or expired with the others
        # when the heartbeat recovers), a recovery counted against max_recoveries for a
        # task that never ran. Leave a PENDING row PENDING and publish it again, due after
        # the next heartbeat (if the database does not answer, the StoreError reaches
        # LeasedRequest.on_failure and the main process does it later). Any other
        # delivery goes on to the claim, which drops a copy or adopts a message without
        # a row.
        try:
            return self._claim_and_run(rt, inc, store, adopt, task_id, args, kwargs)
        except StoreError as error:
            raise StoreDownDuringTask(str(error)) from error

    def _claim_and_run(
        self,
        rt: Any,
        inc: Any,
        store: Store,
        adopt: Callable[[], NewTask],
        task_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        req = self.request
        delay = rt.config.heartbeat_interval
        if inc.flags.fenced and self._publish_again(store, inc.actor, task_id, delay):
            logger.info(
                "task %s[%s]: delivery dropped without running (worker %s is self-fenced)",
                self.name,
                req.id,
                inc.nodename,
            )
            raise Ignore()
        if self._held_by_pause(rt, store, req):
            raise Ignore()
        claim = store.claim(task_id, inc.id, inc.actor, adopt=adopt)
        if isinstance(claim, Refusal):
            if claim.early:
                self._publish_again(store, inc.actor, task_id)
            else:
                _count_duplicate(store)
            logger.info(
                "task %s[%s]: delivery dropped without running (%s)", self.name, req.id, claim.why
            )
            raise Ignore()
        execution = Execution(
            store=store,
            claim=claim,
            fenced=lambda: inc.flags.fenced,
            check_interval=rt.config.heartbeat_interval,
        )
        req.retries = claim.retries
        token = _current.set(execution)
        try:
            return self._run(execution, rt.config.result_max_bytes, args, kwargs)
        finally:
            _current.reset(token)

    def _held_by_pause(self, rt: Any, store: Store, req: Any) -> bool:
        """A delivery of a paused task name (or prefetched from a paused queue) is not
        run: its PENDING row is marked for publishing again and waits for the pause to end
        (:mod:`celery_lease.pause`). Whether this delivery was held."""
        queue = (req.delivery_info or {}).get("routing_key")
        pause = rt.pauses.match(store, self.name, queue)
        if pause is None or not store.hold_for_pause(req.id):
            return False
        logger.info(
            "task %s[%s]: delivery dropped without running: %s %s is paused (%s); "
            "published again when it is resumed",
            self.name,
            req.id,
            pause.kind,
            pause.target,
            pause.reason,
        )
        return True

    def _publish_again(
        self, store: Store, actor: str, task_id: str, delay: float | None = None
    ) -> bool:
        """Publish the task's message again if its row is PENDING (this delivery was not
        claimed), due in ``delay`` seconds at the earliest; whether it was."""
        rows = store.take_pending([task_id])
        if delay is not None:
            rows = [dataclasses.replace(r, countdown=max(r.countdown or 0.0, delay)) for r in rows]
        _publisher.publish(self.app, store, rows)
        return bool(rows)

    def _run(
        self, execution: Execution, result_limit: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        req = self.request
        try:
            # a cancel requested before this attempt was claimed (while a retry waited)
            # stops it before any of its code runs again
            execution.boundary()
            retval = self.run(*args, **kwargs)
            if armed():
                step_crash_point("before_outcome", self.name)
        except Retry:
            raise
        except LeaseLost as lost:
            logger.warning(
                "task %s[%s]: %s; stopping, nothing more written", self.name, req.id, lost
            )
            # A lease lost in the database is already someone else's: giving it up is a
            # no-op (fenced by token). A lease given up because this worker self-fenced may
            # still be ours in the database (claimed as the heartbeat recovered, after it
            # expired our other leases): expire it now, or it stays RUNNING under a live
            # heartbeat forever. If the database does not answer, the StoreError reaches
            # LeasedRequest.on_failure, which expires it from the main process.
            self._give_up(execution, str(lost))
            raise Ignore() from lost
        except TaskCancelled as cancelled:
            self._outcome(
                execution,
                State.CANCELLED,
                reason=f"cancelled: {cancelled.reason or 'an operator asked for it'}",
            )
            raise Ignore() from cancelled
        except Ignore:
            self._outcome(
                execution, State.SUCCEEDED, reason="task raised Ignore: recorded as succeeded"
            )
            raise
        except Reject as reject:
            if isinstance(getattr(reject, "reason", None), StoreError):
                # Celery's retry() wraps a failed publication of the retry: the store did
                # not answer while the retry was recorded
                raise reject.reason from reject  # type: ignore[attr-defined]
            if getattr(reject, "requeue", False):
                # the broker keeps the message and delivers it again: the row waits for it
                self._retry_outcome(
                    execution,
                    0.0,
                    "task rejected its message with requeue: retried at once",
                    repr(reject),
                    requeued=True,
                )
            else:
                self._outcome(
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
            self._outcome(
                execution,
                State.FAILED,
                reason=f"task raised {type(error).__name__}",
                error=f"{type(error).__name__}: {error}",
            )
            raise
        stored, reason = self._encode_result(retval, result_limit)
        if stored is None:
            refused = self._backend_refuses(retval)
            if refused is not None:
                # Celery's tracer will fail to store this result and report FAILURE
                # (EncodeError): the row says the same, not SUCCEEDED
                self._outcome(
                    execution,
                    State.FAILED,
                    reason="the result backend cannot serialize the result",
                    error=refused,
                )
                return retval
        if not self._outcome(execution, State.SUCCEEDED, reason=reason, result=stored):
            raise Ignore()
        return retval

    def _backend_refuses(self, value: Any) -> str | None:
        """Why the app's result backend cannot store ``value`` (``None``: it can, or it
        stores nothing)."""
        from celery.backends.base import DisabledBackend

        req = self.request
        ignored = req.ignore_result if req.ignore_result is not None else self.ignore_result
        backend = self.backend
        if ignored or isinstance(backend, DisabledBackend):
            return None
        try:
            backend.encode(backend.prepare_value(value))
        except Exception as error:
            return f"{type(error).__name__}: {error}"
        return None

    def _adoption(
        self, req: Any, args: tuple[Any, ...], kwargs: dict[str, Any], opts: dict[str, Any]
    ) -> NewTask:
        """The row to create if this message was sent without one (e.g. by name)."""
        try:
            args_text: str | None = encode("arguments", list(args))
            kwargs_text: str | None = encode("keyword arguments", dict(kwargs))
        except NotSerializable:
            args_text = kwargs_text = None
        info = req.delivery_info or {}
        routing = {"exchange": info.get("exchange"), "routing_key": info.get("routing_key")}
        message: str | None = None
        if args_text is not None:
            # the message as Celery rebuilds it from a request (what its retry() sends):
            # chain, callbacks, chord, limits and headers of the delivery survive
            try:
                sig = self.signature_from_request(req, args, kwargs)
                options = {k: v for k, v in sig.options.items() if k != "task_id"}
                message = _message.build(
                    self, sig.args, sig.kwargs, req.id, add_to_parent=False, **options
                ).stored()
            except Exception as error:  # adopting must not fail on the message
                logger.warning("task %s[%s]: message not stored: %s", self.name, req.id, error)
        return NewTask(
            id=req.id,
            name=self.name,
            args=args_text,
            kwargs=kwargs_text,
            options=dumps({k: v for k, v in routing.items() if v}),
            message=message,
            **opts,
        )

    @staticmethod
    def _encode_result(value: Any, limit: int) -> tuple[str | None, str]:
        try:
            return encode("result", value, limit), "succeeded"
        except NotSerializable as error:
            return None, f"succeeded, but the result was not stored: {error}"

    def _outcome(
        self,
        execution: Execution,
        to: State,
        *,
        reason: str,
        result: str | None = None,
        error: str | None = None,
    ) -> bool:
        """Write the outcome once, fenced; ``False`` when the lease was lost meanwhile."""
        if execution.finished:
            return False
        execution.finished = True
        rt = runtime(self.app)
        assert rt.incarnation is not None
        outcome = Outcome(execution.lease, to, reason, result, error)
        if hand_over(self.app, self.request, rt.incarnation.flags.fenced, self.name, outcome):
            return True  # written by the worker's outcome writer, with others
        ok = rt.store.finish(
            execution.lease,
            to,
            actor=rt.incarnation.actor,
            reason=reason,
            result=result,
            error=error,
        )
        if not ok:
            logger.warning(
                "task %s[%s] attempt %d: outcome %s rejected, the lease was lost (another "
                "attempt or a person owns the task now)",
                self.name,
                execution.task_id,
                execution.attempt,
                to,
            )
        return ok

    def _give_up(self, execution: Execution, why: str) -> None:
        rt = runtime(self.app)
        assert rt.incarnation is not None
        rt.store.give_up(execution.lease, actor=rt.incarnation.actor, reason=why)

    def _retry_outcome(
        self,
        execution: Execution,
        delay: float,
        reason: str,
        error: str | None,
        *,
        message: str | None = None,
        requeued: bool = False,
    ) -> bool:
        if execution.finished:
            return False
        execution.finished = True
        rt = runtime(self.app)
        assert rt.incarnation is not None
        return rt.store.schedule_retry(
            execution.lease,
            delay,
            actor=rt.incarnation.actor,
            reason=reason,
            error=error,
            message=message,
            requeued=requeued,
        )

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: Exception | None = None,
        throw: bool = True,
        eta: datetime | None = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Retry:
        """Celery's ``retry()``, through the row: RUNNING -> RETRY_WAIT -> PENDING with
        the retry's message (Celery builds it, chain and callbacks included), which this
        worker publishes at once with its ETA, as plain Celery does.

        The delay follows Celery: ``countdown``/``eta`` (a naive ``eta`` is in the app's
        timezone), else ``default_retry_delay``. Past ``max_retries`` the task ends
        FAILED, or WAIT_MANUAL with ``on_exhausted="manual"``.
        """
        req = self.request
        execution = _current.get()
        if execution is None:
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        limit = self.max_retries if max_retries is None else max_retries
        retries = execution.claim.retries
        described = f"{type(exc).__name__}: {exc}" if exc is not None else None
        if limit is not None and retries >= limit:
            exhausted = (
                f"retries exhausted: {retries} of {limit} used, and the task asked for another "
                f"({described or 'retry() without an exception'})"
            )
            if self.on_exhausted == "manual":
                self._outcome(execution, State.WAIT_MANUAL, reason=exhausted, error=described)
                raise Ignore()
            self._outcome(execution, State.FAILED, reason=exhausted, error=described)
            if exc is not None:
                raise exc
            raise self.MaxRetriesExceededError(
                f"Can't retry {self.name}[{req.id}] args:{req.args} kwargs:{req.kwargs}"
            )
        execution.retry_error = described
        token = _retrying.set(execution)
        try:
            return super().retry(
                args,
                kwargs,
                exc,
                throw,
                _aware_eta(self.app, eta),
                countdown,
                max_retries,
                **options,
            )
        finally:
            _retrying.reset(token)

    def _publish_retry(
        self,
        execution: Execution,
        args: Any,
        kwargs: Any,
        producer: Any,
        link: Any,
        link_error: Any,
        shadow: str | None,
        options: dict[str, Any],
    ) -> AsyncResult[Any]:
        """The message of Celery's retry() (its ``link``, ``link_error`` and ``shadow``
        too): stored in the row (fenced), then sent."""
        rt = runtime(self.app)
        options.pop("task_id", None)
        countdown = options.get("countdown")
        eta = _aware_eta(self.app, options.get("eta"))
        if countdown is not None:
            delay = max(0.0, float(countdown))
        elif eta is not None:
            delay = max(0.0, (eta - self.app.now()).total_seconds())
        else:
            delay = 0.0
        outgoing = _message.build(
            self, args, kwargs, execution.task_id, link, link_error, shadow, producer, **options
        )
        limit = self.max_retries if options.get("max_retries") is None else options["max_retries"]
        retries = execution.claim.retries
        ok = self._retry_outcome(
            execution,
            delay,
            f"retry {retries + 1} {f'of {limit}' if limit is not None else '(no limit)'}, "
            f"due in {delay:.3g} s",
            execution.retry_error,
            message=outgoing.stored(),
        )
        if not ok:
            logger.warning(
                "task %s[%s] attempt %d: retry not scheduled, the lease was lost",
                self.name,
                execution.task_id,
                execution.attempt,
            )
            return outgoing.result
        crash_point("after_retry_recorded")
        return _submission.publish(self, rt, outgoing, producer)

    # -- inside the task: steps, progress, cancellation --------------------------------

    def _execution(self) -> Execution:
        execution = _current.get()
        if execution is None:
            raise ConfigurationError(
                f"task {self.name}: steps, progress and cancellation need a worker execution "
                "(not a direct call or eager apply)"
            )
        return execution

    def step(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        idempotent: bool = False,
        check: Callable[..., Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` once per task, across attempts; return its result.

        A step recorded done returns its stored (JSON) result without calling ``fn``.
        A step not declared ``idempotent`` records that it started first: if the lease
        expires while it is in flight, the task goes to WAIT_MANUAL ("outcome of step
        unknown") instead of being retried, unless ``check`` is given. ``check`` takes the
        same arguments and returns the call's result if it happened, or ``None``.

        Raises:
            LeaseLost: this execution lost its lease; stop, nothing more is written.
            TaskCancelled: an operator cancelled the task.
            NotSerializable: the result cannot be stored (the step is not marked done).
        """
        if _current.get() is None:
            return fn(*args, **kwargs)
        return self._execution().step(name, fn, args, kwargs, idempotent=idempotent, check=check)

    def idempotency_key(self, name: str) -> str:
        """A key for step ``name`` that is the same in every attempt, on every worker."""
        task_id = self.request.id
        if task_id is None:
            raise ConfigurationError("idempotency_key() needs a task id (call it inside a task)")
        digest = hashlib.sha256(f"{task_id}\x00{name}".encode()).hexdigest()[:32]
        return f"{self.name}:{digest}"

    def save_progress(self, value: Any) -> None:
        """Store one JSON value as this task's progress cursor (fenced; counts as progress)."""
        self._execution().save_progress(value)

    def load_progress(self, default: Any = None) -> Any:
        """The progress cursor saved by an earlier attempt (or ``default``)."""
        return self._execution().load_progress(default)

    def check_cancelled(self) -> None:
        """A step boundary without a step: raises ``TaskCancelled`` or ``LeaseLost``."""
        self._execution().boundary()


def _count_duplicate(store: Store) -> None:
    """Raise the ``duplicates_dropped`` counter; a failure to count never changes what
    happens to the delivery."""
    from .store import DUPLICATES_DROPPED

    try:
        store.add_counts({DUPLICATES_DROPPED: 1})
    except StoreError as error:
        logger.debug("duplicate delivery not counted: %s", error)
