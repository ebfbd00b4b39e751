"""``Task.replace()`` in a leased execution: the run ends and hands its id over.

Celery's ``replace()`` freezes the replacement with the replaced task's id (a single
task takes the id; a chain's last task, a chord's body, a group's accumulator take
it), sends the replacement and raises ``Ignore``: nothing is recorded for the replaced
task, its id's result is the replacement's. Through a lease:

* the leased tasks the replacement submits are collected, not written
  (:func:`celery_lease.producer.submission.collected`);
* one transaction records the replaced run's outcome, SUCCEEDED with the reason
  :data:`~celery_lease.store.REPLACED` (fenced by attempt and token), and writes the
  collected rows. A row with the replaced id (a single leased replacement) replaces
  the finished row: a fresh PENDING row with the replacement's message (the id's
  audit trail keeps both);
* the messages are then published. A worker lost after the transaction leaves the
  rows PENDING and unpublished: the reaper publishes them (the row is the outbox), so
  the replacement runs once. A worker lost before it leaves the replaced run RUNNING:
  its lease expires and it runs again, replacing itself again.

A replacement whose task with the replaced id is submitted later (the last task of a
chain, a chord's body) finds the row SUCCEEDED and replaces it with a fresh row then,
as any new submission of a finished task's id does. Tasks of the replacement that are not
leased are sent by Celery at once, as without a lease.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

from celery import Task
from celery.exceptions import Ignore

from ..._runtime import runtime
from ...producer import submission as _submission
from ...store import REPLACED
from .execution import Execution

logger = logging.getLogger("celery_lease")


def replace(task: Task[Any, Any], execution: Execution, sig: Any) -> NoReturn:
    """Celery's ``on_replace()`` for a leased execution: send ``sig`` (frozen with this
    task's id by ``replace()``) with the run's outcome, then end the run with
    ``Ignore`` as Celery does."""
    rt = runtime(task.app)
    inc = rt.incarnation
    if execution.finished or inc is None:
        raise Ignore("Replaced by new task (outcome already written)")
    execution.finished = True  # the one outcome of this execution is written here
    with _submission.collected(task.app) as batch:
        sig.delay()
    done = batch.commit(
        _submission.Replaced(execution.lease, inc.actor, f"{REPLACED} ({_describe(sig)})")
    )
    if done is None:
        logger.warning(
            "task %s[%s] attempt %d: replacement not sent, the lease was lost (another "
            "attempt or a person owns the task now)",
            task.name,
            execution.task_id,
            execution.attempt,
        )
    raise Ignore("Replaced by new task")


def _describe(sig: Any) -> str:
    name = sig.get("task") if hasattr(sig, "get") else None
    return f"by {name}" if name else f"by a {type(sig).__name__}"
