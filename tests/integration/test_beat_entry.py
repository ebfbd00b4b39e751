"""The reaper's beat entry (``celery_lease.reap``), run as Celery runs it: through the
shared task, whose app is Celery's ``current_app`` proxy, not the app object itself.

The crash suite runs it from a real ``celery beat`` process
(``tests/crash/test_beat_reaper.py``).
"""

from __future__ import annotations

import socket

from celery import current_app

from celery_lease import State
from celery_lease.reaper import reap_task

from .test_cli_support import Ops, ops_fixture  # noqa: F401  (the ops fixture)
from .test_notify import zombie


def test_the_beat_entry_sweeps_when_its_app_is_the_current_app_proxy(ops: Ops) -> None:
    task_id = zombie(ops)  # RUNNING, its worker gone: the next sweep expires it
    assert current_app._get_current_object() is ops.app  # the project's app is current

    report = reap_task()  # the shared task, as a worker runs it

    assert report["expired"] == 1 and report["retried"] == 1
    assert ops.state(task_id) is State.PENDING  # expired, safe, published again
    expiry = ops.store.history(task_id)[2]
    assert (expiry.from_state, expiry.to_state) == (State.RUNNING, State.TIMEOUT)
    assert expiry.actor == f"beat:{socket.gethostname()}"


def test_the_beat_entry_is_bound_to_the_app_that_runs_it(ops: Ops) -> None:
    task_id = zombie(ops)

    report = ops.app.tasks["celery_lease.reap"].apply().get(timeout=30)

    assert report["expired"] == 1
    assert ops.state(task_id) is State.PENDING
