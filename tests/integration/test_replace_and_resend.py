"""A task id sent again, as Celery runs it: ``Task.replace()`` runs the replacement
(which carries the replaced task's id), a new submission of a finished task's id runs
again, and only a ``dedup_key`` (or a live row) makes a second submission a no-op.
Real workers, both brokers, both stores."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from celery import chain

from celery_lease import State, TaskRecord
from celery_lease.store import REPLACED, Claim, NewTask, Store

from ..crash.support import CLEAN_RUN, LeaseEnv
from ..helpers import wait_until

PROJECT = """
from celery import chain, group
from celery_lease import LeasedTask
from tests.helpers import ExternalSystem

external = ExternalSystem.from_env()

@app.task(base=LeasedTask, shared=False, name="r.add")
def add(x, y):
    external.call("add", payload=f"{x}+{y}")
    return x + y

@app.task(base=LeasedTask, shared=False, name="r.double")
def double(x):
    external.call("double", payload=x)
    return 2 * x

@app.task(base=LeasedTask, bind=True, shared=False, name="r.replace_with")
def replace_with(self, how, x):
    external.call("replaced", payload=how)
    if how == "task":
        return self.replace(add.s(x, 1))
    if how == "chain":
        return self.replace(chain(add.s(x, 1), double.s()))
    return self.replace(group(add.s(x, 1), double.s(x)))
