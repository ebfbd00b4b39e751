"""Errbacks in nested canvases run as many times as with plain Celery: a chord inside a
group body whose own body fails calls the group's and the chord's errbacks once each."""

from __future__ import annotations

from typing import Any

import pytest
from celery import chord, group

from celery_lease import State

from ..crash.support import LeaseEnv
from ..helpers import wait_until

PROJECT = """
from celery_lease import LeasedTask
from tests.helpers import ExternalSystem

external = ExternalSystem.from_env()

@app.task(base=LeasedTask, shared=False, name="e.add")
def add(x, y):
    return x + y

@app.task(base=LeasedTask, shared=False, name="e.fail")
def fail(*args):
    raise ValueError("expected to fail")

@app.task(base=LeasedTask, shared=False, name="e.tsum")
def tsum(values):
    return sum(values)

@app.task(base=LeasedTask, shared=False, name="e.echo")
def echo(tag):
    external.call("echo", payload=tag)
    return tag
"""


def combo(broker: str, backend: str) -> Any:  # a pytest ParameterSet
    marks = [pytest.mark.postgres] if backend == "postgresql" else []
    return pytest.param(broker, backend, id=f"{broker}-{backend}", marks=marks)


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [combo("redis", "sqlite"), combo("amqp", "postgresql")],
    indirect=True,
)
def test_errbacks_of_a_chord_in_a_group_body_run_once(
    lease_env: LeaseEnv, broker_url: str, redis_url: str
) -> None:
    # Celery's t/integration test_link_error_option_runs_once_for_chord_in_group_body_
    # with_link_error, with every task leased
    p = lease_env.project(
        broker_url=broker_url, source=PROJECT, settings={"result_backend": redis_url}
    )
    app = p.module.app
    add, fail, tsum, echo = (app.tasks[f"e.{n}"] for n in ("add", "fail", "tsum", "echo"))
    p.worker(concurrency=2)

    body = group(chord([add.si(1, 1)], group(fail.s(), tsum.s()))).set(link_error=echo.si("group"))
    result = chord([add.si(1, 1)], body).apply_async(link_error=echo.si("chord"))
    with pytest.raises(ValueError, match="expected to fail"):
        result.get(timeout=60)

    def echoes_done() -> list[str]:
        rows = p.store.list_tasks(name="e.echo", limit=100)
        return (
            [str(r.result) for r in rows] if all(r.state is State.SUCCEEDED for r in rows) else []
        )

    wait_until(lambda: len(echoes_done()) >= 2, timeout=30, message="two errbacks ran")
    # one worker slot after another drained: an errback sent late would be queued by now
    assert add.delay(0, 0).get(timeout=60) == 0
    assert add.delay(0, 0).get(timeout=60) == 0
    assert sorted(echoes_done()) == ["chord", "group"]
    assert sorted(e.payload or "" for e in lease_env.external.effects("echo")) == [
        "chord",
        "group",
    ]
