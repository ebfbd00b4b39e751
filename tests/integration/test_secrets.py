"""No database secret is ever shown: real workers and the real CLI against PostgreSQL,
with a password in the netloc, a ``password=`` and an ``sslpassword=`` query parameter
(all valid for libpq, passed on by SQLAlchemy).

Before, only the netloc password was hidden: a query-parameter password was printed in
the worker's start-up line and in every CLI or worker error naming the store.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from celery_lease import ConfigurationError, State, StoreError
from celery_lease.config import LeaseConfig
from celery_lease.store import Store
from celery_lease.store._db import safe_url

from ..helpers import WorkerProject, wait_until

pytestmark = pytest.mark.postgres

SECRETS = ("NetlocPw-4417", "QueryPw-8823", "SslKeyPw-1290")

SOURCE = """
from celery_lease import LeasedTask


@app.task(base=LeasedTask, name="s.add")
def add(x, y):
    return x + y
"""


def secret_url(pg_url: str, database: str | None = None) -> str:
    """``pg_url`` with every secret (PostgreSQL trusts this test's connections, so the
    passwords are carried everywhere but checked nowhere)."""
    url = make_url(pg_url).set(password=SECRETS[0], drivername="postgresql+psycopg")
    if database is not None:
        url = url.set(database=database)
    text = url.render_as_string(hide_password=False)
    return f"{text}?password={SECRETS[1]}&sslpassword={SECRETS[2]}&application_name=lease"


def assert_no_secret(*texts: str) -> None:
    for text in texts:
        for secret in SECRETS:
            assert secret not in text, f"{secret} shown in:\n{text}"


def cli(project: WorkerProject, *args: str) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "celery", "-A", project.module, "lease", *args],
        cwd=project.directory,
        env=project.process_env(),
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture
def secret_project(
    celery_project: Callable[..., WorkerProject],
    pg_url: str,
    store_schema: str,
    redis_url: str,
) -> Callable[..., WorkerProject]:
    def make(url: str, **settings: Any) -> WorkerProject:
        return celery_project(
            SOURCE,
            broker_url=redis_url,
            settings={
                "lease_database_url": url,
                "lease_schema": store_schema,
                "lease_heartbeat_interval": 0.2,
                "lease_reaper_interval": 0.2,
                "lease_ttl": 2.0,
                **settings,
            },
        )

    return make


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
@pytest.mark.slow
def test_no_secret_in_worker_and_cli_output(
    secret_project: Callable[..., WorkerProject],
    pg_url: str,
    store_schema: str,
    harness: Any,
) -> None:
    url = secret_url(pg_url)
    shown = safe_url(url)
    assert_no_secret(shown)
    assert "password=***" in shown and "sslpassword=***" in shown and ":***@" in shown
    assert "application_name=lease" in shown  # what is not secret stays visible

    project = secret_project(url)
    # a worker refused at start-up (no tables yet: SchemaOutOfDate names the store)
    refused = project.worker("refused")
    wait_until(lambda: refused.returncode is not None, timeout=60, message="worker exits")
    assert refused.returncode == 78
    assert "lease migrate" in refused.log_text()
    assert_no_secret(refused.log_text())

    code, out = cli(project, "migrate")
    assert code == 0, out
    assert shown in out
    assert_no_secret(out)

    worker = project.worker()
    store = harness.track(
        Store(LeaseConfig(database_url=url, schema=store_schema, ttl=2.0, heartbeat_interval=0.2))
    )
    worker.wait_ready(timeout=60, store=store)
    started = worker.wait_log(r"celery-lease: worker \S+ incarnation \S+ \(store .*\)").group(0)
    assert shown in started

    task_id = str(project.load().app.tasks["s.add"].delay(2, 3).id)
    wait_until(
        lambda: (r := store.get(task_id)) is not None and r.state is State.SUCCEEDED,
        timeout=60,
        message="task SUCCEEDED",
    )
    for args in (("list",), ("show", task_id), ("check", "--no-liveness"), ("workers",)):
        code, out = cli(project, *args)
        assert code == 0, out
        assert_no_secret(out)
    worker.stop()
    assert_no_secret(worker.log_text())

    # errors that name the store: a database that does not exist
    missing = secret_project(secret_url(pg_url, database="celery_lease_no_such_db"))
    code, out = cli(missing, "list")
    assert code == 3, out
    assert "does not exist" in out and "password=***" in out
    assert_no_secret(out)
    lost = missing.worker("lost")
    wait_until(lambda: lost.returncode is not None, timeout=60, message="worker exits")
    assert "does not exist" in lost.log_text()
    assert_no_secret(lost.log_text())

    # a URL that does not parse (a port that is no number): the parse error quotes it
    bad = url.replace("@127.0.0.1", "@127.0.0.1:port", 1)
    code, out = cli(secret_project(bad), "list")
    assert code == 2, out
    assert "not a valid URL" in out
    assert_no_secret(out)


def test_store_errors_and_configuration_errors_mask_secrets(pg_url: str) -> None:
    with pytest.raises(StoreError) as caught:
        Store(LeaseConfig(database_url=secret_url(pg_url, "celery_lease_no_such_db"))).migrate()
    assert "password=***" in str(caught.value)
    assert_no_secret(str(caught.value))
    with pytest.raises(ConfigurationError) as config_error:
        Store(LeaseConfig(database_url=f"postgresql://u:{SECRETS[0]}@h:x/d?password={SECRETS[1]}"))
    assert config_error.value.__cause__ is None and config_error.value.__suppress_context__
    assert_no_secret(str(config_error.value))
    # a connection string nested in the database name (libpq expands it)
    nested = f"postgresql://h/app?dbname=host%3Ddb%20password%3D{SECRETS[1]}"
    assert_no_secret(safe_url(nested))
    inner = f"postgresql://h/app?dbname=postgresql://u:{SECRETS[0]}@db/app"
    assert_no_secret(safe_url(inner))
