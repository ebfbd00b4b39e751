"""Transactional enqueue: the row joins the caller's transaction; publish after commit.

The row is the outbox (DESIGN.md): a committed PENDING row is published, sooner or
later, by the producer or by the reaper; an uncommitted one never is. What this module
adds is *when*: the message goes out right after the commit, when a hook tells us the
commit happened (``Session``, or a connection of ``outbox_transaction()``; the hooks
are the store's, :mod:`celery_lease.store._outbox`). On any other ``Connection`` the
reaper publishes the row instead, once it is committed and older than
``lease_publish_grace`` (so within the grace plus one ``lease_reaper_interval``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from celery.result import AsyncResult

from ..store import NewTask, join_transaction

if TYPE_CHECKING:
    from .._runtime import Runtime


class _Task(Protocol):
    """What the outbox needs of the submitted task: its name and result handles."""

    name: str

    def AsyncResult(self, task_id: str, **kwargs: Any) -> AsyncResult[Any]: ...


logger = logging.getLogger("celery_lease")


def submit_in_transaction(
    task: _Task,
    rt: Runtime,
    new: NewTask,
    connection: Any,
    send: Callable[[], object],
) -> AsyncResult[Any]:
    """Insert the row with ``connection`` and publish once its transaction commits.

    See the module docstring for when the publish happens on each kind of connection.
    """
    joined = join_transaction(rt.store, connection)
    submitted = rt.store.submit_joined(new, joined.conn)
    tid = submitted.task_id
    if not submitted.created:
        logger.info("task %s[%s]: already submitted (dedup), nothing published", task.name, tid)
        return task.AsyncResult(tid)

    def publish() -> None:
        rt.store.announce(submitted.events)
        send()

    if not joined.after_commit(publish):
        logger.debug(
            "task %s[%s]: written in a bare Connection's transaction, which has no "
            "after-commit hook: the reaper publishes it once committed (use a Session or "
            "outbox_transaction() to publish at once)",
            task.name,
            tid,
        )
    return task.AsyncResult(tid)
