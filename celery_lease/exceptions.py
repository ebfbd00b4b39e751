"""Exception hierarchy.

Every exception derives from :class:`Exception` (never ``BaseException``):
Celery's tracer re-raises ``BaseException`` without recording the task state.
Details are attributes, not text to parse.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._state import State


class CeleryLeaseError(Exception):
    """Base class of every error raised by celery-lease."""


class ConfigurationError(CeleryLeaseError):
    """A ``lease_*`` setting or a task option is invalid."""


class MissingDependencyError(ConfigurationError, ImportError):
    """An optional dependency is not installed; ``extra`` names the extra to install."""

    def __init__(self, package: str, extra: str) -> None:
        self.package = package
        self.extra = extra
        super().__init__(f"{package} is not installed: pip install 'celery-lease[{extra}]'")


class NotSerializable(CeleryLeaseError, TypeError):
    """A value cannot be stored: task arguments the task's serializer refuses (as plain
    Celery would at publish), a step result or a progress cursor that is not JSON."""

    def __init__(self, what: str, error: Exception, serializer: str | None = None) -> None:
        self.what = what
        #: The Celery serializer that refused the arguments (``None``: a JSON value).
        self.serializer = serializer
        if serializer is None:
            super().__init__(f"{what} cannot be stored as JSON: {error}")
        else:
            super().__init__(f"{what} cannot be serialized with {serializer!r}: {error}")


class DuplicateStep(CeleryLeaseError, ValueError):
    """A step name was used twice in one run of a task."""

    def __init__(self, task_id: str, name: str) -> None:
        self.task_id = task_id
        self.name = name
        super().__init__(
            f"step {name!r} used twice in one run of task {task_id}: "
            "give each call a distinct name (e.g. f'send:{user_id}')"
        )


class DuplicateSubmission(CeleryLeaseError, ValueError):
    """A submission with ``on_conflict="raise"`` found its ``dedup_key`` held by a task
    that still deduplicates (inside its ``unique_for`` window, in a ``unique_while``
    state): nothing was written or published. ``task_id`` names that task."""

    def __init__(self, dedup_key: str, task_id: str, state: str | None = None) -> None:
        self.dedup_key = dedup_key
        self.task_id = task_id
        self.state = state
        held = f" ({state})" if state else ""
        super().__init__(
            f"dedup_key {dedup_key!r} is held by task {task_id}{held}: nothing submitted"
        )


class InvalidSubmission(CeleryLeaseError):
    """A submission is outside the documented limits; ``argument`` names what is wrong.

    Raised by ``apply_async`` before anything is written or published, the same on every
    store. Catch ``ValueError`` or ``TypeError`` (each subclass is one of them) or this.
    """

    def __init__(self, argument: str, message: str) -> None:
        self.argument = argument
        super().__init__(message)


class InvalidSubmissionValue(InvalidSubmission, ValueError):
    """A submission argument has the right type but a value outside the limits."""


class InvalidSubmissionType(InvalidSubmission, TypeError):
    """A submission argument has a type celery-lease cannot store."""


class ArgumentsTooLarge(InvalidSubmissionValue):
    """The task's arguments, as JSON, exceed ``lease_args_max_bytes``."""

    def __init__(self, argument: str, size: int, limit: int, task_name: str) -> None:
        self.size = size
        self.limit = limit
        super().__init__(
            argument,
            f"{argument} of task {task_name}: {size} bytes as JSON, over lease_args_max_bytes "
            f"({limit}); pass an id or a URL of the data instead of the data itself",
        )


class StoreError(CeleryLeaseError):
    """The database driver failed; the original error is in ``__cause__``."""


class StoreUnavailable(StoreError):
    """The database cannot be reached right now (transient: retried with backoff)."""