"""


def combo(broker: str, backend: str) -> Any:  # a pytest ParameterSet
    marks = [pytest.mark.postgres] if backend == "postgresql" else []
    return pytest.param(broker, backend, id=f"{broker}-{backend}", marks=marks)


def on(*combos: Any) -> pytest.MarkDecorator:
    return pytest.mark.parametrize(("broker_url", "backend"), list(combos), indirect=True)


def results(tmp_path: Path) -> dict[str, Any]:
    return {"result_backend": f"db+sqlite:///{tmp_path / 'results.sqlite3'}"}


#: The trail of a task id run twice: the first run ends SUCCEEDED (replaced, or done),
#: then the replacement or the new submission with the same id is a fresh row.
RUN_TWICE = [*CLEAN_RUN, *CLEAN_RUN]


@on(combo("redis", "sqlite"), combo("amqp", "postgresql"))
def test_replace_runs_the_replacement_with_the_replaced_tasks_id(
    lease_env: LeaseEnv, broker_url: str, tmp_path: Path
) -> None:
    p = lease_env.project(broker_url=broker_url, source=PROJECT, settings=results(tmp_path))
    replace_with = p.module.app.tasks["r.replace_with"]
    p.worker(concurrency=2)

    by_task = replace_with.delay("task", 1)
    by_chain = replace_with.delay("chain", 10)
    by_group = replace_with.delay("group", 100)

    # the result of the replaced id is the replacement's, as in Celery
    assert by_task.get(timeout=60) == 2
    assert by_chain.get(timeout=60) == 22
    assert by_group.get(timeout=60) == [101, 200]

    for result in (by_task, by_chain):
        record = p.wait_state(result.id, State.SUCCEEDED)
        assert p.trail(result.id) == RUN_TWICE
        history = p.store.history(result.id)
        assert history[2].reason is not None and history[2].reason.startswith("replaced")
        assert history[3].reason is not None and history[3].reason.startswith("resubmitted")
        assert record.attempt == 1  # a fresh row: its own first claim
    assert p.get(by_task.id).name == "r.add"
    assert p.get(by_chain.id).name == "r.double"
    # a group's replacement gives the id to Celery's own accumulator (not leased): the
    # replaced row stays SUCCEEDED, its reason says why
    grouped = p.get(by_group.id)
    assert p.trail(by_group.id) == CLEAN_RUN and grouped.name == "r.replace_with"
    assert grouped.reason is not None and grouped.reason.startswith("replaced")
    # each replaced task ran once, each replacement once
    assert lease_env.external.count("replaced") == 3
    assert sorted(e.payload or "" for e in lease_env.external.effects("add")) == [
        "1+1",
        "10+1",
        "100+1",
    ]
    assert lease_env.external.count("double") == 2


@on(combo("redis", "postgresql"), combo("amqp", "sqlite"))
def test_a_finished_task_id_sent_again_runs_again_unless_deduplicated(
    lease_env: LeaseEnv, broker_url: str, tmp_path: Path
) -> None:
    p = lease_env.project(broker_url=broker_url, source=PROJECT, settings=results(tmp_path))
    app = p.module.app
    add, double = app.tasks["r.add"], app.tasks["r.double"]
    p.worker()

    def second_run(task_id: str) -> TaskRecord:
        return wait_until(
            lambda: p.trail(task_id) == RUN_TWICE and p.get(task_id),
            timeout=60,
            message=f"{task_id} SUCCEEDED in a second run",
        )

    first = add.apply_async((1, 2), task_id="resent-1")
    assert first.get(timeout=60) == 3
    p.wait_state("resent-1", State.SUCCEEDED)
    # a new apply_async with the same id: a new run, with the new arguments
    # (Celery's result backend keeps the first run's result until the second stores
    # its own, with or without a lease: the row tells when the new run finished)
    add.apply_async((3, 4), task_id="resent-1")
    record = second_run("resent-1")
    assert record.args == [3, 4] and record.result == 7
    assert p.trail("resent-1") == RUN_TWICE
    assert [e.payload for e in lease_env.external.effects("add")] == ["1+2", "3+4"]

    # a frozen chain applied twice runs twice, as in Celery
    frozen = chain(add.s(5, 5), double.s())
    frozen.freeze()
    assert frozen.apply_async().get(timeout=60) == 20
    p.wait_state(frozen.id, State.SUCCEEDED)
    frozen.apply_async()
    assert second_run(frozen.id).result == 20
    assert lease_env.external.count("double") == 2

    # a dedup key asks for one run: the second submission is the first task
    keyed = add.apply_async((8, 8), dedup_key="once")
    assert keyed.get(timeout=60) == 16
    p.wait_state(keyed.id, State.SUCCEEDED)
    again = add.apply_async((9, 9), dedup_key="once")
    assert again.id == keyed.id
    # one worker, one queue: a task sent after it runs after anything it published
    assert add.delay(0, 0).get(timeout=60) == 0
    assert p.trail(keyed.id) == CLEAN_RUN
    assert "9+9" not in [e.payload for e in lease_env.external.effects("add")]


def test_the_store_tells_a_new_submission_from_a_resent_message(store: Store) -> None:
    new = NewTask(
        id="x",
        name="tests.job",
        args="[]",
        kwargs="{}",
        options=None,
        lease_ttl=5.0,
        max_recoveries=3,
    )
    resent = dataclasses.replace(new, resend=True)

    def run(reason: str = "succeeded") -> None:
        claim = store.claim("x", "owner", "worker:test")
        assert isinstance(claim, Claim)
        if reason == "succeeded":
            assert store.finish(claim.lease, State.SUCCEEDED, actor="worker:test", reason=reason)
        else:
            assert store.replace(claim.lease, [], actor="worker:test", reason=reason) == []

    assert store.submit(new) == ("x", True)
    assert store.submit(new) == ("x", False)  # live: one run at a time per id
    run()
    assert store.submit(resent) == ("x", False)  # the same message again: the same task
    assert store.submit(new) == ("x", True)  # a new submission: a fresh row
    assert store.get("x").state is State.PENDING  # type: ignore[union-attr]
    run(f"{REPLACED} (by t.other)")
    # a replaced run hands its id to the replacement, even one sent a second time
    assert store.submit(resent) == ("x", True)
    assert store.submit(resent) == ("x", False)
    assert [(t.from_state, t.to_state) for t in store.history("x")] == [
        *[(None if a is None else State(a), State(b)) for a, b in CLEAN_RUN] * 2,
        (None, State.PENDING),
    ]
