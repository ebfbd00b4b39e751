"""The default store is resolved once, printed at worker start-up, and ``celery lease
check`` sees a producer and a worker that disagree about it.

Before, the default ``sqlite:///celery-lease.sqlite3`` followed each process's current
directory: a producer started elsewhere silently used another database, and nothing
said so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from celery_lease import State
from celery_lease.config import DEFAULT_DATABASE_URL, LeaseConfig, from_mapping
from celery_lease.store import Store

from ..helpers import WorkerProject, wait_until

SOURCE = """
from celery_lease import LeasedTask


@app.task(base=LeasedTask, name="d.add")
def add(x, y):
    return x + y
"""


def lease(project: WorkerProject, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``celery -A <project> lease ...`` started in ``cwd``, without a configured store."""
    env = project.process_env()
    env.pop("CELERY_LEASE_DATABASE_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", project.module, "lease", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def test_the_default_is_an_absolute_path_resolved_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CELERY_LEASE_DATABASE_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    config = from_mapping({})
    assert config.database_url == f"sqlite:///{tmp_path / 'celery-lease.sqlite3'}"
    monkeypatch.chdir(tmp_path.parent)  # a process that changes directory keeps its file
    assert config.database_url == f"sqlite:///{tmp_path / 'celery-lease.sqlite3'}"
    relative = LeaseConfig(database_url="sqlite:///data/lease.sqlite3")
    assert relative.database_url == f"sqlite:///{tmp_path.parent / 'data' / 'lease.sqlite3'}"
    assert DEFAULT_DATABASE_URL == "sqlite:///celery-lease.sqlite3"  # what the docs show


def test_check_finds_a_worker_on_another_default_store(
    celery_project: Callable[..., WorkerProject], tmp_path: Path, harness: Any, broker_url: str
) -> None:
    # the question goes through each broker's remote control (Redis pub/sub, a RabbitMQ
    # fanout exchange that every worker of the vhost answers: only this app's count)
    project = celery_project(SOURCE, broker_url=broker_url, env={"CELERY_LEASE_DATABASE_URL": ""})
    worker = project.worker()
    worker.wait_ready(timeout=60)
    # the worker's cwd is the project's directory: its default store is there, printed
    # at start-up as an absolute path
    worker_db = project.directory / "celery-lease.sqlite3"
    line = worker.wait_log(r"celery-lease: worker \S+ incarnation \S+ \(store [^)]*\)").group(0)
    assert f"(store sqlite:///{worker_db})" in line, line
    store = harness.track(Store(LeaseConfig(database_url=f"sqlite:///{worker_db}")))
    wait_until(
        lambda: any(w.nodename == worker.nodename for w in store.workers()),
        message="worker registered in its store",
    )

    # a producer in the same directory agrees with the worker
    same = lease(project, project.directory, "check", "--no-liveness")
    assert same.returncode == 0, same.stdout + same.stderr
    assert "no violations" in same.stdout
    assert f"store: sqlite:///{worker_db}" in same.stderr

    # one started elsewhere finds no store there: it says so and creates none
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    missing = lease(project, elsewhere, "check", "--no-liveness")
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert f"no lease store at {elsewhere / 'celery-lease.sqlite3'}" in missing.stderr
    assert not (elsewhere / "celery-lease.sqlite3").exists()

    # with a store of its own there, the check says which worker disagrees
    made = lease(project, elsewhere, "migrate")
    assert made.returncode == 0, made.stdout + made.stderr
    other = lease(project, elsewhere, "check", "--no-liveness", "--json")
    assert other.returncode == 5, other.stdout + other.stderr
    report = json.loads(other.stdout)
    assert report["counts"] == {"worker_on_other_store": 1}
    (violation,) = report["violations"]
    assert worker.nodename in violation["detail"]
    assert f"sqlite:///{worker_db}" in violation["detail"]
    assert f"sqlite:///{elsewhere / 'celery-lease.sqlite3'}" in violation["detail"]

    # --no-workers skips the question (and the safety scan alone finds nothing)
    skipped = lease(project, elsewhere, "check", "--no-liveness", "--no-workers")
    assert skipped.returncode == 0, skipped.stdout + skipped.stderr

    # and the store the worker printed is the one its tasks are recorded in
    app = project.load().app
    app.conf.lease_database_url = f"sqlite:///{worker_db}"
    task_id = str(app.tasks["d.add"].delay(1, 2).id)
    wait_until(
        lambda: (r := store.get(task_id)) is not None and r.state is State.SUCCEEDED,
        timeout=60,
        message="task SUCCEEDED in the worker's store",
    )
    worker.stop()
    assert not (Path(os.getcwd()) / "celery-lease.sqlite3").exists()
