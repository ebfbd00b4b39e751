"""Telling the world about transitions: logs, the result backend, Flower's task events.

Listeners run after each commit, in whatever process made the transition (a pool
child, the worker's reaper thread, the CLI, a beat task), so they must be cheap and
must never fail or stall the transition:

* :func:`log_transitions` writes one structured line per transition through
  :mod:`logging` (logger ``celery_lease.transitions``), synchronously: it is only a
  log call.
* :class:`Notifier` hands the transitions Celery cannot see (a reaper expiring a
  lease, an operator's decision, a cooperative cancel) to a background thread of the
  same process, which writes the new state to the app's result backend and sends a
  Celery task event (``task-timeout``, ``task-wait-manual``, ``task-cancelled``, ...)
  that Flower and ``celery events`` render. The hand-over never blocks: the queue is
  bounded and a full queue drops (and logs) rather than wait; broker and backend calls
  have bounded retries; errors are logged, never raised.

:func:`attach` installs both on a store (idempotent).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import socket
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from celery import Celery

from ._apps import real_app
from .exceptions import TaskFailed
from .producer import follow_ups as _follow_ups
from .producer.message import request_context
from .records import TaskRecord
from .states import CELERY_REPORTS, State
from .store import FollowUps, Store, TransitionEvent

logger = logging.getLogger("celery_lease.transitions")
_log = logging.getLogger("celery_lease.notify")

#: Celery task event type sent for each lease state the lease layer moves a task to.
EVENT_TYPES: dict[State, str] = {
    State.TIMEOUT: "task-timeout",
    State.WAIT_MANUAL: "task-wait-manual",
    State.CANCELLED: "task-cancelled",
    State.RETRY_WAIT: "task-retried",
    State.PENDING: "task-retried",
    State.FAILED: "task-failed",
    State.SUCCEEDED: "task-succeeded",
}

#: The state written to the result backend for each lease state (``TIMEOUT`` also
#: stands for a timeout already moved on to RETRY_WAIT: the task waits for its retry).
#: The lease's own states are not ready to Celery (``AsyncResult.get()`` waits); the
#: final ones are Celery's: FAILED is ``FAILURE`` (errbacks and a chord's error run),
#: CANCELLED is ``REVOKED`` (as a revoked task), SUCCEEDED is ``SUCCESS``.
BACKEND_STATES: dict[State, str] = {
    State.TIMEOUT: "TIMEOUT",
    State.RETRY_WAIT: "TIMEOUT",
    State.WAIT_MANUAL: "WAIT_MANUAL",
    State.CANCELLED: "REVOKED",
    State.FAILED: "FAILURE",
    State.PENDING: "PENDING",
    State.SUCCEEDED: "SUCCESS",
}

#: Transitions a task's own execution makes and Celery itself reports (result backend
#: and ``task-succeeded``/``task-failed``/``task-retried`` events), or that are not news.
_CELERY_REPORTS = CELERY_REPORTS

#: Seconds :func:`flush` waits at interpreter exit for queued notifications.
EXIT_TIMEOUT = 5.0
#: Longest a publish waits for the result backend to be told the rows' earlier states
#: (a slow backend delays a re-publish this long at most, then order is not kept).
BEFORE_PUBLISH_TIMEOUT = 2.0
#: Bounded retries of one event publish (a dead broker costs about a second, not minutes).
EVENT_RETRY_POLICY = {
    "max_retries": 1,
    "interval_start": 0,
    "interval_step": 0.5,
    "interval_max": 0.5,
}


# -- logs ---------------------------------------------------------------------------------


def _quote(value: str) -> str:
    if value and all(c.isalnum() or c in "-_.:@/[]" for c in value):
        return value
    return json.dumps(value, ensure_ascii=False)


def log_transitions(events: Sequence[TransitionEvent]) -> None:
    """One line per transition, ``key=value`` formatted, with the same values as
    ``lease_*`` attributes on the record for structured (JSON) handlers.

    WAIT_MANUAL is logged at WARNING (a person must act), everything else at INFO.
    """
    for e in events:
        level = logging.WARNING if e.to_state is State.WAIT_MANUAL else logging.INFO
        if not logger.isEnabledFor(level):
            continue
        frm = e.from_state.value if e.from_state is not None else "-"
        logger.log(
            level,
            "transition task_id=%s name=%s from=%s to=%s attempt=%d actor=%s reason=%s",
            e.task_id,
            e.name or "-",
            frm,
            e.to_state.value,
            e.attempt,
            _quote(e.actor),
            _quote(e.reason),
            extra={
                "lease_task_id": e.task_id,
                "lease_task_name": e.name,
                "lease_from": None if e.from_state is None else e.from_state.value,
                "lease_to": e.to_state.value,
                "lease_attempt": e.attempt,
                "lease_actor": e.actor,
                "lease_reason": e.reason,
            },
        )


# -- what needs telling ---------------------------------------------------------------------


def _owner_outcome(event: TransitionEvent) -> bool:
    # over max_runtime the row went to WAIT_MANUAL while its owner kept running; when the
    # owner finishes, Celery reports the outcome itself (its actor is "worker:<node>")
    return (
        event.from_state is State.WAIT_MANUAL
        and event.to_state in (State.SUCCEEDED, State.FAILED)
        and event.actor.startswith("worker:")
    )


def needs_telling(event: TransitionEvent) -> bool:
    """Whether Celery cannot see this transition, so the result backend and Flower need
    to be told: lease expiries, hand-overs to a person, cancels, operators' decisions."""
    if (event.from_state, event.to_state) in _CELERY_REPORTS:
        return False
    return event.to_state in EVENT_TYPES and not _owner_outcome(event)


