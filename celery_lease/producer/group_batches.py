"""A plain ``group(...).apply_async()`` of leased tasks writes its rows together.

Celery sends a group's members one at a time (``group._apply_tasks``), and offers no
hook around that loop. So that a project's existing groups and chord headers get the
multi-row statements of :func:`celery_lease.bulk` with no change to their code,
``celery.canvas.group.apply_async`` is wrapped once, when the first leased task binds to
an app (where :func:`celery_lease.install` hooks the app in), not when celery-lease is
imported: a group with a leased member, on an app that is not eager and outside any
``bulk()`` block, runs Celery's own ``apply_async`` inside a ``bulk()`` block of its
app. Celery builds every member's message as before; the leased members' rows are
written in multi-row statements and their messages published when the loop ends,
before ``apply_async`` returns, so the ``GroupResult`` a caller gets names tasks that
exist, as with plain Celery. Members that are not leased are sent by Celery at once.

``lease_batch_groups = False`` keeps Celery's loop as it is (one committed row per
member). A group inside a ``bulk()`` block is collected by that block. A group (or
chord header) built from a generator is not batched: Celery sends each member as the
generator yields it, and so does the lease (one committed row per member).

Why a wrapper of Celery's class and not a hook of the app: ``group`` is one class for
every app, and nothing per app sees the loop as a whole. ``app.producer_or_acquire``
is entered around the loop, but also around every other publication, and cannot tell
a group from a generator (which must stream) from one from a list. The wrapper does
nothing for a group without a leased member.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from celery import Celery
from celery.canvas import Signature, group

from .._runtime import runtime
from .submission import bulk, in_bulk

#: Marks the wrapper, so that installing twice wraps once.
_MARK = "_celery_lease_batches"


def install(leased: type) -> None:
    """Wrap ``group.apply_async`` (once per process); ``leased``: the task class whose
    members are batched (:class:`~celery_lease.LeasedTask`)."""
    original = group.apply_async
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def apply_async(self: group, *args: Any, **kwargs: Any) -> Any:
        app = _resolved(self.app)
        if _batched(app, self.tasks, leased):
            with bulk(app):
                return original(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    setattr(apply_async, _MARK, True)
    setattr(group, "apply_async", apply_async)  # noqa: B010 (mypy refuses assigning a method)


def _resolved(app: Any) -> Celery:
    """The app itself, not Celery's ``current_app`` proxy: a group whose signatures were
    rebuilt from dicts has the proxy as its app, and a ``bulk()`` block and the app's
    runtime are keyed by the app object."""
    current: Any = getattr(app, "_get_current_object", None)
    return current() if current is not None else app  # type: ignore[no-any-return]


def _batched(app: Celery, tasks: Iterable[Any], leased: type) -> bool:
    """Whether this group's members go through a ``bulk()`` block of ``app``."""
    if app.conf.task_always_eager or in_bulk():  # an open block collects the members
        return False
    if type(tasks) not in (list, tuple):
        # a generator (Celery keeps it lazy, in a list subclass): Celery's loop sends
        # each member as the generator yields it, and a chord header from a generator
        # is streamed (Celery's #3021); collecting would unroll it before sending any
        return False
    if not _has_leased(app, tasks, leased):
        return False
    return runtime(app).config.batch_groups


def _has_leased(app: Celery, tasks: Iterable[Any], leased: type) -> bool:
    """Whether a member (or a member of a nested group, chain or chord) is leased."""
    for sig in tasks:
        inner = getattr(sig, "tasks", None)
        if inner is not None and _has_leased(app, inner, leased):
            return True
        if inner is None and isinstance(sig, Signature):
            task = app.tasks.get(str(sig.get("task")))
            if isinstance(task, leased):
                return True
    return False
