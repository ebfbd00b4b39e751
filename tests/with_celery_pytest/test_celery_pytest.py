"""Celery's documented test pattern with leased tasks: ``celery_app`` + ``celery_worker``
(the task defined inside the test, then ``celery_worker.reload()``) and
``task_always_eager``. See the conftest for how the fixtures are enabled."""

from __future__ import annotations

from typing import Any

from celery import chain

from celery_lease import LeasedTask, State, admin


def test_a_leased_task_defined_in_the_test_runs_in_the_test_worker(
    celery_app: Any, celery_worker: Any
) -> None:
    @celery_app.task(base=LeasedTask, bind=True, name="pytest.mul", shared=False)
    def mul(self: Any, x: int, y: int) -> int:
        # a recorded step, as a crash-safe task has: it needs the worker's execution
        return int(self.step("multiply", lambda: x * y, idempotent=True))

    @celery_app.task(base=LeasedTask, bind=True, name="pytest.inc", shared=False)
    def inc(self: Any, x: int) -> int:
        return x + 1

    celery_worker.reload()

    result = mul.delay(4, 4)
    assert result.get(timeout=20) == 16
    record = admin(celery_app).get(result.id)
    assert record is not None and record.state is State.SUCCEEDED and record.result == 16
    assert [s.name for s in admin(celery_app).steps(result.id)] == ["multiply"]

    # a chain of leased tasks in the same worker: the follow-up runs once, with a row
    chained = chain(mul.s(2, 3), inc.s()).delay()
    assert chained.get(timeout=20) == 7
    follow_up = admin(celery_app).get(chained.id)
    assert follow_up is not None and follow_up.state is State.SUCCEEDED
    assert follow_up.result == 7


def test_task_always_eager_runs_a_leased_task_in_the_caller(celery_app: Any) -> None:
    celery_app.conf.task_always_eager = True
    calls: list[int] = []

    @celery_app.task(base=LeasedTask, bind=True, name="pytest.eager", shared=False)
    def eager(self: Any, x: int) -> int:
        calls.append(x)
        return int(self.step("double", lambda: x * 2))

    @celery_app.task(base=LeasedTask, bind=True, name="pytest.eager_inc", shared=False)
    def eager_inc(self: Any, x: int) -> int:
        calls.append(x)
        return x + 1

    result = eager.delay(21)
    assert result.successful() and result.get() == 42
    assert chain(eager.s(1), eager_inc.s()).delay().get() == 3
    assert calls == [21, 1, 2]