#: Final states: once the row holds one, an older state must not be written over it.
_FINAL = frozenset({State.SUCCEEDED, State.FAILED, State.CANCELLED})


def moved_on(event: TransitionEvent, record: TaskRecord | None) -> bool:
    """Whether the row has moved past ``event`` in a way the result backend already
    shows, or will: a later attempt was claimed (its worker writes STARTED and the
    outcome), or the row reached another final state (written when it did). The
    event's state is then not written: a result backend never goes back in the row's
    history. Other moves of the same attempt (TIMEOUT, RETRY_WAIT, PENDING) are still
    written: the later ones that are told follow in order. A row already gone
    (retention) has not moved on."""
    if record is None:
        return False
    if record.attempt > event.attempt:
        return True
    return record.state in _FINAL and record.state is not event.to_state


def cli_hint(app: Celery, task_id: str) -> str:
    """The command that shows a task's row, steps and history."""
    main = app.main if app.main and app.main != "__main__" else "proj"
    return f"celery -A {main} lease show {task_id}"


def result_meta(app: Celery, event: TransitionEvent, record: TaskRecord | None) -> dict[str, Any]:
    """The dict written as the task's result with a lease state."""
    return {
        "lease_state": event.to_state.value,
        "from_state": event.from_state.value if event.from_state is not None else None,
        "reason": event.reason,
        "attempt": event.attempt,
        "actor": event.actor,
        "recoveries": record.recoveries if record is not None else None,
        "worker": record.owner_node if record is not None else None,
        "hint": cli_hint(app, event.task_id),
    }


# -- the background notifier --------------------------------------------------------------


