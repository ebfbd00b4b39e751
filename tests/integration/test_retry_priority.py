"""A leased task's priority and a broker purge, beside plain Celery's.

Found by running Celery's own integration suite with every task leased
(``scripts/celery_suite.py``): ``test_tasks::test_task_retried_priority`` passes alone
leased, and fails in the whole file because an earlier test's canvases, which the
suite's ``Manager`` purges from the broker between tests, come back: a purged message of
a leased task is a lost message to the lease, and the reaper publishes it again. These
tests pin both facts on real workers: the priority a task was sent with is the retry's
priority (both brokers, both stores), and what a purge does to a plain and to a leased
task.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from celery.result import AsyncResult

from celery_lease import State

from ..crash.support import CLEAN_RUN, LeaseEnv, queue_depth
from ..helpers import wait_until

PROJECT = """
from celery_lease import LeasedTask


@app.task(bind=True, shared=False, max_retries=1, name="p.plain_priority")
def plain_priority(self):
    if self.request.retries:
        return self.request.delivery_info["priority"]
    raise self.retry(countdown=0.1)


@app.task(base=LeasedTask, bind=True, shared=False, max_retries=1, name="p.leased_priority")
def leased_priority(self):
    if self.request.retries:
        return self.request.delivery_info["priority"]
    raise self.retry(countdown=0.1)


@app.task(shared=False, name="p.plain_echo")
def plain_echo(x):
    return x


@app.task(base=LeasedTask, shared=False, name="p.leased_echo")
def leased_echo(x):
    return x
"""

#: A retry's trail: the first attempt retries once, the second succeeds.
RETRIED_ONCE = [
    (None, "PENDING"),
    ("PENDING", "RUNNING"),
    ("RUNNING", "RETRY_WAIT"),
    ("RETRY_WAIT", "PENDING"),
    ("PENDING", "RUNNING"),
    ("RUNNING", "SUCCEEDED"),
]


def results(tmp_path: Path) -> dict[str, Any]:
    return {"result_backend": f"db+sqlite:///{tmp_path / 'results.sqlite3'}"}


@pytest.mark.parametrize("broker_url", ["redis", "amqp"], indirect=True)
def test_a_retry_keeps_the_priority_the_task_was_sent_with(
    lease_env: LeaseEnv, broker_url: str, tmp_path: Path
) -> None:
    # Celery's retry() takes the delivery's priority into the retry's message
    # (signature_from_request); the worker reads it back from the message's properties.
    # On Redis, priority 7 also moves the message to another list than the queue's own.
    p = lease_env.project(broker_url=broker_url, source=PROJECT, settings=results(tmp_path))
    app = p.module.app
    plain = app.tasks["p.plain_priority"].apply_async(priority=7)
    leased = app.tasks["p.leased_priority"].apply_async(priority=7)
    p.worker()

    assert plain.get(timeout=60) == 7
    assert leased.get(timeout=60) == 7
    p.wait_state(leased.id, State.SUCCEEDED)
    assert p.trail(leased.id) == RETRIED_ONCE
    assert p.get(leased.id).retries == 1


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [
        pytest.param("redis", "sqlite", id="redis-sqlite"),
        pytest.param("amqp", "postgresql", id="amqp-postgresql", marks=pytest.mark.postgres),
    ],
    indirect=True,
)
def test_a_purged_message_of_a_leased_task_is_published_again(
    lease_env: LeaseEnv, broker_url: str, queue_name: str, tmp_path: Path
) -> None:
    # Celery's purge (app.control.purge(), `celery purge`) deletes the queued messages:
    # a plain task is gone, its result PENDING forever. For the lease the message of a
    # PENDING row was lost, whatever removed it: the reaper publishes the row's message
    # again and the task runs once. A task to be dropped is cancelled through the lease.
    p = lease_env.project(
        broker_url=broker_url, source=PROJECT, settings=results(tmp_path), republish_after=1.0
    )
    app = p.module.app
    plain = app.tasks["p.plain_echo"].delay("plain")
    leased = app.tasks["p.leased_echo"].delay("leased")
    wait_until(lambda: p.get(leased.id).published_at is not None, message="marked published")
    wait_until(lambda: queue_depth(broker_url, queue_name) == 2, message="both queued")

    assert app.control.purge() == 2
    assert queue_depth(broker_url, queue_name) == 0
    worker = p.worker()

    assert leased.get(timeout=60) == "leased"
    p.wait_state(leased.id, State.SUCCEEDED)
    assert p.trail(leased.id) == CLEAN_RUN  # re-publishing is not a state change
    p.wait_log(worker, r"'republished': [1-9]")
    # the plain task's message is gone: nothing ran it, nothing will
    assert AsyncResult(plain.id, app=app).state == "PENDING"
    assert queue_depth(broker_url, queue_name) == 0
