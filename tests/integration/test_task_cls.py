"""``Celery("proj", task_cls="celery_lease:LeasedTask")``: an app whose every task is
leased, with the task class named by the string Celery documents.

Before, the string failed with a circular import when the app was finalised before
anything had imported ``celery_lease``: importing the package registered its own
``celery_lease.reap`` shared task, which asked the finalising app for its ``Task``
class, which imported ``celery_lease`` again. The producer here is a fresh interpreter
(the test process has imported the package long ago); the worker runs the task leased.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from celery_lease import State

from ..crash.support import LeaseEnv

# the generated module's ``app`` is replaced by one built with the string
SOURCE = """
_template = app
app = Celery(
    "proj", task_cls="celery_lease:LeasedTask", broker=_template.conf.broker_url
)
app.conf.update(_template.conf.changes)


@app.task(name="s.double")
def double(x):
    return 2 * x
"""

PRODUCER = """
import sys

import {module} as project

project.app.finalize()
import celery_lease

tasks = project.app.tasks
assert isinstance(tasks["s.double"], celery_lease.LeasedTask), type(tasks["s.double"]).__mro__
# the package's own sweep stays a plain task in such an app
assert not isinstance(tasks["celery_lease.reap"], celery_lease.LeasedTask)
print(project.double.delay(21).id)
"""


@pytest.mark.parametrize("broker_url", ["redis", "amqp"], indirect=True)
def test_an_app_whose_task_cls_is_the_string_leases_every_task(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = lease_env.project(broker_url=broker_url, source=SOURCE)
    project = p.project
    done = subprocess.run(
        [sys.executable, "-c", PRODUCER.format(module=project.module)],
        env=project.process_env(),
        cwd=project.directory,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    task_id = done.stdout.strip().splitlines()[-1]
    assert p.get(task_id).state is State.PENDING  # written by the producer, leased
    p.worker()
    record = p.wait_state(task_id, State.SUCCEEDED, timeout=60)
    assert record.result == 42 and record.attempt == 1