class Notifier:
    """Result-backend sync and task events, delivered from a background thread.

    One instance per store (per app and process); it survives ``fork``: a forked
    pool child gets a fresh queue and starts its own thread on first use.
    """

    def __init__(
        self,
        app: Celery,
        store: Store,
        *,
        events: bool = True,
        backend: bool = True,
        max_queue: int = 10_000,
    ) -> None:
        # weakly: a notifier must not keep a dropped app (and its store) alive
        self._app = weakref.ref(real_app(app))
        self.store = store
        self.events = events
        self.backend = backend
        self.max_queue = max_queue
        self.dropped = 0
        self.delivered = 0
        self.sender = f"celery-lease@{socket.gethostname()}"
        self._reset()
        ref = weakref.ref(self)

        def _after_fork() -> None:
            me = ref()
            if me is not None:
                me._reset()

        def _at_exit() -> None:
            me = ref()
            if me is not None:
                me.flush(EXIT_TIMEOUT)

        # locks and the queue may have been held by the parent's thread at fork time
        os.register_at_fork(after_in_child=_after_fork)
        atexit.register(_at_exit)

    @property
    def app(self) -> Celery:
        app = self._app()
        if app is None:
            raise RuntimeError("the app of this notifier is gone")
        return app

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queue: queue.Queue[list[TransitionEvent] | None] = queue.Queue(self.max_queue)
        self._pending = 0
        self._thread: threading.Thread | None = None
        self._connection: Any = None

    # -- the listener (runs in the committing thread: must not block) -----------------

    def __call__(self, events: Sequence[TransitionEvent]) -> None:
        todo = [e for e in events if needs_telling(e)]
        if not todo or not (self.events or self.backend):
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="celery-lease-notify", daemon=True
                )
                self._thread.start()
            try:
                self._queue.put_nowait(todo)
            except queue.Full:
                self.dropped += len(todo)
                _log.warning(
                    "celery-lease: notification queue full (result backend or broker "
                    "too slow?): %d transitions not reported (%d in all)",
                    len(todo),
                    self.dropped,
                )
                return
            self._pending += 1

    def flush(self, timeout: float = EXIT_TIMEOUT) -> bool:
        """Wait up to ``timeout`` seconds until everything queued was delivered."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout: float = EXIT_TIMEOUT) -> None:
        """Deliver what is queued (up to ``timeout``), then stop the thread and close the
        broker connection. A later transition starts a new thread."""
        self.flush(timeout)
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            try:
                self._queue.put(None, timeout=timeout)
            except queue.Full:
                return  # still stuck on a dead service: the daemon thread is left behind
            thread.join(timeout)

    # -- the thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                self._drop_connection()
                return
            try:
                self.deliver(batch)
            except Exception:
                _log.exception("celery-lease: could not report %d transitions", len(batch))
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def deliver(self, events: Sequence[TransitionEvent]) -> None:
        """Write the result backend and send the task events for ``events`` (now)."""
        records: dict[str, TaskRecord | None] = {}
        for e in events:
            if e.task_id not in records:
                try:
                    records[e.task_id] = self.store.get(e.task_id)
                except Exception as error:
                    _log.warning("celery-lease: task %s not read: %s", e.task_id, error)
                    records[e.task_id] = None
        if self.backend:
            last: dict[str, TransitionEvent] = {}
            for e in events:
                last[e.task_id] = e
            for e in last.values():
                try:
                    # read again just before writing: the queue and the writes before
                    # this one take time, and the row may have moved on meanwhile
                    record = records[e.task_id] = self.store.get(e.task_id)
                    if moved_on(e, record):
                        _log.debug(
                            "celery-lease: task %s is %s (attempt %d) now: %s not written "
                            "to the result backend",
                            e.task_id,
                            record.state.value if record is not None else "gone",
                            record.attempt if record is not None else 0,
                            e.to_state.value,
                        )
                        continue
                    self._store_result(e, record)
                except Exception as error:
                    _log.warning(
                        "celery-lease: result backend not updated for task %s (%s): %s",
                        e.task_id,
                        e.to_state.value,
                        error,
                    )
        if self.events:
            try:
                self._send_events(events, records)
            except Exception as error:
                _log.warning("celery-lease: task events not sent: %s", error)
                self._drop_connection()
        self.delivered += len(events)

    # -- result backend ---------------------------------------------------------------

    def _store_result(self, event: TransitionEvent, record: TaskRecord | None) -> None:
        from celery.backends.base import DisabledBackend

        app = self.app
        if event.to_state is State.SUCCEEDED and record is not None and record.message:
            # an operator's resolve: the result stored, counted in a chord, and the
            # callbacks and the rest of a chain run with it, as after a run; recorded
            # with the resolve (``follow_ups_at``), so the reaper sends them if this
            # process cannot
            row = FollowUps(
                event.task_id,
                record.name,
                record.message,
                json.dumps(record.result),
                record.retries,
            )
            _follow_ups.replay(app, self.store, [row])
            return
        if not app.conf.result_backend:
            return
        backend = app.backend
        if isinstance(backend, DisabledBackend):
            return
        name = event.name or (record.name if record is not None else None)
        try:
            task = app.tasks.get(name) if name else None
        except RuntimeError:  # an app that must be finalized explicitly and was not
            task = None
        ignore = task.ignore_result if task is not None else app.conf.task_ignore_result
        request = _request(app, event, name, record)
        if ignore and not request.chord:
            return
        task_id = event.task_id
        to = event.to_state
        if to is State.SUCCEEDED:
            # an operator's resolve of a row without a stored message: its result
            result: Any = record.result if record is not None else None
            backend.mark_as_done(task_id, result, request=request, store_result=not ignore)
        elif to is State.FAILED:
            failed = TaskFailed(task_id, event.reason, event.actor)
            backend.mark_as_failure(task_id, failed, request=request, store_result=not ignore)
        elif to is State.CANCELLED:
            backend.mark_as_revoked(
                task_id, f"cancelled: {event.reason}", request=request, store_result=not ignore
            )
        elif not ignore:
            state = BACKEND_STATES[to]
            backend.store_result(task_id, result_meta(app, event, record), state, request=request)

    # -- task events --------------------------------------------------------------------

    def _drop_connection(self) -> None:
        conn, self._connection = self._connection, None
        if conn is not None:
            try:
                conn.release()
            except Exception as error:
                _log.debug("celery-lease: closing the event connection: %s", error)

    def _send_events(
        self, events: Sequence[TransitionEvent], records: dict[str, TaskRecord | None]
    ) -> None:
        if self._connection is None:
            conn = self.app.connection_for_write()
            try:
                conn.ensure_connection(max_retries=1, interval_start=0, timeout=int(EXIT_TIMEOUT))
            except Exception:
                conn.release()
                raise
            self._connection = conn
        conn = self._connection
        dispatchers: dict[str, Any] = {}
        try:
            for e in events:
                record = records.get(e.task_id)
                # Flower files a task under the worker named by the event's hostname: the
                # worker that ran it, not whoever noticed its lease expired
                host = (record.owner_node if record is not None else None) or self.sender
                dispatcher = dispatchers.get(host)
                if dispatcher is None:
                    dispatcher = dispatchers[host] = self.app.events.Dispatcher(
                        conn, hostname=host, enabled=True, buffer_while_offline=False
                    )
                dispatcher.send(
                    EVENT_TYPES[e.to_state],
                    retry=True,
                    retry_policy=EVENT_RETRY_POLICY,
                    **event_fields(self.app, e, record, self.sender),
                )
        finally:
            for dispatcher in dispatchers.values():
                dispatcher.close()


def event_fields(
    app: Celery, event: TransitionEvent, record: TaskRecord | None, sender: str
) -> dict[str, Any]:
    """The fields of the task event for ``event``: ``uuid``, ``name``, the ``lease_*``
    fields, and the same lease fields as a JSON object in ``result`` (see below)."""
    lease: dict[str, Any] = {
        "lease_state": event.to_state.value,
        "lease_from": event.from_state.value if event.from_state is not None else None,
        "lease_reason": event.reason,
        "lease_attempt": event.attempt,
        "lease_actor": event.actor,
        "lease_hint": cli_hint(app, event.task_id),
        # Flower keeps a FAILURE it saw first (Celery's precedence rules): this tells
        # which of the two is the newer news
        "lease_at": time.time(),
    }
    fields: dict[str, Any] = {"uuid": event.task_id, "lease_sender": sender, **lease}
    name = event.name or (record.name if record is not None else None)
    if name:
        fields["name"] = name
    if record is not None:
        fields["retries"] = record.retries
    if event.to_state is State.SUCCEEDED:
        fields["result"] = repr(record.result if record is not None else None)
        fields["runtime"] = None
    else:
        # Flower copies a task before rendering it and the copy keeps only Celery's own
        # fields: in ``result`` the lease fields reach its pages (and format_task)
        fields["result"] = json.dumps(lease, separators=(", ", ": "))
        if event.to_state in (State.FAILED, State.RETRY_WAIT, State.PENDING):
            fields["exception"] = event.reason
        if event.to_state is State.FAILED:
            fields["traceback"] = None
    return fields


def _request(
    app: Celery, event: TransitionEvent, name: str | None, record: TaskRecord | None
) -> Any:
    """The request context of the task, as its worker would have it: from the stored
    message (errbacks, chord, group, chain), else from the row alone."""
    from celery.app.task import Context

    if record is not None and record.message is not None:
        try:
            ctx = request_context(app, record.message)
        except Exception as error:
            _log.warning("celery-lease: message of task %s not read: %s", event.task_id, error)
        else:
            ctx.hostname = record.owner_node
            ctx.retries = record.retries
            return ctx
    return Context(
        id=event.task_id,
        task=name,
        args=record.args if record is not None else None,
        kwargs=record.kwargs if record is not None else None,
        hostname=record.owner_node if record is not None else None,
        retries=record.retries if record is not None else 0,
        delivery_info={},
        children=[],
    )


# -- wiring -------------------------------------------------------------------------------


def attach(app: Celery, store: Store) -> Notifier | None:
    """Install the transition listeners on ``store`` (once): the log line always; the
    notifier unless ``lease_send_events`` and ``lease_result_backend_sync`` are both off.
    Returns the store's notifier."""
    for listener in store.listeners:
        if isinstance(listener, Notifier) or listener is log_transitions:
            return find_notifier(store)
    store.listeners.append(log_transitions)
    events = store.config.send_events
    backend = store.config.result_backend_sync
    if not (events or backend):
        return None
    notifier = Notifier(app, store, events=events, backend=backend)
    store.listeners.append(notifier)
    return notifier


def find_notifier(store: Store) -> Notifier | None:
    """The notifier installed on ``store``, if any."""
    for listener in store.listeners:
        if isinstance(listener, Notifier):
            return listener
    return None


def flush(store: Store, timeout: float = EXIT_TIMEOUT) -> bool:
    """Wait until ``store``'s notifier delivered everything queued (``True``: done)."""
    notifier = find_notifier(store)
    return True if notifier is None else notifier.flush(timeout)


__all__ = [
    "BACKEND_STATES",
    "BEFORE_PUBLISH_TIMEOUT",
    "EVENT_TYPES",
    "Notifier",
    "attach",
    "cli_hint",
    "event_fields",
    "find_notifier",
    "flush",
    "log_transitions",
    "moved_on",
    "needs_telling",
    "result_meta",
]
