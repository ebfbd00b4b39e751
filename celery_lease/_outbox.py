"""Transactional enqueue: the row joins the caller's transaction; publish after commit."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from celery.result import AsyncResult
from sqlalchemy import Connection, event
from sqlalchemy.orm import Session

from .exceptions import ConfigurationError
from .store import NewTask

if TYPE_CHECKING:
    from ._runtime import Runtime
    from .task import LeasedTask

logger = logging.getLogger("celery_lease")


def submit_in_transaction(
    task: LeasedTask,
    rt: Runtime,
    new: NewTask,
    connection: Any,
    args: Any,
    kwargs: Any,
    producer: Any,
    link: Any,
    link_error: Any,
    shadow: str | None,
    options: dict[str, Any],
) -> AsyncResult:  # type: ignore[type-arg]
    """Insert the row with ``connection`` and publish once its transaction commits.

    With a ``Session`` the message is published from its ``after_commit`` event; a
    rollback publishes nothing. With a bare ``Connection`` there is no after-commit
    hook, so the reaper publishes the row (within ``lease_publish_grace`` plus one
    reaper interval) once it is visible.
    """
    if isinstance(connection, Session):
        session: Session | None = connection
        conn = connection.connection()
    elif isinstance(connection, Connection):
        session = None
        conn = connection
    else:
        raise ConfigurationError(
            "connection= takes a SQLAlchemy Connection or Session on the store's database, "
            f"got {type(connection).__name__}"
        )
    if conn.dialect.name != rt.store.dialect:
        raise ConfigurationError(
            f"connection= is a {conn.dialect.name} connection but the lease store is "
            f"{rt.store.dialect}: both must be the same database"
        )
    tid, created = rt.store.submit(new, conn=conn)
    if not created or session is None:
        return task.AsyncResult(tid)

    def _publish(sess: Session) -> None:
        event.remove(sess, "after_soft_rollback", _forget)
        task._publish(rt, tid, args, kwargs, producer, link, link_error, shadow, options)

    def _forget(sess: Session, previous: Any) -> None:
        if event.contains(sess, "after_commit", _publish):
            event.remove(sess, "after_commit", _publish)
        event.remove(sess, "after_soft_rollback", _forget)

    event.listen(session, "after_commit", _publish, once=True)
    event.listen(session, "after_soft_rollback", _forget)
    return task.AsyncResult(tid)
