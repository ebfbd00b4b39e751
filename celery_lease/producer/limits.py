"""The limits of a submission, checked before anything is written or published.

One set of limits for every store: SQLite would accept text that PostgreSQL refuses
(a key over its column's 255 characters, a NUL), and a value the store cannot hold
must fail the same way everywhere, as a ``ValueError``/``TypeError`` that names the
argument, never as a ``StoreError`` after part of the work is done. Every submission
path (``apply_async``, the transactional outbox, bulk submission) calls
:func:`check_submission` and :func:`check_arguments_size`; they run on every
submission, so they only compare lengths of text that was built anyway.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from datetime import datetime, timezone
from numbers import Real

from ..config import MAX_SECONDS
from ..exceptions import (
    ArgumentsTooLarge,
    ConfigurationError,
    InvalidSubmissionType,
    InvalidSubmissionValue,
)
from ..states import State
from ..store import ON_CONFLICT, Unique

#: Longest task id, dedup key and task name, in characters (the columns are String(255)).
MAX_KEY_CHARS = 255


@dataclasses.dataclass(frozen=True)
class Schedule:
    """When a submitted task is due: ``countdown`` seconds from the database's now, or
    at ``eta`` (timezone-aware), or at once (both ``None``)."""

    countdown: float | None
    eta: datetime | None


def check_key(argument: str, value: object) -> str:
    """``value`` if it is text every store can hold as a key, else raise naming ``argument``.

    Raises:
        InvalidSubmissionType: not a string.
        InvalidSubmissionValue: empty, over :data:`MAX_KEY_CHARS` characters, containing
            a NUL character, or not encodable as UTF-8 (a lone surrogate).
    """
    if not isinstance(value, str):
        raise InvalidSubmissionType(
            argument, f"{argument} must be a string, got {type(value).__name__}"
        )
    if not value:
        raise InvalidSubmissionValue(argument, f"{argument} must be a non-empty string")
    if len(value) > MAX_KEY_CHARS:
        raise InvalidSubmissionValue(
            argument,
            f"{argument} is {len(value)} characters long, the limit is {MAX_KEY_CHARS} "
            "(hash a longer natural key, e.g. with hashlib.sha256)",
        )
    if "\x00" in value:
        raise InvalidSubmissionValue(argument, f"{argument} must not contain a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidSubmissionValue(
            argument, f"{argument} is not valid Unicode text: {error.reason}"
        ) from None
    return value


def check_schedule(countdown: object, eta: object) -> Schedule:
    """The validated schedule of a submission (``countdown`` wins over ``eta``, as in Celery).

    ``countdown`` is a finite number of seconds; ``eta`` a ``datetime`` (naive means UTC)
    or an ISO 8601 string.

    Raises:
        InvalidSubmissionType: ``countdown`` is not a number or ``eta`` not a datetime.
        InvalidSubmissionValue: ``countdown`` is not finite or ``eta`` is not ISO 8601.
    """
    if countdown is not None:
        if isinstance(countdown, bool) or not isinstance(countdown, Real):
            raise InvalidSubmissionType(
                "countdown",
                f"countdown must be a number of seconds, got {type(countdown).__name__}",
            )
        try:
            seconds = float(countdown)
        except OverflowError:  # an int past any float
            seconds = math.inf
        if not math.isfinite(seconds) or abs(seconds) > MAX_SECONDS:
            raise InvalidSubmissionValue(
                "countdown",
                "countdown must be a finite number of seconds, at most "
                f"{MAX_SECONDS:g} (ten years) either way, got {countdown!r}",
            )
        return Schedule(countdown=seconds, eta=None)
    if eta is None:
        return Schedule(countdown=None, eta=None)
    if isinstance(eta, str):
        try:
            eta = datetime.fromisoformat(eta)
        except ValueError:
            raise InvalidSubmissionValue(
                "eta", f"eta must be an ISO 8601 date and time, got {eta!r}"
            ) from None
    if not isinstance(eta, datetime):
        raise InvalidSubmissionType(
            "eta",
            f"eta must be a datetime (or an ISO 8601 string), got {type(eta).__name__}: "
            "for a delay in seconds use countdown=",
        )
    if eta.tzinfo is None:
        eta = eta.replace(tzinfo=timezone.utc)
    return Schedule(countdown=None, eta=eta)


def check_submission(
    *,
    task_name: str,
    task_id: object,
    dedup_key: object,
    countdown: object,
    eta: object,
) -> Schedule:
    """Check one submission's names and schedule; return its schedule.

    Raises:
        InvalidSubmissionType: an argument of the wrong type (names it).
        InvalidSubmissionValue: a value outside the limits (names it).
    """
    check_key("task name", task_name)
    check_key("task_id", task_id)
    if dedup_key is not None:
        check_key("dedup_key", dedup_key)
    return check_schedule(countdown, eta)


def check_arguments_size(
    task_name: str, args_text: str, kwargs_text: str, args_max_bytes: int
) -> None:
    """``args_text``/``kwargs_text``: the arguments as the row stores them (compact JSON
    with ASCII escapes, so characters are bytes).

    Raises:
        ArgumentsTooLarge: the arguments are over ``args_max_bytes`` (an
            :class:`InvalidSubmissionValue`).
    """
    size = len(args_text) + len(kwargs_text)
    if size > args_max_bytes:
        biggest = "args" if len(args_text) >= len(kwargs_text) else "kwargs"
        raise ArgumentsTooLarge(biggest, size, args_max_bytes, task_name)


def checked_option(task: object, name: str) -> object:
    """A leased task's option checked when it was bound (``_unique``,
    ``_concurrency``), or the :class:`ConfigurationError` found then, raised."""
    error = getattr(task, "_option_error", None)
    if error is not None:
        raise error
    return getattr(task, name, None)


def check_unique(
    where: str,
    unique_for: object,
    unique_while: object,
    on_conflict: object,
    *,
    task: bool = False,
) -> Unique:
    """The uniqueness options of a task (``where`` names it in the message) or of one
    submission, checked: ``unique_for`` a positive finite number of seconds (at most
    ten years), ``unique_while`` states of :class:`~celery_lease.State` (or their
    names), ``on_conflict`` one of ``"return"``, ``"raise"``, ``"replace"``.

    Raises:
        InvalidSubmissionValue: a submission's option (names it).
        ConfigurationError: with ``task``, a task's option.
    """

    def bad(argument: str, message: str) -> Exception:
        if task:
            return ConfigurationError(f"{where}: {message}")
        return InvalidSubmissionValue(argument, f"{where}: {message}")

    seconds: float | None = None
    if unique_for is not None:
        if isinstance(unique_for, bool) or not isinstance(unique_for, Real):
            raise bad(
                "unique_for",
                f"unique_for must be a number of seconds, got {type(unique_for).__name__}",
            )
        try:
            seconds = float(unique_for)
        except OverflowError:
            seconds = math.inf
        if not math.isfinite(seconds) or not 0 < seconds <= MAX_SECONDS:
            raise bad(
                "unique_for",
                f"unique_for must be a positive finite number of seconds, at most "
                f"{MAX_SECONDS:g} (ten years), got {unique_for!r}",
            )
    states: frozenset[State] | None = None
    if unique_while is not None:
        if isinstance(unique_while, (str, State)) or not isinstance(unique_while, Iterable):
            raise bad(
                "unique_while",
                "unique_while must be an iterable of states (e.g. [State.PENDING, "
                f"State.RUNNING]), got {unique_while!r}",
            )
        found: set[State] = set()
        for item in unique_while:
            try:
                found.add(State(item))
            except ValueError:
                known = ", ".join(s.value for s in State)
                raise bad(
                    "unique_while", f"unique_while: unknown state {item!r} (known: {known})"
                ) from None
        if not found:
            raise bad("unique_while", "unique_while must name at least one state")
        states = frozenset(found)
    if on_conflict not in ON_CONFLICT:
        raise bad("on_conflict", f"on_conflict must be one of {ON_CONFLICT}, got {on_conflict!r}")
    return Unique(seconds, states, str(on_conflict))
