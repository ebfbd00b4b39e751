"""Follow-ups are part of the outcome: what a task's success sends, sent once.

A success sends follow-ups: its ``link`` callbacks, the chain's next task, and a chord
member's part-return (which publishes the chord's callback once every member has
returned). Celery's tracer sends them right after the task's function returns, from
the request; a worker lost between the row's SUCCEEDED and that moment would lose
them for good, since the redelivered message is dropped (the row is final). So:

* the row records them in the outcome's own transaction (``follow_ups_at``: written
  by :meth:`~celery_lease.store.Store.finish` for a task whose request has callbacks,
  a chain or a chord, and by an operator's ``resolve`` for a row with a stored
  message);
* the pool process takes them out of the request (:func:`take`), so Celery's tracer
  sends none of them, sends them itself (:func:`send_taken`) and marks them published;
  a chord member's part-return comes after the tracer stored the result
  (:func:`finish`, from ``LeasedTask.on_success``), and is marked then;
* the reaper publishes those of a row still marked after ``lease_publish_grace``
  (:func:`replay`), from the stored message (callbacks, chain, chord, group) and the
  stored result, and stores the result in the result backend.

A follow-up published twice (the worker died after sending and before marking) is
one in effect: every follow-up has a fixed id (a chain's steps and a chord's callback
are frozen by Celery; a ``link`` callback without one gets :func:`callback_id`), so a
leased follow-up's second submission (inside ``_submission.resending()``: not a new
submission of its id, which would run a finished task again) finds its row and
publishes nothing, and a
second delivery is dropped at claim; the Redis result backend counts a chord member
once per (task id, index) and publishes the chord's callback once.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

from celery import Celery, group, signature, states

from ..store import FollowUps, Store
from .message import request_context

logger = logging.getLogger("celery_lease")

#: Namespace of the ids given to ``link`` callbacks that have none (see :func:`callback_id`).
_NAMESPACE = uuid.UUID("6f1f7d0c-8e5b-4c9e-9d0a-3f9c1f1f0a11")

#: What :func:`take` took out of the request this thread runs, until :func:`finish`:
#: (that request, what was taken). Kept beside Celery's request, never on it; a later
#: request of the same thread is another object, so a take never finished (the task
#: failed after it) is never taken for that request's.
_taken: contextvars.ContextVar[tuple[Any, Taken] | None] = contextvars.ContextVar(
    "celery_lease_follow_ups", default=None
)


def recorded(request: Any) -> bool:
    """Whether a success of this request sends follow-ups (recorded with the outcome)."""
    return bool(request.callbacks or request.chain or request.chord)


def callback_id(task_id: str, index: int) -> str:
    """The id of the ``index``-th ``link`` callback of ``task_id`` when it has none of
    its own: the same in the pool process and in any reaper, so that a second
    publication is the same task."""
    return str(uuid.uuid5(_NAMESPACE, f"{task_id}/link/{index}"))


@dataclasses.dataclass
class Taken:
    """The follow-ups of one success, taken out of its request."""

    callbacks: list[Any]
    chain: list[Any]
    #: A copy of the request with its chord (``None``: not a chord member).
    chord_request: Any
    #: Whether the callbacks and the chain's next task were all published.
    sent: bool = False


def take(request: Any) -> Taken:
    """Take the follow-ups out of ``request``: Celery's tracer then sends none of them
    (it reads the request's callbacks, chain and chord after the task returns)."""
    from celery.app.task import Context

    chord_request = Context(vars(request)) if request.chord else None
    taken = Taken(list(request.callbacks or ()), list(request.chain or ()), chord_request)
    request.callbacks = None
    request.chain = None
    request.chord = None
    _taken.set((request, taken))
    return taken


def send(
    app: Celery,
    task_id: str,
    request: Any,
    callbacks: Sequence[Any],
    chain: list[Any],
    result: Any,
) -> None:
    """Publish ``link`` callbacks, then the chain's next task, as Celery's tracer does
    (``parent_id``, ``root_id``, the delivery's priority with
    ``task_inherit_parent_priority``), each with a fixed id.

    Raises what publishing raises (the broker); what was published stays published.
    """
    root_id = getattr(request, "root_id", None) or task_id
    priority = None
    if app.conf.task_inherit_parent_priority:  # as Celery's tracer decides
        priority = (getattr(request, "delivery_info", None) or {}).get("priority")
    ids: dict[str, Any] = {"parent_id": task_id, "root_id": root_id, "priority": priority}
    for index, callback in enumerate(callbacks):
        sig = signature(callback, app=app)
        if isinstance(sig, group):  # its members' ids are Celery's: not fixed here
            sig.apply_async((result,), **ids)
            continue
        fixed: dict[str, Any] = {}
        if not sig.options.get("task_id"):
            fixed["task_id"] = callback_id(task_id, index)
        sig.apply_async((result,), **ids, **fixed)
    if chain:
        following = signature(chain[-1], app=app)
        fixed = {}
        if not following.options.get("task_id"):
            fixed["task_id"] = callback_id(task_id, -1)
        following.apply_async((result,), chain=chain[:-1], **ids, **fixed)


def send_taken(task: Any, store: Store, taken: Taken, result: Any) -> None:
    """The pool process, right after the outcome: publish the callbacks and the chain's
    next task (before Celery's tracer stores the result, as it would), and mark them
    published unless a chord's part-return is still to come (:func:`finish`). A
    failure is logged and left to the reaper (the row still records the follow-ups)."""
    request = task.request
    try:
        send(task.app, str(request.id), request, taken.callbacks, taken.chain, result)
        if taken.chord_request is None:
            store.follow_ups_sent([str(request.id)])
    except Exception as error:
        logger.warning(
            "task %s[%s]: follow-ups recorded but not published (%s): the reaper publishes "
            "them after lease_publish_grace",
            task.name,
            request.id,
            error,
        )
        return
    taken.sent = True


def taken(request: Any) -> bool:
    """Whether :func:`take` took follow-ups out of ``request`` and :func:`finish` is due."""
    found = _taken.get()
    return found is not None and found[0] is request


def finish(task: Any, store: Store, result: Any) -> None:
    """``LeasedTask.on_success``: a chord member's part-return (after the tracer stored
    the result, as Celery's ``mark_as_done`` does), then its follow-ups marked
    published. Anything not done is left to the reaper."""
    request = task.request
    found = _taken.get()
    if found is None or found[0] is not request:
        return
    _taken.set(None)
    taken = found[1]
    if not taken.sent or taken.chord_request is None:
        return
    task_id = str(request.id)
    try:
        task.backend.on_chord_part_return(taken.chord_request, states.SUCCESS, result)
        store.follow_ups_sent([task_id])
    except Exception as error:
        logger.warning(
            "task %s[%s]: follow-ups not all published or not marked (%s): the reaper "
            "publishes them after lease_publish_grace (a second publication is the same task)",
            task.name,
            task_id,
            error,
        )


def replay(
    app: Celery, store: Store, rows: Sequence[FollowUps], *, budget: float | None = None
) -> tuple[int, int]:
    """Publish the recorded follow-ups of these SUCCEEDED rows from their stored
    message and result, store the result in the result backend (with a chord member's
    part-return), and mark them published. Returns (done, failed); a failed row keeps
    its mark and is taken again after ``lease_publish_grace``.

    A broker that fails or does not answer would fail every further row too, each
    after its own publish timeout: the first such failure, or ``budget`` seconds spent
    (after the first row), leaves the rest of the batch for a later sweep (counted as
    failed), so a sweep never waits on the broker for more than about one bound."""
    done: list[str] = []
    failed = 0
    deadline = None if budget is None else time.monotonic() + budget
    for index, row in enumerate(rows):
        left = len(rows) - index
        if index and deadline is not None and time.monotonic() >= deadline:
            logger.warning(
                "celery-lease: publishing follow-ups took longer than %g s: %d task(s) left "
                "for the next sweep",
                budget,
                left,
            )
            failed += left
            break
        try:
            _replay_one(app, row)
        except ChordDispatchPending as error:  # this row only: the others go on
            failed += 1
            logger.info("celery-lease: follow-ups of task %s[%s]: %s", row.name, row.id, error)
            continue
        except Exception as error:
            failed += left
            logger.warning(
                "celery-lease: follow-ups of task %s[%s] not published (%s): retried "
                "after lease_publish_grace, with the %d after it in this batch",
                row.name,
                row.id,
                error,
                left - 1,
            )
            break
        done.append(row.id)
    if done:
        store.follow_ups_sent(done)
    return len(done), failed


def _replay_one(app: Celery, row: FollowUps) -> None:
    if row.message is None:  # adopted without a message: nothing recorded to send
        return
    from celery.backends.base import DisabledBackend

    request = request_context(app, row.message)
    request.retries = row.retries
    result = json.loads(row.result) if row.result is not None else None
    # the same messages again, not new submissions: a follow-up whose row exists (its
    # first publication got through) is that task, even if it has finished since
    from .submission import resending  # submission imports the runtime, which imports us

    with resending():
        send(app, row.id, request, list(request.callbacks or ()), list(request.chain or ()), result)
    task = app.tasks.get(row.name)
    backend = task.backend if task is not None else app.backend
    if isinstance(backend, DisabledBackend):
        return
    ignored = task.ignore_result if task is not None else app.conf.task_ignore_result
    # stores the result a caller waits for, then counts the chord member (once per
    # member on the Redis backend: its part-return is keyed by task id and index)
    backend.mark_as_done(row.id, result, request=request, store_result=not ignored)
    if _chord_dispatch_claimed(backend, request):
        raise ChordDispatchPending(
            f"the callback of chord {request.group} is claimed for publishing and not yet "
            "published (by a worker that may have died): counted again once the claim expires"
        )


class ChordDispatchPending(Exception):
    """The chord's callback is claimed for publishing on the result backend and not yet
    published: the follow-ups stay recorded, and the part-return is repeated later."""


def _chord_dispatch_claimed(backend: Any, request: Any) -> bool:
    """Redis result backend: whether the chord's callback is claimed for publishing and
    not published yet. A worker that died holding the claim leaves it until it expires
    (``result_chord_join_timeout`` x 2, at least 5 s); a part-return repeated after that
    claims it again and publishes the callback (its fixed id dedupes a second one)."""
    group_key = getattr(backend, "get_key_for_group", None)
    if not request.chord or not request.group or group_key is None:
        return False
    try:
        value = backend.client.get(group_key(request.group, ".c"))
    except AttributeError:  # not the Redis backend's layout
        return False
    return value is not None and value not in (b"done", "done")
