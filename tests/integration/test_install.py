"""The first run just works: the built wheel, installed with its extras into a fresh
virtualenv the way a user installs it (not the test extra, not this checkout), runs a
LeasedTask to SUCCEEDED on a real worker with each broker.

Before, ``celery-lease[redis]`` brought ``redis`` but not ``packaging``, which kombu
5.7's Redis transport imports: the first worker start failed with
``ModuleNotFoundError``. The extras now pull the transports' own extras.

One virtualenv per broker; pip's cache is used (PyPI or the configured index must be
reachable). Two installs: Redis with ``[redis,prometheus]`` on a SQLite store, RabbitMQ
(amqp, a dependency of celery itself) with ``[postgres,django,testing]`` on PostgreSQL.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from celery_lease import State
from celery_lease.config import LeaseConfig
from celery_lease.store import Store

from ..conftest import drop_pg_schema
from ..helpers import REPO_ROOT, WorkerProject, wait_until

pytestmark = pytest.mark.slow

SOURCE = """
from celery_lease import LeasedTask


@app.task(base=LeasedTask, bind=True, name="inst.greet")
def greet(self, name):
    return self.step("greet", lambda: f"hello {name}")
"""

#: What each installed extra must make importable (beyond celery_lease itself).
IMPORTS = {
    "redis": ["redis", "packaging", "kombu.transport.redis"],
    "prometheus": ["prometheus_client", "celery_lease.metrics"],
    "postgres": ["psycopg"],
    "django": ["django", "celery_lease.contrib.django.apps"],
    "testing": ["pytest", "celery_lease.testing.plugin"],
}


def run(argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    proc = subprocess.run(
        argv,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}:\n{output}"
    return output


def clean_env() -> dict[str, str]:
    """The environment of a user's shell: nothing of this test run's Python set-up."""
    env = dict(os.environ)
    for key in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTEST_ADDOPTS", "PYTHONWARNINGS"):
        env.pop(key, None)
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from this checkout (hatchling, through pip's build isolation)."""
    out = tmp_path_factory.mktemp("wheel")
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), "."],
        cwd=REPO_ROOT,
        env=clean_env(),
    )
    (built,) = out.glob("celery_lease-*.whl")
    return built


def venv_with(wheel: Path, extras: list[str], where: Path) -> Path:
    """A fresh virtualenv with ``wheel[extras]`` installed; its python."""
    env = clean_env()
    run([sys.executable, "-m", "venv", str(where)], cwd=where.parent, env=env)
    python = where / "bin" / "python"
    run(
        [str(python), "-m", "pip", "install", "--quiet", f"{wheel}[{','.join(extras)}]"],
        cwd=where.parent,
        env=env,
    )
    run([str(python), "-m", "pip", "check"], cwd=where.parent, env=env)
    # the package comes from the wheel, not from this checkout
    origin = run(
        [str(python), "-c", "import celery_lease; print(celery_lease.__file__)"],
        cwd=where.parent,
        env=env,
    )
    assert str(where) in origin and str(REPO_ROOT) not in origin, origin
    modules = [m for extra in extras for m in IMPORTS[extra]]
    run([str(python), "-c", "; ".join(f"import {m}" for m in modules)], cwd=where.parent, env=env)
    return python


@pytest.mark.parametrize(
    ("broker", "extras", "database"),
    [
        pytest.param("redis", ["redis", "prometheus"], "sqlite", id="redis-sqlite"),
        pytest.param(
            "amqp",
            ["postgres", "django", "testing"],
            "postgresql",
            id="amqp-postgresql",
            marks=pytest.mark.postgres,
        ),
    ],
)
def test_the_wheel_with_its_extras_runs_a_leased_task(
    request: pytest.FixtureRequest,
    wheel: Path,
    tmp_path: Path,
    harness: Any,
    queue_name: str,
    broker: str,
    extras: list[str],
    database: str,
) -> None:
    broker_url = str(request.getfixturevalue(f"{broker}_url"))
    settings: dict[str, Any] = {"lease_heartbeat_interval": 0.5, "lease_ttl": 5.0}
    if database == "sqlite":
        settings["lease_database_url"] = f"sqlite:///{tmp_path / 'lease.sqlite3'}"
    else:
        pg_url = str(request.getfixturevalue("pg_url"))
        schema = f"t_{uuid.uuid4().hex[:12]}"
        harness.finalizers.append(lambda: drop_pg_schema(pg_url, schema))
        settings.update(lease_database_url=pg_url, lease_schema=schema, lease_auto_migrate=True)

    python = venv_with(wheel, extras, tmp_path / "venv")
    project = WorkerProject(
        tmp_path / "project",
        broker_url=broker_url,
        queue=queue_name,
        source=SOURCE,
        settings=settings,
        registry=harness.registry,
        python=str(python),
    )
    worker = project.worker("installed")
    worker.wait_ready(timeout=90)
    assert "ModuleNotFoundError" not in worker.log_text()

    # a producer in the same virtualenv, as the user's application would be
    env = project.process_env()
    submitted = run(
        [str(python), "-c", f"import {project.module} as p; print(p.greet.delay('you').id)"],
        cwd=project.directory,
        env=env,
    )
    task_id = submitted.strip().splitlines()[-1]

    config = LeaseConfig(
        database_url=settings["lease_database_url"], schema=settings.get("lease_schema")
    )
    store = harness.track(Store(config))

    def succeeded() -> bool:
        record = store.get(task_id)
        return record is not None and record.state is State.SUCCEEDED

    wait_until(succeeded, timeout=60, message=f"task {task_id} SUCCEEDED")
    record = store.get(task_id)
    assert record is not None and record.result == "hello you"
    # the CLI entry point the wheel registers (celery.commands)
    shown = run(
        [str(python), "-m", "celery", "-A", project.module, "lease", "show", task_id],
        cwd=project.directory,
        env=env,
    )
    assert "SUCCEEDED" in shown
    worker.stop()
