"""The plugin as a user meets it: a project of their own, configured by ini, run by pytest.

Each test writes a small project into ``tmp_path`` and runs pytest on it in a
subprocess (the plugin is found through its ``pytest11`` entry point).
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import celery_lease.testing.plugin as plugin
from celery_lease.testing import pid_alive

from .. import conftest

APP = """
from celery import Celery

from celery_lease import LeasedTask

app = Celery("shop", broker="redis://127.0.0.1:1/0")  # replaced by the test's broker
app.conf.lease_database_url = "sqlite:////nonexistent/shop.sqlite3"


@app.task(base=LeasedTask, bind=True, name="shop.add")
def add(self, a, b):
    return self.step("add", lambda: a + b, idempotent=True)
"""

TESTS = """
import os

from celery_lease import State
from shop import add, app

ORIGINAL = app.conf.lease_database_url


def test_runs(lease_worker):
    with open(os.environ["GROUP_FILE"], "w") as fh:
        fh.write(" ".join(map(str, lease_worker.group())))
    assert lease_worker.wait_state(add.delay(2, 3), State.SUCCEEDED).result == 5


def test_fails_and_shows_the_log(lease_worker):
    lease_worker.wait_state(add.delay(1, 1), State.SUCCEEDED)
    assert False, "on purpose"


def test_the_apps_settings_are_given_back():
    assert app.conf.lease_database_url == ORIGINAL
    assert app.conf.task_default_queue == "celery"
"""


def plugin_args() -> list[str]:
    """``-p`` the kit's plugin for an installation older than its entry point."""
    return ["-p", conftest.KIT_PLUGIN] if hasattr(conftest, "pytest_plugins") else []


def run_pytest(project: Path, redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["CELERY_LEASE_TESTING_BROKER_URL"] = redis_url
    env["GROUP_FILE"] = str(project / "group.txt")
    return subprocess.run(
        [sys.executable, "-m", "pytest", *plugin_args(), "-p", "no:cacheprovider", "-q", *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )


def make_project(tmp_path: Path, ini: str) -> Path:
    project = tmp_path / "shop-project"
    project.mkdir()
    (project / "shop.py").write_text(APP)
    (project / "test_shop.py").write_text(TESTS)
    (project / "pytest.ini").write_text(textwrap.dedent(ini))
    return project


def test_ini_names_the_app_failures_show_the_log_and_teardown_kills_everything(
    tmp_path: Path, redis_url: str
):
    project = make_project(tmp_path, "[pytest]\nlease_app = shop:app\n")
    proc = run_pytest(project, redis_url)
    out = proc.stdout + proc.stderr

    assert "1 failed, 2 passed" in out, out
    assert "FAILED test_shop.py::test_fails_and_shows_the_log" in out, out
    assert "celery-lease worker logs (tail)" in out and re.search(
        r"w1@lease-test-\w+ ready\.", out
    ), out
    pids = [int(p) for p in (project / "group.txt").read_text().split()]
    assert len(pids) == 3  # the main process, its one pool process and its lease agent
    assert not [p for p in pids if pid_alive(p)]


def test_without_an_app_the_error_says_how_to_name_one(tmp_path: Path, redis_url: str):
    project = make_project(tmp_path, "[pytest]\n")
    proc = run_pytest(project, redis_url, "-k", "test_runs")

    assert proc.returncode != 0
    assert "say which Celery app to test: `lease_app = proj.celery:app`" in proc.stdout


def test_every_fixture_of_the_plugin_is_named_lease_something():
    # pytest-celery (celery_worker, celery_setup, ...) and celery.contrib.pytest
    # (celery_app, celery_worker, ...) name theirs celery_*: nothing can shadow
    names = [
        name
        for name, value in inspect.getmembers(plugin)
        if hasattr(value, "_fixture_function_marker")
        or type(value).__name__ == "FixtureFunctionDefinition"
    ]
    assert names and all(n.startswith("lease_") for n in names), names


def test_the_plugin_sits_beside_celery_contrib_pytest(tmp_path: Path, redis_url: str):
    project = make_project(tmp_path, "[pytest]\nlease_app = shop:app\n")
    proc = run_pytest(project, redis_url, "-p", "celery.contrib.pytest", "--fixtures")

    assert proc.returncode == 0, proc.stdout + proc.stderr
    for fixture in ("celery_worker", "celery_app", "lease_worker", "lease_store", "lease_effects"):
        assert f"\n{fixture}" in proc.stdout, fixture


@pytest.mark.parametrize("value", ["mysql://x/y"])
def test_an_unknown_database_is_refused(tmp_path: Path, redis_url: str, value: str):
    project = make_project(tmp_path, f"[pytest]\nlease_app = shop:app\nlease_database = {value}\n")
    proc = run_pytest(project, redis_url, "-k", "test_runs")

    assert proc.returncode != 0
    assert "lease_database must be 'sqlite' or a PostgreSQL URL" in proc.stdout


def test_a_kit_test_leaves_the_redis_broker_as_it_found_it(tmp_path: Path, redis_url: str):
    import redis

    client = redis.Redis.from_url(redis_url)
    # the application's own: a binding of another worker's control queue, another key
    theirs = b"\x06\x16\x06\x16other@elsewhere.celery.pidbox"
    client.sadd("_kombu.binding.celery.pidbox", theirs)
    client.set("untouched", "1")

    def snapshot() -> dict[bytes, Any]:
        out: dict[bytes, Any] = {}
        for key in client.keys("*"):
            kind = client.type(key)
            out[key] = client.smembers(key) if kind == b"set" else client.dump(key)
        return out

    before = snapshot()
    project = make_project(tmp_path, "[pytest]\nlease_app = shop:app\n")
    try:
        proc = run_pytest(project, redis_url, "-k", "test_runs")
        assert "1 passed" in proc.stdout, proc.stdout + proc.stderr
        assert snapshot() == before
    finally:
        client.close()
