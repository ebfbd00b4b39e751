"""A real worker of the Django project uses Django's database for the lease store (no
CELERY_LEASE_DATABASE_URL): its leased task's row, its heartbeat and its result all land
in the database the admin reads."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO_ROOT, wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@pytest.fixture
def django_worker(django_project: Any, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    from django.db import connection

    env = dict(os.environ)
    for key in ("PYTEST_CURRENT_TEST", "PYTEST_ADDOPTS", "PYTHONWARNINGS"):
        env.pop(key, None)
    env.update(
        # the worker's settings name the test database, as a deployment's name its own
        DJANGO_SETTINGS_MODULE="tests.django.proj.settings",
        CELERY_LEASE_DJANGO_DB=connection.settings_dict["NAME"],
        PYTHONPATH=str(REPO_ROOT),
        C_FORCE_ROOT="1",
        PYTHONUNBUFFERED="1",
    )
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "celery", "-A", "tests.django.proj", "worker",
                "-P", "prefork", "-c", "1", "-n", "django-w1@lease-test",
                "-Q", django_project.conf.task_default_queue, "--loglevel=INFO",
                "--without-gossip", "--without-mingle", "--without-heartbeat",
            ],
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    proc.log_path = log_path  # type: ignore[attr-defined]
    try:
        try:
            wait_until(
                lambda: proc.poll() is None and re.search(r" ready\.", log_path.read_text()),
                timeout=60,
                message="the worker never logged 'ready'",
            )
        except AssertionError as error:
            raise AssertionError(f"{error}\n{log_path.read_text()[-3000:]}") from None
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_worker_runs_leased_task_in_djangos_database(
    django_project: Any, lease: Any, django_worker: Any, make_user: Any, client_for: Any
):
    from django_celery_results.models import TaskResult

    from celery_lease.contrib.django.models import Task, Worker
    from tests.django.proj.tasks import add

    result = add.delay(2, 3)

    try:
        wait_until(lambda: lease.state(result.id) == "SUCCEEDED", timeout=60)
    except AssertionError as error:
        raise AssertionError(f"{error}\n{django_worker.log_path.read_text()[-3000:]}") from None
    # the worker's incarnation row and the task's row, read through the Django models
    assert Worker.objects.filter(nodename="django-w1@lease-test").exists()
    task = Task.objects.get(pk=result.id)
    assert task.state == "SUCCEEDED" and task.result == "5"
    assert Worker.objects.get(pk=task.owner).nodename == "django-w1@lease-test"
    # and the worker's result in django-celery-results, in the same database
    row = wait_until(lambda: TaskResult.objects.filter(task_id=result.id, status="SUCCESS").first())
    assert row.result == "5"
    # the admin shows it under that worker
    client = client_for(make_user("viewer", "view_task"))
    # (messages other tests of this session left on the queue ran here too: every row
    # listed must be one this worker ran)
    response = client.get("/admin/celery_lease/task/", {"worker": "django-w1@lease-test"})
    listed = list(response.context["cl"].result_list)
    assert result.id in [str(t.pk) for t in listed]
    owners = {Worker.objects.get(pk=t.owner).nodename for t in listed}
    assert owners == {"django-w1@lease-test"}, owners
