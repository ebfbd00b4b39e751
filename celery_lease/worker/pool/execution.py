"""One execution of a leased task: its lease, its steps, its progress cursor."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

from celery._state import get_current_task
from celery.exceptions import Ignore

from ..._crashpoints import armed, step_crash_point
from ...exceptions import (
    DuplicateStep,
    InvalidSubmissionValue,
    LeaseLost,
    NotSerializable,
    TaskCancelled,
)
from ...states import STEP_DONE as DONE
from ...states import STEP_STARTED as STARTED
from ...store import Claim, FenceResult, RecordedStep, Store

_MISSING = object()


def encode(what: str, value: Any, limit: int | None = None, *, argument: str | None = None) -> str:
    """JSON-encode ``value`` or raise :class:`NotSerializable` naming ``what``.

    A value nested too deeply for the encoder (a ``RecursionError``) is refused too:
    with ``argument`` (a submission's ``args`` or ``kwargs``) as
    :class:`InvalidSubmissionValue` naming it, otherwise as :class:`NotSerializable`.
    """
    try:
        text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as error:
        raise NotSerializable(what, error) from error
    except RecursionError:
        deep = ValueError(f"nested deeper than JSON can store (about {sys.getrecursionlimit()})")
        if argument is not None:
            raise InvalidSubmissionValue(argument, f"{what} cannot be stored: {deep}") from None
        raise NotSerializable(what, deep) from None
    if limit is not None and len(text) > limit:
        raise NotSerializable(what, ValueError(f"{len(text)} bytes, over the {limit}-byte limit"))
    return text


class StoreDownDuringTask(Ignore):
    """The lease store failed while a delivery was claimed or ran (raised from the pool
    child). An ``Ignore`` to Celery, so nothing reports FAILURE for a task that will run
    again; the worker's main process sees it and expires the lease (or publishes the
    delivery again) as soon as the database answers. ``attempt``: the attempt the
    delivery had claimed (``None``: it had not, or the claim's outcome is unknown)."""

    def __init__(self, reason: str, attempt: int | None = None) -> None:
        self.reason = reason
        self.attempt = attempt
        super().__init__(reason)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.reason, self.attempt))


def _task_name() -> str | None:
    task = get_current_task()
    return None if task is None else str(task.name)


class Execution:
    """What a running task knows about its own lease (``self.request.lease``)."""

    def __init__(
        self,
        *,
        store: Store,
        claim: Claim,
        fenced: Callable[[], bool],
        check_interval: float,
        holds_slot: bool = False,
    ) -> None:
        self.store = store
        self.claim = claim
        self.lease = claim.lease
        #: The claim took a concurrency slot: its outcome frees it, written through.
        self.holds_slot = holds_slot
        #: Set once the outcome (or a retry) has been written: nothing more is written.
        self.finished = False
        #: The error that made the task call ``retry()`` (for the audit trail).
        self.retry_error: str | None = None
        self._fenced = fenced
        self._check_interval = check_interval
        self._checked_at = time.monotonic()
        self._cancel: FenceResult | None = (
            FenceResult(True, None) if claim.cancel_requested else None
        )
        self._recorded: dict[str, RecordedStep] | None = None if claim.resumed else {}
        self._seen: set[str] = set()

    @property
    def task_id(self) -> str:
        return self.lease.task_id

    @property
    def attempt(self) -> int:
        return self.lease.attempt

    # -- boundaries -------------------------------------------------------------------

    def _lost(self, reason: str = "lease lost: another attempt owns this task now") -> LeaseLost:
        self.finished = True
        return LeaseLost(self.task_id, self.attempt, reason)

    def _answer(self, fenced: FenceResult | None) -> None:
        if fenced is None:
            raise self._lost()
        self._checked_at = time.monotonic()
        if fenced.cancel_requested:
            self._cancel = fenced

    def boundary(self) -> None:
        """A step boundary: stop if the lease is lost or a cancel was requested.

        Reads the row at most once per heartbeat interval; writes in between
        already bring the answer back.
        """
        if self._fenced():
            raise self._lost("lease lost: the worker could not renew its heartbeat (self-fenced)")
        if time.monotonic() - self._checked_at >= self._check_interval:
            self._answer(self.store.check_lease(self.lease))
        if self._cancel is not None:
            raise TaskCancelled(self.task_id, self._cancel.cancel_reason)

    # -- steps ------------------------------------------------------------------------

    def recorded(self) -> dict[str, RecordedStep]:
        if self._recorded is None:
            self._recorded = self.store.load_steps(self.task_id)
        return self._recorded

    def step(
        self,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        idempotent: bool,
        check: Callable[..., Any] | None,
    ) -> Any:
        if not isinstance(name, str) or not name:
            raise TypeError("a step name must be a non-empty string")
        if name in self._seen:
            raise DuplicateStep(self.task_id, name)
        self._seen.add(name)
        self.boundary()
        earlier = self.recorded().get(name)
        if earlier is not None and earlier.state == DONE:
            return json.loads(earlier.result) if earlier.result is not None else None
        if earlier is not None and earlier.state == STARTED and check is not None:
            found = check(*args, **kwargs)
            if found is not None:
                return self._store_result(name, found, idempotent=idempotent)
        if armed():
            step_crash_point("before_step", _task_name(), name)
        if not idempotent:
            self._answer(self.store.step_started(self.lease, name, checkable=check is not None))
            if self._cancel is not None:
                raise TaskCancelled(self.task_id, self._cancel.cancel_reason)
        value = fn(*args, **kwargs)
        if armed():
            step_crash_point("after_step", _task_name(), name)
        return self._store_result(name, value, idempotent=idempotent)

    def _store_result(self, name: str, value: Any, *, idempotent: bool) -> Any:
        text = encode(f"result of step {name!r}", value)
        fenced, stored = self.store.step_done(self.lease, name, text, idempotent=idempotent)
        self._answer(fenced)
        if self._recorded is not None:
            self._recorded[name] = RecordedStep(DONE, stored, self.attempt)
        return json.loads(stored)

    # -- progress ---------------------------------------------------------------------

    def save_progress(self, value: Any) -> None:
        self.boundary()
        self._answer(self.store.save_progress(self.lease, encode("progress value", value)))
        if self._cancel is not None:
            raise TaskCancelled(self.task_id, self._cancel.cancel_reason)

    def load_progress(self, default: Any = None) -> Any:
        text = self.store.load_progress(self.task_id)
        return default if text is None else json.loads(text)
