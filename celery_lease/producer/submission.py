"""Submission: the one path from ``apply_async`` to a written row and a sent message.

Every way a leased task is submitted goes through here: ``apply_async`` (publish at
once), ``connection=`` (publish after a SQLAlchemy ``Session`` or ``Connection``
commits, in :mod:`celery_lease.producer.outbox`), Django's ``on_commit``
(:mod:`celery_lease.contrib.django.outbox`), and bulk submission. Each prepares the
same value first, :func:`prepare`: the arguments checked against the documented limits
and encoded, the message Celery built (:mod:`celery_lease.producer.message`) and the row that
holds it; only the *when to publish* differs. The row is always written before its
message is published (the row is the outbox).

Bulk submission:

* :meth:`LeasedTask.submit_many <celery_lease.LeasedTask.submit_many>` submits one
  task with many argument sets, each with its own ``dedup_key``, ``countdown`` or
  ``eta``; duplicates are reported per item.
* :func:`bulk` is a block inside which every leased ``apply_async`` (so a ``group``,
  a chord's header, ``chunks``) is collected; at the end of the block the rows are
  written, a few hundred per statement, and then the messages are published.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol
from uuid import uuid4

from celery import Celery
from celery import result as _result
from celery.result import AsyncResult
from celery.utils import uuid
from kombu.exceptions import EncodeError
from kombu.exceptions import OperationalError as KombuOperationalError
from kombu.serialization import dumps as kombu_dumps

from .._crashpoints import crash_point
from .._runtime import Runtime, runtime
from ..config import LeaseConfig
from ..exceptions import DuplicateSubmission, InvalidSubmissionValue, NotSerializable
from ..store import Lease, LeaseOptions, NewTask, Replacement, Unique, dumps
from . import message as _message
from . import slots as _slots
from .limits import check_arguments_size, check_submission, check_unique, checked_option

#: apply_async options kept in the row so that a re-published message is routed the same way.
_ROUTING_OPTIONS = ("queue", "routing_key", "exchange", "priority")


class LeasableTask(Protocol):
    """What submission needs of a task (``LeasedTask`` is one)."""

    name: str

    @property
    def app(self) -> Celery: ...

    def AsyncResult(self, task_id: str, **kwargs: Any) -> _result.AsyncResult[Any]: ...

    def lease_options(self, config: LeaseConfig) -> LeaseOptions: ...

    def apply_async(self, *args: Any, **kwargs: Any) -> _result.AsyncResult[Any]: ...


def prepare(
    task: LeasableTask,
    args: Any,
    kwargs: Any,
    task_id: str,
    dedup_key: str | None,
    options: dict[str, Any],
    *,
    link: Any = None,
    link_error: Any = None,
    shadow: str | None = None,
    producer: Any = None,
) -> tuple[NewTask, _message.Outgoing]:
    """The row and the message of one submission, nothing written or sent yet.

    The ids and the schedule are checked against the documented limits first (a naive
    ``eta`` is in the app's timezone, as Celery's worker reads it); then Celery builds
    the message, serialized with the task's serializer as Celery would send it, and the
    row's ``args``/``kwargs`` show the arguments as that message carries them (JSON as
    Celery's JSON serializer writes it).

    Raises:
        NotSerializable: the task's serializer refuses the arguments.
        InvalidSubmission: an argument is outside the documented limits.
    """
    rt = runtime(task.app)
    config = rt.config
    eta = options.get("eta")
    if isinstance(eta, datetime) and eta.tzinfo is None:
        eta = eta.replace(tzinfo=task.app.timezone)
    when = check_submission(
        task_name=task.name,
        task_id=task_id,
        dedup_key=dedup_key,
        countdown=options.get("countdown"),
        eta=eta,
    )
    # Celery builds the message (nothing is sent) and its serializer is the judge of the
    # arguments: what it accepts, the row accepts
    try:
        outgoing = _message.build(
            task, args, kwargs, task_id, link, link_error, shadow, producer, **options
        )
    except RecursionError:
        raise _too_deep(task.name, args, kwargs) from None
    # what Celery refuses while building, before any encoding (arguments that do not
    # fit the task's signature, soft_time_limit over time_limit), is raised as it is
    try:
        message = outgoing.stored()
    except RecursionError:
        raise _too_deep(task.name, args, kwargs) from None
    except (EncodeError, TypeError, ValueError) as error:
        inner = (error.__cause__, error.__context__, *error.args)  # kombu wraps it
        if any(isinstance(e, RecursionError) for e in inner):
            raise _too_deep(task.name, args, kwargs) from None
        serializer = str(outgoing.calls[0][1].get("serializer") or task.app.conf.task_serializer)
        cause = error.__cause__ if isinstance(error.__cause__, Exception) else error
        what = _refused(outgoing, serializer) or "arguments"
        raise NotSerializable(f"{what} of {task.name}", cause, serializer) from error
    args_text, kwargs_text = _message.arguments_text(*outgoing.arguments())
    check_arguments_size(task.name, args_text, kwargs_text, config.args_max_bytes)
    limit = _slots.limit_of(task)
    if limit is not None:
        # a key that cannot be made fails here, before anything is written
        limit.key_of(*outgoing.arguments())
    routing: dict[str, Any] = {}
    for key in _ROUTING_OPTIONS:
        value = options.get(key)
        if value is not None:
            routing[key] = getattr(value, "name", value)
    new = NewTask.of(
        task.lease_options(config),
        resend=_resending.get(),
        id=task_id,
        name=task.name,
        args=args_text,
        kwargs=kwargs_text,
        options=dumps(routing),
        dedup_key=dedup_key,
        countdown=when.countdown,
        eta=when.eta,
        message=message,
        # due far ahead: written, and published by the reaper when due
        held=rt.store.holds(when.countdown, when.eta),
    )
    return new, outgoing


def _too_deep(task_name: str, args: Any, kwargs: Any) -> InvalidSubmissionValue:
    """The arguments are nested deeper than a serializer can go (a ``RecursionError``)."""
    argument = "kwargs"
    try:
        _message.arguments_text(args, {}, exact=True)
    except RecursionError:
        argument = "args"
    except (TypeError, ValueError):
        pass
    return InvalidSubmissionValue(
        argument,
        f"{argument} of {task_name} cannot be stored: nested deeper than JSON can store "
        f"(about {sys.getrecursionlimit()})",
    )


def _refused(outgoing: _message.Outgoing, serializer: str) -> str | None:
    """Which argument ``serializer`` refuses (``"argument 1"``, ``"keyword argument
    'when'"``), found by encoding each alone; ``None`` if each alone is accepted."""
    args, kwargs = outgoing.arguments()
    named = [(f"argument {i}", v) for i, v in enumerate(args)]
    named += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
    for name, value in named:
        try:
            kombu_dumps(value, serializer)
        except Exception:
            return name
    return None


def submit(
    task: LeasableTask,
    args: Any,
    kwargs: Any,
    task_id: str | None,
    producer: Any,
    link: Any,
    link_error: Any,
    shadow: str | None,
    dedup_key: str | None,
    connection: Any,
    options: dict[str, Any],
    unique: Unique | None = None,
) -> AsyncResult[Any]:
    """``apply_async`` of a leased task: prepare, write the row, then publish (at once,
    after the caller's transaction commits, or at the end of a :func:`bulk` block).
    ``unique``: the dedup key's uniqueness options (:func:`uniqueness`)."""
    rt = runtime(task.app)
    if dedup_key is not None and unique is not None and not unique.plain:
        if connection is not None:
            raise InvalidSubmissionValue(
                "connection",
                f"task {task.name}: unique_for, unique_while and on_conflict other than "
                '"return" are not supported with connection= (submit without connection=, '
                "or with a plain dedup_key)",
            )
        return _submit_unique(
            task,
            rt,
            args,
            kwargs,
            task_id or uuid(),
            dedup_key,
            options,
            unique,
            link=link,
            link_error=link_error,
            shadow=shadow,
            producer=producer,
        )
    new, outgoing = prepare(
        task,
        args,
        kwargs,
        task_id or uuid(),
        dedup_key,
        options,
        link=link,
        link_error=link_error,
        shadow=shadow,
        producer=producer,
    )
    if connection is None and dedup_key is None:
        batch = collecting(task.app)
        if batch is not None:  # inside celery_lease.bulk(): written when the block ends
            # a producer given here is the caller's for this call only (Celery's group
            # loop gives its pooled producer back before the block ends): the block
            # publishes on one of its own
            batch.add(new, outgoing)
            return outgoing.result
    if connection is not None:
        from .outbox import submit_in_transaction

        return submit_in_transaction(
            task,
            rt,
            new,
            connection,
            (lambda: None) if new.held else (lambda: publish(task, rt, outgoing, producer)),
        )
    tid, created = rt.store.submit(new)
    crash_point("after_insert")
    if not created:
        logger.info(
            "task %s[%s]: %s, nothing published",
            task.name,
            tid,
            "already submitted with this dedup key"
            if dedup_key is not None
            else "this task id is already submitted and not finished (or cancelled)",
        )
        return task.AsyncResult(tid)
    if new.held:
        logger.debug("task %s[%s]: held until its ETA, the reaper publishes it", task.name, tid)
        return outgoing.result
    return publish(task, rt, outgoing, producer)


#: An ``apply_async`` option not given (its task's default applies).
DEFAULT: Any = object()


def uniqueness(
    task: LeasableTask,
    dedup_key: str | None,
    unique_for: Any = DEFAULT,
    unique_while: Any = DEFAULT,
    on_conflict: Any = DEFAULT,
) -> Unique | None:
    """The uniqueness options of one submission: those given, the task's defaults for
    the rest (``None``: the submission has no dedup key, so none apply).

    Raises:
        InvalidSubmissionValue: an option is invalid, or given without a ``dedup_key``.
    """
    given = {
        name: value
        for name, value in (
            ("unique_for", unique_for),
            ("unique_while", unique_while),
            ("on_conflict", on_conflict),
        )
        if value is not DEFAULT
    }
    if dedup_key is None:
        if given:
            name = next(iter(given))
            raise InvalidSubmissionValue(
                name, f"task {task.name}: {name} is given without a dedup_key: it applies to one"
            )
        return None
    found = checked_option(task, "_unique")
    default: Unique = found if isinstance(found, Unique) else Unique()
    if not given:
        return default
    return check_unique(
        f"task {task.name}",
        given.get("unique_for", default.unique_for),
        given.get("unique_while", default.unique_while),
        given.get("on_conflict", default.on_conflict),
    )


def _submit_unique(
    task: LeasableTask,
    rt: Runtime,
    args: Any,
    kwargs: Any,
    task_id: str,
    dedup_key: str,
    options: dict[str, Any],
    unique: Unique,
    **build: Any,
) -> AsyncResult[Any]:
    """A submission whose dedup key has uniqueness options: the store decides, in one
    transaction (:meth:`~celery_lease.store.Store.submit_unique`), whether it is a new
    task, a duplicate, or (``on_conflict="replace"``) new arguments for the PENDING task
    holding the key; a new task's message, or the replacement's, is then published."""
    new, outgoing = prepare(task, args, kwargs, task_id, dedup_key, options, **build)
    replacements: dict[str, tuple[Replacement, _message.Outgoing]] = {}

    def replacement(existing: str) -> Replacement:
        # the message of the task holding the key, with these arguments and a revision
        # of its own: a message sent before carries none (or an older one), and its
        # claim is refused
        made = replacements.get(existing)
        if made is None:
            revision = uuid4().hex
            headers = {**(options.get("headers") or {}), _message.REVISION_HEADER: revision}
            row, message = prepare(
                task, args, kwargs, existing, dedup_key, {**options, "headers": headers}, **build
            )
            made = replacements[existing] = (
                Replacement(
                    args=row.args,
                    kwargs=row.kwargs,
                    options=row.options,
                    message=row.message,
                    revision=revision,
                    countdown=row.countdown,
                    eta=row.eta,
                ),
                message,
            )
        return made[0]

    answer = rt.store.submit_unique(
        new, unique, replacement if unique.on_conflict == "replace" else None
    )
    crash_point("after_insert")
    if answer.outcome == "created":
        return publish(task, rt, outgoing, build.get("producer"))
    if answer.outcome == "replaced":
        logger.info(
            "task %s[%s]: arguments replaced by a later submission (dedup key %r)",
            task.name,
            answer.task_id,
            dedup_key,
        )
        return publish(task, rt, replacements[answer.task_id][1], build.get("producer"))
    if unique.on_conflict == "raise":
        raise DuplicateSubmission(
            dedup_key, answer.task_id, answer.state.value if answer.state else None
        )
    logger.info(
        "task %s[%s]: already submitted with this dedup key, nothing published",
        task.name,
        answer.task_id,
    )
    return task.AsyncResult(answer.task_id)


def publish(
    task: LeasableTask, rt: Runtime, outgoing: _message.Outgoing, producer: Any
) -> AsyncResult[Any]:
    """Send a message whose row is committed (PENDING, not yet marked published)."""
    task_id = outgoing.task_id
    try:
        _message.send(task.app, outgoing, producer, timeout=rt.config.db_timeout)
    except (KombuOperationalError, ConnectionError, OSError) as error:
        # the row is the outbox: the reaper publishes its message once the broker is back
        logger.warning(
            "task %s[%s] recorded but not published (%s): the reaper will publish it",
            task.name,
            task_id,
            error,
        )
        return outgoing.result
    crash_point("after_publish")
    # recorded a few ms later, with others, or inside this process's next submit: if
    # that never happens the row is re-published after lease_publish_grace and the
    # extra message is dropped at claim
    rt.store.mark_published_soon(task_id)
    return outgoing.result


# -- bulk submission ----------------------------------------------------------------------

logger = logging.getLogger("celery_lease")

#: Keys an item of ``submit_many`` may have, besides being an ``(args, kwargs)`` pair.
ITEM_KEYS = frozenset({"args", "kwargs", "dedup_key", "countdown", "eta", "task_id"})


@dataclasses.dataclass(frozen=True)
class Submitted:
    """What one item of a bulk submission became."""

    #: The task's result handle (the existing task's, for a duplicate).
    result: AsyncResult[Any]
    #: ``False``: a task with the same dedup key (or id) existed; nothing was published.
    created: bool

    @property
    def task_id(self) -> str:
        return str(self.result.id)


@dataclasses.dataclass(frozen=True)
class Replaced:
    """The run a batch replaces: its lease, and the outcome's actor and reason."""

    lease: Lease
    actor: str
    reason: str


@dataclasses.dataclass
class _Pending:
    new: NewTask
    outgoing: _message.Outgoing


class _Batch:
    """The rows and messages collected by one :func:`bulk` block (or one call)."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.items: list[_Pending] = []

    def add(self, new: NewTask, outgoing: _message.Outgoing) -> None:
        self.items.append(_Pending(new, outgoing))

    def commit(self, replaced: Replaced | None = None) -> list[Submitted] | None:
        """Write every row (multi-row statements), then publish the created ones.

        ``replaced``: the run these rows replace (``Task.replace()``): its outcome and
        the rows are one transaction; ``None`` is returned, and nothing published, when
        its lease was lost.
        """
        if not self.items and replaced is None:
            return []
        rt = runtime(self.app)
        store = rt.store
        rows = [p.new for p in self.items]
        if replaced is None:
            answers = store.submit_many(rows)
        else:
            written = store.replace(
                replaced.lease, rows, actor=replaced.actor, reason=replaced.reason
            )
            if written is None:
                return None
            answers = written
            crash_point("after_replace_recorded")
        crash_point("after_insert")
        # the rows held (due far ahead) are published by the reaper when due
        created = [
            p for p, (_, made) in zip(self.items, answers, strict=True) if made and not p.new.held
        ]
        sent: list[str] = []
        try:
            # a producer of our own: the one a caller passed to apply_async (Celery's
            # chord passes its own to the header's members) may be back in kombu's pool,
            # its channel gone, by the time the block ends
            with self.app.producer_or_acquire(None) as producer:
                for pending in created:
                    _message.send(
                        self.app, pending.outgoing, producer, timeout=rt.config.db_timeout
                    )
                    sent.append(pending.outgoing.task_id)
        except (KombuOperationalError, ConnectionError, OSError) as error:
            # the rows are the outbox: the reaper publishes the rest once the broker is back
            logger.warning(
                "%d tasks recorded but not published (%s): the reaper will publish them",
                len(created) - len(sent),
                error,
            )
        crash_point("after_publish")
        # the rows are committed and their messages sent: the submission has succeeded
        # whatever happens next. Recording "published" is bookkeeping, done off this
        # path as for a single apply_async: if the database stops answering now, the
        # marks are logged as not recorded, and a row still PENDING after
        # lease_publish_grace is published again (the extra message dropped at claim)
        for task_id in sent:
            store.mark_published_soon(task_id)
        out = []
        for pending, (task_id, made) in zip(self.items, answers, strict=True):
            result = pending.outgoing.result if made else self.app.AsyncResult(task_id)
            out.append(Submitted(result, made))
        return out


_active: contextvars.ContextVar[_Batch | None] = contextvars.ContextVar(
    "celery_lease_bulk", default=None
)

#: Set while a message already submitted once is sent again (see :func:`resending`).
_resending: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "celery_lease_resending", default=False
)


@contextlib.contextmanager
def resending() -> Iterator[None]:
    """Inside the block, a submission sends again a message submitted once before (a
    follow-up published a second time after a crash), it is not a new submission: an id
    that has a row is that task and publishes nothing, even once it finished, unless a
    replaced run left the row for its replacement. Outside, a new submission of a
    finished task's id runs it again, as Celery does."""
    token = _resending.set(True)
    try:
        yield
    finally:
        _resending.reset(token)


def in_bulk() -> bool:
    """Whether a :func:`bulk` block is open in this context (for any app)."""
    return _active.get() is not None


def collecting(app: Celery) -> _Batch | None:
    """The :func:`bulk` block open for ``app`` in this context, if any."""
    batch = _active.get()
    return batch if batch is not None and batch.app is app else None


@contextlib.contextmanager
def bulk(app: Celery | None = None) -> Iterator[list[Submitted]]:
    """Collect the leased tasks submitted inside the block; write their rows in
    multi-row statements and publish them when it ends::

        with celery_lease.bulk(app) as submitted:
            group(resize.s(image) for image in images).apply_async()
        # written and published here; `submitted` lists what each apply_async became

    Results returned inside the block are valid task handles; the tasks exist once
    the block has ended. If the block raises, nothing is written or published. A
    submission with a ``dedup_key`` (whose handle depends on the database) or a
    ``connection`` (its own transaction) is written at once, not collected.

    Args:
        app: the Celery app whose leased tasks are collected (default: the current app).
    """
    if _active.get() is not None:
        raise RuntimeError("celery_lease.bulk() blocks do not nest")
    if app is None:
        # what celery.current_app stands for
        from celery._state import get_current_app

        app = get_current_app()
    batch = _Batch(app)
    token = _active.set(batch)
    submitted: list[Submitted] = []
    try:
        yield submitted
    finally:
        _active.reset(token)
    submitted.extend(batch.commit() or ())


@contextlib.contextmanager
def collected(app: Celery) -> Iterator[_Batch]:
    """Collect the leased tasks submitted inside the block into a batch the caller
    commits (``Task.replace()``: with the replaced run's outcome). Blocks do not nest;
    a :func:`bulk` block already open collects into its own batch."""
    batch = _Batch(app)
    token = _active.set(batch)
    try:
        yield batch
    finally:
        _active.reset(token)


def submit_many(
    task: LeasableTask,
    items: Iterable[Sequence[Any] | Mapping[str, Any]],
    options: dict[str, Any],
) -> list[Submitted]:
    """See :meth:`LeasedTask.submit_many`."""
    if task.app.conf.task_always_eager:
        out = []
        for args, kwargs, extra in _items(items):
            out.append(Submitted(task.apply_async(args, kwargs, **extra, **options), True))
        return out
    given = [k for k in ("unique_for", "unique_while", "on_conflict") if k in options]
    if given:
        raise InvalidSubmissionValue(
            given[0],
            f"task {task.name}: submit_many() does not take {given[0]}: submit such tasks "
            "with apply_async",
        )
    found = checked_option(task, "_unique")
    default = found if isinstance(found, Unique) else None
    plain = default is None or default.plain
    batch = _Batch(task.app)
    for index, (args, kwargs, extra) in enumerate(_items(items)):
        task_id = extra.pop("task_id", None) or uuid()
        dedup_key = extra.pop("dedup_key", None)
        if dedup_key is not None and not plain:
            raise InvalidSubmissionValue(
                "dedup_key",
                f"task {task.name} has unique_for, unique_while or on_conflict: submit_many() "
                f"does not apply them (item {index} has a dedup_key): use apply_async",
            )
        merged = {**options, **extra}
        try:
            new, outgoing = prepare(task, args, kwargs, task_id, dedup_key, merged)
        except Exception as error:
            if hasattr(error, "add_note"):  # Python 3.11+
                error.add_note(f"in item {index} of submit_many()")
            raise
        batch.add(new, outgoing)
    return batch.commit() or []


def _items(
    items: Iterable[Sequence[Any] | Mapping[str, Any]],
) -> Iterator[tuple[Any, Any, dict[str, Any]]]:
    for index, item in enumerate(items):
        if isinstance(item, Mapping):
            unknown = set(item) - ITEM_KEYS
            if unknown:
                raise TypeError(
                    f"submit_many() item {index}: unknown keys {sorted(unknown)} "
                    f"(allowed: {sorted(ITEM_KEYS)})"
                )
            extra = {k: item[k] for k in ("dedup_key", "countdown", "eta", "task_id") if k in item}
            yield item.get("args") or (), item.get("kwargs") or {}, extra
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            yield item[0] or (), item[1] or {}, {}
        else:
            raise TypeError(
                f"submit_many() item {index} must be an (args, kwargs) pair or a dict with "
                f"keys among {sorted(ITEM_KEYS)}, got {type(item).__name__}"
            )
