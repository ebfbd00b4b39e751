"""``examples/orders.py`` runs as its docstring and docs/howto-crash-safe-tasks.md say:
a real worker, an order placed from the command line, and the crash the payment step's
idempotency key and ``check`` exist for."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from celery_lease import State
from celery_lease.config import LeaseConfig
from celery_lease.store import Store

from ..helpers import REPO_ROOT, WorkerProject, wait_until

EXAMPLES = REPO_ROOT / "examples"

SOURCE = f"""
import sys

sys.path.insert(0, {str(EXAMPLES)!r})
from orders import *  # noqa: F403  (the example's app replaces the generated one)
"""


class Example:
    def __init__(self, project: WorkerProject, data: Path, env: dict[str, str], harness: Any):
        self.project = project
        self.data = data
        self.env = env
        self.store = harness.track(
            Store(LeaseConfig(database_url=f"sqlite:///{data / 'shop.sqlite3'}"))
        )

    def cli(self, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, str(EXAMPLES / "orders.py"), *args],
            env=self.project.process_env(self.env),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def charges(self) -> list[tuple[Any, ...]]:
        with sqlite3.connect(self.data / "payments.sqlite3") as db:
            return list(db.execute("SELECT id, amount, idempotency_key FROM charges"))

    def finished(self, task_id: str) -> Any:
        def done() -> bool:
            record = self.store.get(task_id)
            return record is not None and record.state is State.SUCCEEDED

        wait_until(done, timeout=30, message=f"order task {task_id} never succeeded")
        return self.store.get(task_id)


@pytest.fixture
def example(
    celery_project: Callable[..., WorkerProject],
    tmp_path: Path,
    queue_name: str,
    redis_url: str,
    harness: Any,
) -> Callable[..., Example]:
    def make(crash: str | None = None) -> Example:
        data = tmp_path / "orders-data"
        env = {"ORDERS_DATA": str(data), "ORDERS_QUEUE": queue_name, "BROKER_URL": redis_url}
        if crash:
            env["ORDERS_CRASH_ONCE"] = crash
        project = celery_project(SOURCE, env=env)
        project.worker().wait_ready()  # the worker creates the lease tables
        return Example(project, data, env, harness)

    return make


def test_an_order_is_placed_charged_once_and_shipped(example):
    ex = example()
    task_id = ex.cli("place", "12.50").strip()

    record = ex.finished(task_id)
    (charge,) = ex.charges()
    assert record.result == charge[0] and charge[1] == "12.50"
    assert record.attempt == 1
    shown = ex.cli("show", task_id)
    assert "SUCCEEDED" in shown and "step charge: DONE" in shown and "step ship: DONE" in shown
    with sqlite3.connect(ex.data / "shop.sqlite3") as db:
        assert db.execute("SELECT status FROM orders").fetchall() == [("shipped",)]


def test_a_crash_right_after_the_charge_resumes_and_charges_once(example):
    ex = example(crash="after_charge")
    task_id = ex.cli("place", "10").strip()

    record = ex.finished(task_id)
    assert (ex.data / "crashed-after_charge").exists()
    assert record.attempt == 2  # the child died; the re-run looked the charge up
    assert len(ex.charges()) == 1
    assert "charge 1: 10" in ex.cli("payments")
