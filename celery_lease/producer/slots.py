"""A task's concurrency limit: its options checked when the task binds, the key of
each submission and delivery, and the slots a commit freed granted to waiting rows and
published at once.

The options (decorator keyword arguments or class attributes of a ``LeasedTask``):

* ``concurrency_limit``: at most this many attempts RUNNING at once across all workers
  (per key when the task has a ``concurrency_key``);
* ``concurrency_key``: the name of an argument of the task (the key is
  ``"<name>=<value>"``), or a callable of ``(args, kwargs)`` returning the key; with a
  key and no limit (nor rate), the limit is 1 (one at a time per key);
* ``global_rate_limit``: ``"N/s"``, ``"N/m"``, ``"N/h"``: starts across all workers
  (per key), one every ``1/N`` of the unit, in database time.

How a slot is taken and freed is the store's (:mod:`celery_lease.store._slots`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from celery import Celery

from ..exceptions import ConfigurationError, InvalidSubmissionType, InvalidSubmissionValue
from ..store import Slot, Store
from . import publisher as _publisher
from .limits import MAX_KEY_CHARS, check_key, checked_option

#: A concurrency key: an argument's name, or a callable of (args, kwargs).
KeySpec = str | Callable[[tuple[Any, ...], dict[str, Any]], str] | None


@dataclasses.dataclass(frozen=True)
class Limit:
    """A task's checked concurrency options."""

    task: str
    #: At most this many RUNNING at once per key (``0``: no concurrency limit).
    limit: int
    key: KeySpec = None
    #: The task's signature, to find a named key among positional arguments.
    signature: inspect.Signature | None = None
    #: Seconds between two starts per key (``global_rate_limit``; ``None``: no rate limit).
    interval: float | None = None
    #: The ``global_rate_limit`` as the task gave it (for messages).
    rate: str | None = None

    def key_of(self, args: Any, kwargs: Any) -> str:
        """The key of a call with ``args`` and ``kwargs`` (``""``: the one global limit).

        Raises:
            InvalidSubmissionValue: the key cannot be made (names the task).
            InvalidSubmissionType: the key callable returned something other than text.
        """
        key = self.key
        if key is None:
            return ""
        args = tuple(args or ())
        kwargs = dict(kwargs or {})
        where = f"task {self.task}: concurrency_key"
        if isinstance(key, str):
            value = _argument(self.signature, key, args, kwargs, where)
            text = f"{key}={value}"
        else:
            try:
                text = key(args, kwargs)
            except Exception as error:
                raise InvalidSubmissionValue(
                    "concurrency_key", f"{where} raised {type(error).__name__}: {error}"
                ) from error
            if not isinstance(text, str):
                raise InvalidSubmissionType(
                    "concurrency_key",
                    f"{where} must return a string, got {type(text).__name__}",
                )
        try:
            return check_key("concurrency_key", text)
        except InvalidSubmissionValue as error:
            raise InvalidSubmissionValue("concurrency_key", f"task {self.task}: {error}") from None

    def slot_of(self, args: Any, kwargs: Any) -> Slot:
        return Slot(self.task, self.key_of(args, kwargs), self.limit, self.interval)


#: Seconds in each unit a ``global_rate_limit`` may use (Celery's ``rate_limit`` units).
_RATE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_rate(where: str, rate: Any) -> float:
    """Seconds between two starts for a ``global_rate_limit`` such as ``"100/s"``,
    ``"10/m"`` or ``"1000/h"`` (a number alone is per second, as in Celery).

    Raises:
        ConfigurationError: not a positive count per ``s``, ``m`` or ``h``.
    """
    text = rate if isinstance(rate, str) else None
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        text = f"{rate}/s"
    if text is None:
        raise ConfigurationError(
            f"{where}: global_rate_limit must be text such as '100/s', '10/m' or '1000/h', "
            f"got {type(rate).__name__}"
        )
    count, _, unit = text.strip().partition("/")
    unit = unit.strip() or "s"
    try:
        per = float(count)
    except ValueError:
        per = math.nan
    if unit not in _RATE_UNITS or not math.isfinite(per) or per <= 0:
        raise ConfigurationError(
            f"{where}: global_rate_limit must be a positive number of starts per 's', 'm' "
            f"or 'h' (such as '100/s', '10/m', '1000/h'), got {rate!r}"
        )
    return _RATE_UNITS[unit] / per


