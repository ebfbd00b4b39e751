"""Celery's session-wide test worker (``celery_session_app`` + ``celery_session_worker``)
with a leased task registered by the test, then ``celery_session_worker.reload()``."""

from __future__ import annotations

from typing import Any

from celery_lease import LeasedTask, State, admin


def test_a_leased_task_runs_in_the_session_worker(
    celery_session_app: Any, celery_session_worker: Any
) -> None:
    @celery_session_app.task(base=LeasedTask, bind=True, name="pytest.session_add", shared=False)
    def session_add(self: Any, x: int, y: int) -> int:
        return x + y

    celery_session_worker.reload()

    result = session_add.delay(20, 22)
    assert result.get(timeout=20) == 42
    record = admin(celery_session_app).get(result.id)
    assert record is not None and record.state is State.SUCCEEDED and record.result == 42
