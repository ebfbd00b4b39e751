"""Transactional enqueue for Django: the task's row joins the current Django transaction,
its message is published from ``transaction.on_commit``.

::

    from django.db import transaction
    from celery_lease.contrib.django.outbox import delay_on_commit

    with transaction.atomic():
        order = Order.objects.create(total=42)
        delay_on_commit(fulfil, order.pk)
    # committed: the message is on its way; rolled back: no row, no message

Unlike Celery's own ``DjangoTask.delay_on_commit`` (which only *sends* after the commit,
so a crash between the commit and the send loses the task), the row is written inside
the transaction: once the order is committed the task is recorded too, and if the
process dies before ``on_commit`` runs, the reaper publishes it. This needs the lease
tables in the same database as the business data (``DATABASES[using]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from celery.result import AsyncResult
from celery.utils import uuid

from ..._runtime import runtime
from ...exceptions import ConfigurationError, InvalidSubmissionValue
from ...producer import submission as _submission
from ...store import Store
from ...task import LeasedTask
from ._executor import DjangoExecutor

#: The setting naming the ``DATABASES`` alias of the lease tables (default "default").
ALIAS_SETTING = "CELERY_LEASE_DATABASE_ALIAS"
#: ``apply_async`` options handed to the publish rather than stored in the row.
_PUBLISH_ONLY = ("producer", "link", "link_error", "shadow")


def delay_on_commit(task: LeasedTask, *args: Any, **kwargs: Any) -> AsyncResult[Any]:
    """``task.delay(*args, **kwargs)``, transactional: see :func:`apply_async_on_commit`."""
    return apply_async_on_commit(task, args, kwargs)


def apply_async_on_commit(
    task: LeasedTask,
    args: Sequence[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    *,
    using: str | None = None,
    **options: Any,
) -> AsyncResult[Any]:
    """Write ``task``'s row in the current transaction of ``DATABASES[using]``; publish
    its message when that transaction commits (nothing, if it rolls back).

    Outside ``transaction.atomic()`` (autocommit) the row is committed at once and the
    message published at once. Options are those of ``apply_async`` (``task_id``,
    ``dedup_key``, ``countdown``, ``queue``...); a duplicate ``dedup_key`` returns the
    first task's handle and publishes nothing.

    Args:
        task: a task whose base is :class:`~celery_lease.LeasedTask`.
        args: positional arguments of the task.
        kwargs: keyword arguments of the task.
        using: the ``DATABASES`` alias (default: ``CELERY_LEASE_DATABASE_ALIAS``, else
            ``"default"``); it must be the lease store's database.

    Raises:
        ConfigurationError: ``task`` is not a leased task, or the lease store is not on
            that database.
        NotSerializable: the arguments cannot be stored as JSON.
    """
    from django.conf import settings
    from django.db import connections, transaction

    if not isinstance(task, LeasedTask):
        raise ConfigurationError(
            f"apply_async_on_commit() needs a LeasedTask, got {type(task).__name__}: use "
            "Celery's DjangoTask.apply_async_on_commit for other tasks"
        )
    alias = using or str(getattr(settings, ALIAS_SETTING, None) or "default")
    task_id = options.pop("task_id", None) or uuid()
    if task.app.conf.task_always_eager:
        transaction.on_commit(
            lambda: task.apply_async(args, kwargs, task_id=task_id, **options), using=alias
        )
        return task.AsyncResult(task_id)
    dedup_key = options.pop("dedup_key", None)
    unique = _submission.uniqueness(
        task,
        dedup_key,
        **{
            k: options.pop(k) for k in ("unique_for", "unique_while", "on_conflict") if k in options
        },
    )
    if unique is not None and not unique.plain:
        raise InvalidSubmissionValue(
            "dedup_key",
            f"task {task.name}: unique_for, unique_while and on_conflict other than "
            '"return" are not supported by apply_async_on_commit() (use apply_async, or a '
            "plain dedup_key)",
        )
    publish_only = {key: options.pop(key, None) for key in _PUBLISH_ONLY}
    rt = runtime(task.app)
    new, outgoing = _submission.prepare(
        task,
        args,
        kwargs,
        task_id,
        dedup_key,
        options,
        link=publish_only["link"],
        link_error=publish_only["link_error"],
        shadow=publish_only["shadow"],
        producer=publish_only["producer"],
    )
    connection = connections[alias]
    check_same_database(rt.store, connection.settings_dict, alias)
    connection.ensure_connection()
    executor = DjangoExecutor(rt.store.engine.dialect, connection.connection)
    submitted = rt.store.submit_joined(new, executor)
    if not submitted.created:
        return task.AsyncResult(submitted.task_id)

    def publish() -> None:
        rt.store.announce(submitted.events)
        if not new.held:  # held: the reaper publishes it when due
            _submission.publish(task, rt, outgoing, publish_only["producer"])

    transaction.on_commit(publish, using=alias)
    return task.AsyncResult(submitted.task_id)


def check_same_database(store: Store, conf: dict[str, Any], alias: str) -> None:
    """Raise unless Django's ``DATABASES[alias]`` (``conf``) is the lease store's database."""
    engine = str(conf.get("ENGINE", ""))
    name = conf.get("NAME")
    url = store.engine.url
    if store.dialect == "sqlite" and engine.endswith("sqlite3"):
        same = bool(name) and bool(url.database) and _path(str(name)) == _path(str(url.database))
    elif store.dialect == "postgresql" and engine.endswith(("postgresql", "postgis")):
        same = str(name) == url.database
    else:
        same = False
    if not same:
        raise ConfigurationError(
            f"DATABASES[{alias!r}] ({engine or 'no ENGINE'}, {name!r}) is not the lease "
            f"store's database ({store.url}): the task's row must be written in the same "
            "transaction as your data; point lease_database_url at that database"
        )


def _path(name: str) -> Path:
    return Path(name).expanduser().resolve()
