"""django-celery-results' database backend shows what the reaper decided.

A worker with ``task_track_started`` leaves the task's ``TaskResult`` at STARTED; when
its lease expires the reaper's transition is written to the result backend (the sync in
``celery_lease/notify.py``), so the row stops showing STARTED forever.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import wait_until

pytestmark = pytest.mark.postgres


@pytest.fixture
def results(django_project: Any) -> Iterator[list[str]]:
    """Task ids whose TaskResult rows are deleted after the test (autocommit here: the
    backend is written from the notifier's own thread and connection)."""
    from django_celery_results.models import TaskResult

    ids: list[str] = []
    yield ids
    TaskResult.objects.filter(task_id__in=ids).delete()


@pytest.mark.parametrize(
    ("inflight_step", "shown"),
    [(False, "TIMEOUT"), (True, "WAIT_MANUAL")],
    ids=["safe-retry", "outcome-unknown"],
)
def test_reaper_decision_reaches_django_celery_results(
    inflight_step: bool, shown: str, django_project: Any, lease: Any, results: list[str]
):
    from django_celery_results.models import TaskResult

    from celery_lease import reap
    from celery_lease._runtime import runtime

    app = django_project
    assert app.conf.result_backend == "django-db"
    runtime(app).reset()  # a fresh store, as a reaper process has: nothing attached by hand
    worker = lease.worker("doomed@lease-test")
    task_id = lease.make("RUNNING", worker=worker, nodename="doomed@lease-test")
    results.append(task_id)
    if inflight_step:
        _start_non_idempotent_step(lease, task_id)
    # what the worker's task_track_started wrote before the worker died
    app.backend.store_result(task_id, {"pid": 4242}, "STARTED")
    assert TaskResult.objects.get(task_id=task_id).status == "STARTED"

    lease.store.stop_worker(worker, "killed")  # its leases are expired from now on
    report = reap(app)

    assert report.expired == 1
    trail = [(t.from_state, t.to_state) for t in lease.trail(task_id)][2:]
    decided = "WAIT_MANUAL" if inflight_step else "RETRY_WAIT"
    assert [(str(a), str(b)) for a, b in trail[:2]] == [
        ("RUNNING", "TIMEOUT"),
        ("TIMEOUT", decided),
    ]
    row = wait_until(
        lambda: TaskResult.objects.filter(task_id=task_id, status=shown).first(),
        timeout=10,
        message=f"TaskResult of {task_id} never showed {shown}",
    )
    assert task_id in row.result  # the meta dict names the task (lease show hint)


def _start_non_idempotent_step(lease: Any, task_id: str) -> None:
    """Record a started, non-idempotent step under the task's current lease."""
    from sqlalchemy import select

    from celery_lease.store import Lease

    t = lease.store.t.tasks
    with lease.store.engine.connect() as conn:
        row = conn.execute(select(t.c.attempt, t.c.token).where(t.c.id == task_id)).one()
    lease.store.step_started(
        Lease(task_id, int(row.attempt), row.token), "charge card", checkable=False
    )
