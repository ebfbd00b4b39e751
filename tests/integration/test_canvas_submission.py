"""What plain Celery accepts at submission, a leased task accepts too.

Found by running Celery's own integration suite with every task leased
(``scripts/celery_suite.py``): arguments Celery's JSON serializer encodes (datetimes,
UUIDs, decimals, bytes, NaN, pydantic models), a group containing a chord, and a group
whose app is Celery's ``current_app`` proxy. Each on both brokers and both stores, with
real workers.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator
from datetime import date, datetime, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from celery import chain, chord, current_app, group, signature

from celery_lease import NotSerializable, State

from ..crash.support import LeaseEnv, queue_depth
from ..helpers import wait_until

PROJECT = """
import pydantic

from celery_lease import LeasedTask


class Point(pydantic.BaseModel):
    x: int
    y: int


@app.task(base=LeasedTask, shared=False, name="c.describe")
def describe(*args, **kwargs):
    shown = [f"{type(a).__name__}:{a!r}" for a in args]
    return shown + [f"{k}={type(v).__name__}:{v!r}" for k, v in sorted(kwargs.items())]


@app.task(base=LeasedTask, shared=False, pydantic=True, name="c.area")
def area(point: Point) -> int:
    return point.x * point.y


@app.task(base=LeasedTask, shared=False, name="c.double")
def double(x):
    return 2 * x


@app.task(base=LeasedTask, shared=False, name="c.total")
def total(values):
    return sum(values)


@app.task(base=LeasedTask, shared=False, name="c.limits", soft_time_limit=10, time_limit=5)
def limits():
    return 1