def _argument(
    signature: inspect.Signature | None,
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    where: str,
) -> Any:
    if name in kwargs:
        return kwargs[name]
    if signature is not None:
        try:
            bound = signature.bind_partial(*args, **kwargs)
        except TypeError as error:
            raise InvalidSubmissionValue("concurrency_key", f"{where}: {error}") from None
        if name in bound.arguments:
            return bound.arguments[name]
        parameter = signature.parameters.get(name)
        if parameter is not None and parameter.default is not inspect.Parameter.empty:
            return parameter.default
    raise InvalidSubmissionValue(
        "concurrency_key", f"{where}: the argument {name!r} is not given in this call"
    )


def run_signature(task_class: type) -> inspect.Signature | None:
    """The signature a task is called with (without ``self`` for a bound task)."""
    run = inspect.getattr_static(task_class, "run", None)
    if run is None:
        return None
    function = run.__func__ if isinstance(run, (staticmethod, classmethod)) else run
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    parameters = list(signature.parameters.values())
    if not isinstance(run, staticmethod) and parameters:
        parameters = parameters[1:]  # a method (a bound task, or a class's run): self
    return signature.replace(parameters=parameters)


def check(task_class: type) -> Limit | None:
    """A task class's concurrency options, checked (``None``: no limit).

    Raises:
        ConfigurationError: the limit is not a positive whole number, or the key is
            neither an argument of the task nor a callable.
    """
    name = getattr(task_class, "name", None) or task_class.__name__
    limit: Any = getattr(task_class, "concurrency_limit", None)
    key: Any = getattr(task_class, "concurrency_key", None)
    rate: Any = getattr(task_class, "global_rate_limit", None)
    if limit is None and key is None and rate is None:
        return None
    where = f"task {name}"
    interval = None if rate is None else parse_rate(where, rate)
    if limit is None:
        # a key alone: one at a time per key; a rate alone: no concurrency limit
        limit = 0 if key is None or interval is not None else 1
    elif isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigurationError(
            f"{where}: concurrency_limit must be a positive whole number, got {limit!r}"
        )
    signature = run_signature(task_class)
    if isinstance(key, str):
        if not key:
            raise ConfigurationError(f"{where}: concurrency_key must not be empty")
        if len(key) >= MAX_KEY_CHARS:
            raise ConfigurationError(f"{where}: concurrency_key {key!r} is too long")
        if signature is not None and not _names_parameter(signature, key):
            known = ", ".join(
                p.name
                for p in signature.parameters.values()
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            )
            raise ConfigurationError(
                f"{where}: concurrency_key {key!r} names no argument of the task "
                f"(its arguments: {known or 'none'}); give an argument's name or a "
                "callable of (args, kwargs)"
            )
    elif key is not None and not callable(key):
        raise ConfigurationError(
            f"{where}: concurrency_key must be an argument's name or a callable of "
            f"(args, kwargs), got {type(key).__name__}"
        )
    return Limit(name, limit, key, signature, interval, None if rate is None else str(rate))


def _names_parameter(signature: inspect.Signature, key: str) -> bool:
    parameter = signature.parameters.get(key)
    if parameter is not None:
        return parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    return False


# -- freed slots granted and published ------------------------------------------------------


def attach(app: Celery, store: Store) -> None:
    """Make ``store`` grant the slots its commits free and publish the rows granted
    them, from the process that committed (the worker whose outcome freed a slot, the
    reaper whose expiry did), at once."""

    # weakly: the store belongs to the app's runtime, which must not keep the app alive
    app_ref = weakref.ref(app)
    store_ref = weakref.ref(store)

    def freed(pairs: Sequence[tuple[str, str]]) -> None:
        owner, granting = app_ref(), store_ref()
        if owner is None or granting is None:
            return  # gone: the reaper's sweep grants the slots
        rows = granting.grant(pairs)
        if rows:
            _publisher.publish(owner, granting, rows)

    store.on_slots_freed = freed


def release_waiting(app: Celery, store: Store, *, limit: int | None = None) -> int:
    """The reaper's backstop: grant the free slots of keys with rows waiting and publish
    those rows; how many were published."""
    rows = store.take_waiting(limit=limit)
    sent, _ = _publisher.publish(app, store, rows)
    return sent


def limit_of(task: Any) -> Limit | None:
    """The checked concurrency options of a task object (``None``: none, or not a
    leased task)."""
    found = checked_option(task, "_concurrency")
    return found if isinstance(found, Limit) else None
