"""``LeasedTask``: the Celery task base class that gives every task a durable, fenced row."""

from __future__ import annotations

import contextvars
import hashlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar

from celery import Task
from celery.exceptions import Ignore, Retry
from celery.result import AsyncResult

from ._crashpoints import crash_point
from ._runtime import install, runtime
from .config import LeaseConfig, check_seconds
from .exceptions import ConfigurationError
from .producer import follow_ups as _follow_ups
from .producer import group_batches as _group_batches
from .producer import message as _message
from .producer import slots as _slots
from .producer import submission as _submission
from .producer.limits import check_unique
from .producer.submission import Submitted
from .states import State
from .store import LeaseOptions, Unique
from .worker.pool import attempt as _attempt
from .worker.pool import replace as _replace
from .worker.pool.execution import Execution

logger = logging.getLogger("celery_lease")

_ON_TIMEOUT = ("retry", "manual")
_ON_EXHAUSTED = ("fail", "manual")


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
    * ``concurrency_limit``: at most this many attempts of the task RUNNING at once
      across all workers (per key with ``concurrency_key``); a delivery that finds no
      free slot is acked and its row waits, PENDING, until one frees.
    * ``concurrency_key``: the limit applies per key: the name of an argument of the
      task (``"tenant_id"``), or a callable of ``(args, kwargs)`` returning a string;
      with a key and no ``concurrency_limit`` (nor ``global_rate_limit``) the limit is 1.
    * ``global_rate_limit``: ``"100/s"``, ``"10/m"``, ``"1000/h"``: starts of the task
      across all workers (per key with ``concurrency_key``), one an interval in
      database time (at most ``k + 1`` in any ``k`` intervals); a delivery that comes
      while the last start's interval runs is given the next free start and published
      again for it. Celery's own ``rate_limit`` keeps its per-worker meaning.
    * ``unique_for``, ``unique_while``, ``on_conflict``: the defaults of the
      submission options of the same names (how long, in which states, a ``dedup_key``
      deduplicates, and what a duplicate does; see :meth:`apply_async`).
    """

    abstract = True
    Request = "celery_lease.worker.main.request:LeasedRequest"

    lease_ttl: ClassVar[float | None] = None
    max_runtime: ClassVar[float | None] = None
    on_timeout: ClassVar[str] = "retry"
    on_exhausted: ClassVar[str] = "fail"
    max_recoveries: ClassVar[int | None] = None
    unique_for: ClassVar[float | None] = None
    unique_while: ClassVar[Iterable[State | str] | None] = None
    on_conflict: ClassVar[str] = "return"
    concurrency_limit: ClassVar[int | None] = None
    concurrency_key: ClassVar[_slots.KeySpec] = None
    global_rate_limit: ClassVar[str | None] = None

    #: The concurrency options above, checked when the task is bound to an app.
    _concurrency: ClassVar[_slots.Limit | None] = None
    #: An invalid option found when the task was bound (see :meth:`on_bound`).
    _option_error: ClassVar[ConfigurationError | None] = None

    #: The uniqueness options above, checked when the task is bound to an app.
    _unique: ClassVar[Unique] = Unique()

    #: The checked options and the configuration they were checked against.
    _lease_options: tuple[LeaseConfig, LeaseOptions] | None = None

    # -- binding ----------------------------------------------------------------------

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Hook celery-lease into the app the first time a leased task binds to it (and
        plain groups of leased tasks into bulk writes: :mod:`.producer.group_batches`),
        and record the task among the app's leased ones (the worker fences itself after
        the shortest TTL)."""
        # checked when the task binds, and kept rather than raised here (in a worker, a
        # binding error would end Celery's start-up with a traceback): each submission
        # raises it, and a worker of this app refuses to start with it (exit 78, naming
        # the task and the option), as for an invalid lease_ttl
        try:
            cls._unique = check_unique(
                f"task {cls.name}", cls.unique_for, cls.unique_while, cls.on_conflict, task=True
            )
            cls._concurrency = _slots.check(cls)
            cls._option_error = None
        except ConfigurationError as error:
            cls._option_error = error
        rt = install(app)
        # the slots a commit of this process frees go to waiting rows, published at once
        rt.add_store_hook(_slots.attach)
        _group_batches.install(LeasedTask)
        if cls.name is not None:
            rt.leased.add(cls.name)

    def lease_options(self, config: LeaseConfig) -> LeaseOptions:
        """This task's lease options with the app's defaults applied, validated (once per
        task and configuration)."""
        cached = self._lease_options
        if cached is not None and cached[0] is config:
            return cached[1]
        options = self._check_lease_options(config)
        self._lease_options = (config, options)
        return options

    def _check_lease_options(self, config: LeaseConfig) -> LeaseOptions:
        if self._option_error is not None:
            raise self._option_error
        ttl = (
            check_seconds(f"task {self.name}: lease_ttl", self.lease_ttl)
            if self.lease_ttl is not None
            else config.ttl
        )
        max_runtime = (
            check_seconds(f"task {self.name}: max_runtime", self.max_runtime)
            if self.max_runtime is not None
            else config.max_runtime
        )
        recoveries = config.max_recoveries
        if self.max_recoveries is not None:
            try:
                recoveries = int(self.max_recoveries)
            except (TypeError, ValueError, OverflowError):
                raise ConfigurationError(
                    f"task {self.name}: max_recoveries must be a whole number, "
                    f"got {self.max_recoveries!r}"
                ) from None
        if not ttl > config.heartbeat_interval:
            raise ConfigurationError(
                f"task {self.name}: lease_ttl ({ttl}) must be longer than "
                f"lease_heartbeat_interval ({config.heartbeat_interval})"
            )
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
        return LeaseOptions(
            lease_ttl=ttl,
            max_runtime=max_runtime,
            max_retries=self.max_retries,
            on_timeout=self.on_timeout,
            on_exhausted=self.on_exhausted,
            max_recoveries=recoveries,
            concurrency_limit=self._concurrency.limit if self._concurrency else None,
        )

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
        unique_for: Any = _submission.DEFAULT,
        unique_while: Any = _submission.DEFAULT,
        on_conflict: Any = _submission.DEFAULT,
        **options: Any,
    ) -> AsyncResult[Any]:
        """Write the task's row (PENDING) with the message Celery built, then publish it.

        ``dedup_key``: a second submission with the same key returns the first task's
        result handle and publishes nothing. ``connection``: a SQLAlchemy ``Connection``
        or ``Session`` on the store's database; the row joins its transaction and the
        message is published only after it commits.

        With a ``dedup_key`` (defaults: the task's options of the same names):

        * ``unique_for``: seconds from the key holder's submission (database time)
          during which the key deduplicates; after them the same key submits a new task
          (default ``None``: until the row is purged).
        * ``unique_while``: the states of the key holder in which the key deduplicates
          (e.g. ``[State.PENDING, State.RUNNING]``; default ``None``: any).
        * ``on_conflict``: what a duplicate does: ``"return"`` (the existing task's
          result handle), ``"raise"`` (:class:`~celery_lease.DuplicateSubmission`) or
          ``"replace"`` (the existing task, if still PENDING and never claimed, takes
          these arguments, message and schedule: a debounce; else it is returned).

        Raises:
            NotSerializable: the arguments cannot be stored as JSON (nothing is published).
            InvalidSubmission: an argument is outside the documented limits (a
                ``ValueError`` or ``TypeError`` naming it; nothing is written).
            DuplicateSubmission: ``on_conflict="raise"`` and the key is held.
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
            unique=_submission.uniqueness(self, dedup_key, unique_for, unique_while, on_conflict),
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

    # -- worker ----------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        req = self.request
        if req.called_directly or req.is_eager:
            return self.run(*args, **kwargs)
        rt = runtime(self.app)
        if rt.incarnation is None:
            # a worker whose bootstep never ran: an in-process one (solo or threads pool:
            # this is its main process) starts the main process's service now; in a
            # prefork child or outside a worker nothing starts, and the delivery refuses
            from .worker.main.bootstep import start_in_process

            start_in_process(rt, req.hostname)
        return _attempt.deliver(self, self.lease_options(rt.config), args, kwargs)

    def on_success(self, retval: Any, task_id: str, args: Any, kwargs: Any) -> None:
        """After Celery stored the result: a chord member's part-return, and its
        follow-ups recorded with the outcome marked published (a subclass that overrides
        this calls ``super().on_success(...)``; otherwise the reaper does the
        part-return after ``lease_publish_grace``)."""
        if _follow_ups.taken(self.request):
            _follow_ups.finish(self, runtime(self.app).store, retval)

    def on_replace(self, sig: Any) -> Any:
        """Celery's ``replace()`` ends here: in a worker execution, the replaced run's
        outcome and the replacement's rows are written in one transaction, then the
        replacement is published (:mod:`celery_lease.worker.pool.replace`); the run ends with
        ``Ignore``, as in Celery."""
        execution = _attempt.current.get()
        if execution is None or self.request.is_eager:
            return super().on_replace(sig)
        _replace.replace(self, execution, sig)

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
        worker publishes at once with its ETA, as plain Celery does; a retry due more
        than ``lease_hold_eta_after`` seconds ahead is held in the row instead, and the
        reaper publishes it when due (as a submission with such an ETA is).

        The delay follows Celery: ``countdown``/``eta`` (a naive ``eta`` is in the app's
        timezone), else ``default_retry_delay``. Past ``max_retries`` the task ends
        FAILED, or WAIT_MANUAL with ``on_exhausted="manual"``.
        """
        req = self.request
        execution = _attempt.current.get()
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
                _attempt.outcome(
                    self, execution, State.WAIT_MANUAL, reason=exhausted, error=described
                )
                raise Ignore()
            _attempt.outcome(self, execution, State.FAILED, reason=exhausted, error=described)
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
        recorded = _attempt.retry_outcome(
            self,
            execution,
            delay,
            f"retry {retries + 1} {f'of {limit}' if limit is not None else '(no limit)'}, "
            f"due in {delay:.3g} s",
            execution.retry_error,
            message=outgoing.stored(),
        )
        if recorded == "lost":
            logger.warning(
                "task %s[%s] attempt %d: retry not scheduled, the lease was lost",
                self.name,
                execution.task_id,
                execution.attempt,
            )
            return outgoing.result
        if recorded == "handed_over":
            return outgoing.result  # written with others, then published, by the writer
        if recorded == "held":
            return outgoing.result  # due far ahead: the reaper publishes it when due
        crash_point("after_retry_recorded")
        return _submission.publish(self, rt, outgoing, producer)

    # -- inside the task: steps, progress, cancellation --------------------------------

    def _execution(self) -> Execution:
        execution = _attempt.current.get()
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
        if _attempt.current.get() is None:
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
