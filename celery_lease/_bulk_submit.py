"""Bulk submission: many leased tasks written in multi-row statements, then published.

* :meth:`LeasedTask.submit_many <celery_lease.LeasedTask.submit_many>` submits one
  task with many argument sets, each with its own ``dedup_key``, ``countdown`` or
  ``eta``; duplicates are reported per item.
* :func:`bulk` is a block inside which every leased ``apply_async`` (so a ``group``,
  a ``chord``'s header, ``chunks``) is collected; at the end of the block the rows are
  written, a few hundred per statement, and then the messages are published.

Either way every row is checked and every message built before anything is written,
and every row is written before its message is published (the row is the outbox).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from celery import Celery
from celery.result import AsyncResult
from celery.utils import uuid
from kombu.exceptions import OperationalError as KombuOperationalError

from . import _message
from ._crashpoints import crash_point
from ._runtime import runtime
from .store import NewTask

if TYPE_CHECKING:
    from .task import LeasedTask

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


@dataclasses.dataclass
class _Pending:
    new: NewTask
    outgoing: _message.Outgoing
    producer: Any


class _Batch:
    """The rows and messages collected by one :func:`bulk` block (or one call)."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.items: list[_Pending] = []

    def add(self, new: NewTask, outgoing: _message.Outgoing, producer: Any = None) -> None:
        self.items.append(_Pending(new, outgoing, producer))

    def commit(self) -> list[Submitted]:
        """Write every row (multi-row statements), then publish the created ones."""
        if not self.items:
            return []
        rt = runtime(self.app)
        store = rt.store
        answers = store.submit_many([p.new for p in self.items])
        crash_point("after_insert")
        created = [p for p, (_, made) in zip(self.items, answers, strict=True) if made]
        sent: list[str] = []
        try:
            with self.app.producer_or_acquire(None) as producer:
                for pending in created:
                    _message.send(self.app, pending.outgoing, pending.producer or producer)
                    sent.append(pending.outgoing.task_id)
        except (KombuOperationalError, ConnectionError, OSError) as error:
            # the rows are the outbox: the reaper publishes the rest once the broker is back
            logger.warning(
                "%d tasks recorded but not published (%s): the reaper will publish them",
                len(created) - len(sent),
                error,
            )
        crash_point("after_publish")
        if sent:
            store.mark_published(sent)
        out = []
        for pending, (task_id, made) in zip(self.items, answers, strict=True):
            result = pending.outgoing.result if made else self.app.AsyncResult(task_id)
            out.append(Submitted(result, made))
        return out


_active: contextvars.ContextVar[_Batch | None] = contextvars.ContextVar(
    "celery_lease_bulk", default=None
)


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
    submitted.extend(batch.commit())


def submit_many(
    task: LeasedTask,
    items: Iterable[Sequence[Any] | Mapping[str, Any]],
    options: dict[str, Any],
) -> list[Submitted]:
    """See :meth:`LeasedTask.submit_many`."""
    if task.app.conf.task_always_eager:
        out = []
        for args, kwargs, extra in _items(items):
            out.append(Submitted(task.apply_async(args, kwargs, **extra, **options), True))
        return out
    rt = runtime(task.app)
    batch = _Batch(task.app)
    for index, (args, kwargs, extra) in enumerate(_items(items)):
        task_id = extra.pop("task_id", None) or uuid()
        dedup_key = extra.pop("dedup_key", None)
        merged = {**options, **extra}
        try:
            args_text, kwargs_text = task._encode_arguments(args, kwargs)
            when = task._check(rt.config, task_id, dedup_key, args_text, kwargs_text, merged)
        except Exception as error:
            if hasattr(error, "add_note"):  # Python 3.11+
                error.add_note(f"in item {index} of submit_many()")
            raise
        outgoing = _message.build(task, args, kwargs, task_id, **merged)
        new = task._new_row(
            rt.config, task_id, args_text, kwargs_text, dedup_key, merged, when, outgoing.stored()
        )
        batch.add(new, outgoing)
    return batch.commit()


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
