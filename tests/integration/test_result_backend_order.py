"""The result backend never goes back in a task's history.

The lease layer writes the states Celery cannot see (TIMEOUT, WAIT_MANUAL, an
operator's PENDING...) to the result backend from a background thread of the process
that made the transition, while the worker that runs the task writes Celery's own
(STARTED, SUCCESS). A lease write that lands after the row moved on would show a caller
a state the row no longer holds: PENDING over the STARTED of the run it started.

Every write to a task's Redis result key is published on its channel (Celery's Redis
backend does it for ``AsyncResult.get``): :class:`BackendWrites` subscribes and records
each state in order, and each task's sequence must follow its row's audit history.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from typing import Any

import pytest
import redis

from celery_lease import State, admin, notify

from ..crash.support import TASKS, LeaseEnv
from ..helpers import wait_until

#: What the result backend may show for each state of a row's history, in order
#: (RUNNING: Celery's STARTED, with ``task_track_started``; RETRY_WAIT: TIMEOUT).
SHOWN = {
    State.PENDING: "PENDING",
    State.RUNNING: "STARTED",
    State.TIMEOUT: "TIMEOUT",
    State.RETRY_WAIT: "TIMEOUT",
    State.WAIT_MANUAL: "WAIT_MANUAL",
    State.SUCCEEDED: "SUCCESS",
    State.FAILED: "FAILURE",
    State.CANCELLED: "REVOKED",
}

SOURCE = (
    TASKS
    + '''

@app.task(base=LeasedTask, bind=True, shared=False, name="t.fail_once")
def fail_once(self, key):
    """Fails on its first run, succeeds on the next (an operator's retry)."""
    external.call(f"run:{key}")
    if external.count(f"run:{key}") == 1:
        raise ValueError("first run fails")
    return key
'''
)


#: The prefix of a task's result key, and of the channel Celery publishes its writes on.
META_PREFIX = "celery-task-meta-"


class BackendWrites:
    """Every state written to the Redis result keys of some tasks, in order (pub/sub)."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.pubsub: Any = self.client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
        self.pubsub.psubscribe(f"{META_PREFIX}*")
        self.states: dict[str, list[str]] = defaultdict(list)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # pub/sub channels are the server's, not one database's: a test of another
        # xdist worker publishes on them too (group and chord metas among them, which
        # carry no task_id), so a write is named by its channel, and what is not a
        # task state is passed over instead of ending the listener
        while not self._stop.is_set():
            message = self.pubsub.get_message(timeout=0.1)
            if message is None or message["type"] != "pmessage":
                continue
            task_id = message["channel"].decode().removeprefix(META_PREFIX)
            try:
                status = json.loads(message["data"]).get("status")
            except (ValueError, AttributeError):
                continue
            if isinstance(status, str):
                self.states[task_id].append(status)

    def wait_final(self, task_ids: list[str]) -> None:
        """Wait until each task's SUCCESS was written (the worker writes it after the row)."""
        wait_until(
            lambda: all("SUCCESS" in self.states[t] for t in task_ids),
            message="SUCCESS written to the result backend",
        )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pubsub.close()
        self.client.close()


def follows(seen: list[str], history: list[str]) -> bool:
    """Whether ``seen`` is a subsequence of ``history`` (each write a later state)."""
    it = iter(history)
    return all(any(state == h for h in it) for state in seen)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_an_operators_retry_never_shows_pending_over_the_rerun(
    lease_env: LeaseEnv, redis_url: str
) -> None:
    settings: dict[str, Any] = {"result_backend": redis_url, "task_track_started": True}
    # no re-publish by the reaper while the retry publishes: a duplicate delivery has
    # Celery write STARTED before its claim is refused, which is another matter
    p = lease_env.project(
        broker_url=redis_url,
        settings=settings,
        source=SOURCE,
        publish_grace=30.0,
        republish_after=60.0,
    )
    p.worker("a", concurrency=2)
    writes = BackendWrites(redis_url)
    try:
        ids = [p.submit("t.fail_once", f"k{i}") for i in range(60)]
        for task_id in ids:
            p.wait_state(task_id, State.FAILED)
        api = admin(p.module.app)
        done = api.bulk("retry", reason="first runs fail on purpose", state=State.FAILED)
        assert len(done.changed) == len(ids) and done.refused is None, done
        for task_id in ids:
            p.wait_state(task_id, State.SUCCEEDED)
        assert notify.flush(api.store, 30)  # this process's lease writes: all delivered
        writes.wait_final(ids)
    finally:
        writes.close()

    stale = {}
    for task_id in ids:
        history = [SHOWN[r.to_state] for r in p.store.history(task_id)]
        seen = writes.states[task_id]
        assert seen[-1:] == ["SUCCESS"], (task_id, seen)
        if not follows(seen, history):
            stale[task_id] = (seen, history)
    assert stale == {}