"""

WHEN = datetime(2026, 12, 2, 7, 30, 15, 250000, tzinfo=timezone.utc)
IDENT = uuid.UUID("8f6a1d2e-3c4b-4a5d-9e6f-7a8b9c0d1e2f")
#: Values Celery's JSON serializer (kombu's) encodes and gives back as they were.
ARGS: tuple[Any, ...] = (WHEN, date(2026, 12, 2), IDENT, Decimal("1.10"), b"\x00raw", math.nan)


def described(*args: Any, **kwargs: Any) -> list[str]:
    shown = [f"{type(a).__name__}:{a!r}" for a in args]
    return shown + [f"{k}={type(v).__name__}:{v!r}" for k, v in sorted(kwargs.items())]


#: These tests are about submission, not lease loss: a TTL far longer than any of them,
#: so that a heartbeat delayed on a loaded machine never turns a run into a recovery
#: (attempt 2) that the assertions of one clean run would not expect.
LONG_TTL = 30.0


@pytest.fixture
def project(lease_env: LeaseEnv, broker_url: str, tmp_path: Path) -> Iterator[Any]:
    backend = f"db+sqlite:///{tmp_path / 'results.sqlite3'}"
    yield lease_env.project(
        broker_url=broker_url,
        source=PROJECT,
        settings={"result_backend": backend},
        ttl=LONG_TTL,
    )


@pytest.mark.parametrize("broker_url", ["redis", "amqp"], indirect=True)
def test_arguments_celerys_json_accepts_are_stored_and_run(project: Any) -> None:
    p = project
    app = p.module.app
    describe, area, double = app.tasks["c.describe"], app.tasks["c.area"], app.tasks["c.double"]
    point = p.module.Point(x=3, y=4)

    direct = describe.apply_async(ARGS, {"at": WHEN, "ident": IDENT})
    model = area.delay(point)
    # a callback carrying one: sent by the worker when the first task is done
    chained = chain(double.s(2), describe.s(WHEN, IDENT)).apply_async()

    record = p.get(direct.id)
    assert record.state is State.PENDING
    assert p.get(model.id).state is State.PENDING
    p.worker()
    assert direct.get(timeout=60) == described(*ARGS, at=WHEN, ident=IDENT)
    assert model.get(timeout=60) == 12
    assert chained.get(timeout=60) == described(4, WHEN, IDENT)
    p.wait_state(direct.id, State.SUCCEEDED)
    assert p.get(direct.id).attempt == 1


@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_an_argument_celery_refuses_is_refused_by_name_and_nothing_is_written(
    project: Any, broker_url: str, queue_name: str
) -> None:
    p = project
    describe = p.module.app.tasks["c.describe"]
    with pytest.raises(NotSerializable, match=r"argument 1 of c\.describe") as caught:
        describe.delay(WHEN, object())
    assert caught.value.what == "argument 1 of c.describe"
    assert caught.value.serializer == "json"
    with pytest.raises(NotSerializable, match=r"keyword argument 'thing' of c\.describe"):
        describe.apply_async((), {"thing": object()})
    assert p.store.list_tasks(limit=10) == []
    assert queue_depth(broker_url, queue_name) == 0
    # the check above can fail: an accepted value is written and published
    accepted = describe.delay(WHEN)
    assert p.get(accepted.id).state is State.PENDING
    wait_until(lambda: queue_depth(broker_url, queue_name) == 1, message="one message queued")


@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_what_celery_refuses_while_building_is_raised_as_celery_raises_it(
    project: Any, broker_url: str, queue_name: str
) -> None:
    # arguments that do not fit the task's signature (Celery's typing check) and a soft
    # time limit over the hard one: plain Celery raises TypeError and ValueError from
    # apply_async; a leased task raises the same, and writes and sends nothing
    p = project
    double = p.module.app.tasks["c.double"]
    with pytest.raises(TypeError, match="argument"):
        double.delay()
    with pytest.raises(TypeError):
        double.delay(1, wrong=2)
    with pytest.raises(ValueError, match="soft_time_limit must be less than or equal"):
        p.module.app.tasks["c.limits"].delay()
    assert p.store.list_tasks(limit=10) == []
    assert queue_depth(broker_url, queue_name) == 0
    accepted = double.delay(1)  # the check above can fail: this one is written
    assert p.get(accepted.id).state is State.PENDING


@pytest.mark.parametrize("broker_url", ["redis", "amqp"], indirect=True)
@pytest.mark.parametrize("batch_groups", [True, False], ids=["batched", "one-by-one"])
def test_a_group_containing_a_chord_is_submitted_and_runs_once(
    lease_env: LeaseEnv, broker_url: str, tmp_path: Path, batch_groups: bool
) -> None:
    backend = f"db+sqlite:///{tmp_path / 'results.sqlite3'}"
    p = lease_env.project(
        broker_url=broker_url,
        source=PROJECT,
        settings={"result_backend": backend},
        batch_groups=batch_groups,
        ttl=LONG_TTL,
    )
    app = p.module.app
    double, total = app.tasks["c.double"], app.tasks["c.total"]

    inner = chord([double.s(2), double.s(3)], total.s())
    grouped = group(double.s(1), inner, double.s(4)).apply_async()

    first, chorded, last = grouped.results
    # written and published before apply_async returned
    for member in (first, last, *chorded.parent.results):
        assert p.get(member.id).state is State.PENDING
    p.worker(concurrency=2)
    assert grouped.get(timeout=60) == [2, 10, 8]
    for member in (first, last, *chorded.parent.results):
        assert p.get(member.id).attempt == 1


@pytest.mark.parametrize("broker_url", ["redis", "amqp"], indirect=True)
def test_a_group_whose_app_is_the_current_app_proxy_is_submitted(project: Any) -> None:
    p = project
    app = p.module.app
    app.set_current()
    double = app.tasks["c.double"]
    # signatures rebuilt from their dict form, as a message or JSON gives them, have no
    # app of their own: their app (and the group's) is Celery's current_app proxy
    rebuilt = [signature(dict(double.s(i))) for i in range(3)]
    grouped = group(rebuilt)
    assert grouped.app is current_app
    result = grouped.apply_async()
    # a group led by an empty chain: the chain has no app of its own either
    led = group(chain(), double.s(10), chain()).apply_async()

    for member in result.results:
        assert p.get(member.id).state is State.PENDING
    p.worker()
    assert result.get(timeout=60) == [0, 2, 4]
    assert led.get(timeout=60) == [20]