class SubmissionOutcomeUnknown(StoreUnavailable):
    """The database stopped answering after a submission's rows were sent to it: they
    may have been written, or not.

    A client cannot take back a statement it sent. On PostgreSQL a single submission's
    statement carries the call's deadline in database time and writes nothing if it
    starts later (a statement held up in the network and delivered after the call gave
    up is a no-op), so the outcome is settled when this is raised, unless the statement
    started in time and then waited (on a concurrent insert of the same id or dedup key,
    or a synchronous standby). A row that was written is published by the reaper after
    ``lease_publish_grace``. So retry with the same ``task_id`` (or
    ``dedup_key``): a row already written answers the retry as a duplicate, and runs
    once either way. SQLite is a local file: its outcome is always known, so this is
    raised there only for a bulk submission whose earlier batches were written.
    """

    def __init__(self, task_ids: Sequence[str], message: str) -> None:
        #: Every task of the submission whose row may have been written.
        self.task_ids = tuple(task_ids)
        #: The first (for a single submission, the only) one.
        self.task_id = self.task_ids[0] if self.task_ids else None
        super().__init__(message)


class StoreDataError(StoreError, ValueError):
    """The database refused a value the call gave it (too long, out of range, against a
    constraint): the request is wrong, not the database; retrying does not help."""


class SchemaOutOfDate(StoreError):
    """The lease tables are missing, older than this version of celery-lease, or newer
    (this code is older than the store: upgrade celery-lease to ``expected`` or later)."""

    def __init__(self, current: int | None, expected: int, url: str) -> None:
        self.current = current
        self.expected = expected
        if current is not None and current > expected:
            message = (
                f"{url} has schema version {current}, newer than this celery-lease knows "
                f"(version {expected}): the code is older than the store; install the "
                f"celery-lease release that migrated it (schema version {current})"
            )
        else:
            found = "no lease tables" if current is None else f"schema version {current}"
            message = (
                f"{url} has {found}, celery-lease needs version {expected}: "
                "run `celery -A proj lease migrate` (or set lease_auto_migrate = True)"
            )
        super().__init__(message)


class LeaseError(CeleryLeaseError):
    """An error about one task's lease; ``task_id`` and ``attempt`` say which."""

    def __init__(self, task_id: str | None, attempt: int | None, message: str) -> None:
        self.task_id = task_id
        self.attempt = attempt
        super().__init__(message)


class LeaseLost(LeaseError):
    """This execution no longer holds the task's lease: it must stop and write nothing more."""

    def __init__(self, task_id: str, attempt: int | None, reason: str = "lease lost") -> None:
        self.reason = reason
        super().__init__(task_id, attempt, f"task {task_id} attempt {attempt}: {reason}")


class IllegalTransition(LeaseError):
    """The transition table does not allow this change from the task's current state."""

    def __init__(
        self,
        task_id: str | None,
        from_state: State | None,
        to_state: State,
        attempt: int | None = None,
    ) -> None:
        self.from_state = from_state
        self.to_state = to_state
        source = from_state.value if from_state is not None else "(new)"
        super().__init__(
            task_id,
            attempt,
            f"task {task_id}: {source} -> {to_state.value} is not an allowed transition",
        )


class TaskNotFound(LeaseError):
    """No row with this task id exists."""

    def __init__(self, task_id: str) -> None:
        super().__init__(task_id, None, f"no leased task with id {task_id!r}")


class TaskFailed(CeleryLeaseError):
    """What the result backend holds for a task whose row ended FAILED without its own
    exception (an operator's ``fail``): ``AsyncResult.get()`` raises it."""

    def __init__(self, task_id: str, reason: str | None = None, actor: str | None = None) -> None:
        self.task_id = task_id
        self.reason = reason
        self.actor = actor
        # the arguments, not the text: a result backend rebuilds it as TaskFailed(*args)
        super().__init__(task_id, reason, actor)

    def __str__(self) -> str:
        by = f" by {self.actor}" if self.actor else ""
        return f"task {self.task_id} failed{by}" + (f": {self.reason}" if self.reason else "")


class TaskCancelled(CeleryLeaseError):
    """Raised inside a running task at a step boundary after an operator asked to cancel it."""

    def __init__(self, task_id: str, reason: str | None = None) -> None:
        self.task_id = task_id
        self.reason = reason
        super().__init__(f"task {task_id} was cancelled" + (f": {reason}" if reason else ""))


class CeleryLeaseDeprecationWarning(FutureWarning):
    """A setting or a name that is going away; the message says what replaced it.

    A :class:`FutureWarning`, so that Python shows it by default: a deprecated setting is
    read deep inside the package, where a :class:`DeprecationWarning` would be hidden.
    """
