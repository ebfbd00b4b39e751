"""Every duration is finite and in its documented range, checked where it is given; a
row whose stored duration is out of range (written by an older version) stops no sweep.

- A worker whose app has a leased task with an invalid option exits at start-up with
  78 (EX_CONFIG), naming the task and the option: it never runs with an invalid TTL as
  its self-fence limit (before: it fenced itself every TTL, and the valid tasks on it
  with it).
- On PostgreSQL a row with ``lease_ttl = 1e300`` made every sweep fail with ``interval
  out of range``: ``lease reap`` exited 3 and no other lease was recovered.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from celery_lease import ConfigurationError, LeasedTask, State
from celery_lease.check import check
from celery_lease.config import MAX_SECONDS, from_mapping

from ..crash.support import TASKS, pg_only
from ..helpers import wait_until
from .test_cli import run
from .test_cli_support import Ops, ops_fixture  # noqa: F401  (the ops fixture)

sqlite_only = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)


@sqlite_only
@pytest.mark.parametrize(
    ("option", "needle"),
    [
        ("lease_ttl=0.2", "task t.bad: lease_ttl (0.2) must be longer than"),
        ("max_runtime=float('inf')", "task t.bad: max_runtime must be a number of seconds"),
        ("global_rate_limit='5/d'", "task t.bad: global_rate_limit must be a positive number"),
        ("concurrency_limit=0", "task t.bad: concurrency_limit must be a positive whole number"),
        ("unique_for=-5", "task t.bad: unique_for"),
    ],
)
def test_a_worker_with_an_invalid_task_option_exits_78_naming_it(
    lease_env: Any, redis_url: str, option: str, needle: str
) -> None:
    # the tests' heartbeat interval is 0.2 s: lease_ttl=0.2 is no longer than it
    source = TASKS + (
        f'\n\n@app.task(base=LeasedTask, shared=False, name="t.bad", {option})\n'
        "def bad():\n    return 1\n"
    )
    p = lease_env.project(broker_url=redis_url, source=source)
    worker = p.worker(ready=False)
    assert worker.proc is not None
    worker.proc.wait(60)
    log = worker.log_text(since_start=True)
    assert worker.returncode == 78, log[-3000:]
    assert needle in log, log[-3000:]
    assert "heartbeat not renewed" not in log


@pytest.mark.parametrize(
    "value", [math.inf, -math.inf, math.nan, 1e300, -1.0, 0.0, MAX_SECONDS * 2, "abc", True]
)
def test_a_task_option_out_of_range_is_refused_naming_task_and_option(value: Any) -> None:
    from celery import Celery

    app = Celery("durations", set_as_current=False)
    app.conf.lease_database_url = "sqlite:///unused.sqlite3"

    @app.task(base=LeasedTask, shared=False, name="d.ttl", lease_ttl=value)
    def ttl() -> None: ...

    @app.task(base=LeasedTask, shared=False, name="d.runtime", max_runtime=value)
    def runtime_() -> None: ...

    config = from_mapping(app.conf)
    for task, option in ((ttl, "lease_ttl"), (runtime_, "max_runtime")):
        with pytest.raises(ConfigurationError, match=rf"task d\.\w+: {option}"):
            task.lease_options(config)


@pytest.mark.parametrize(
    "key",
    [
        "lease_ttl",
        "lease_retention",
        "lease_republish_after",
        "lease_publish_grace",
        "lease_db_timeout",
        "lease_reaper_interval",
        "lease_max_runtime",
    ],
)
@pytest.mark.parametrize("value", [math.inf, math.nan, 1e300, -5, "abc"])
def test_a_setting_out_of_range_is_refused_naming_it(key: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=key):
        from_mapping({key: value})


@pg_only()
@pytest.mark.violations  # the out-of-range row is what lease check must report
def test_a_row_with_a_huge_stored_ttl_stops_no_sweep(ops: Ops) -> None:
    # written as an older version (or a hand edit) would: the store takes it unchecked
    huge = ops.running(lease_ttl=1e300)
    lost = ops.running()  # TTL 1 s; its owner never renews again
    wait_until(lambda: ops.store.expired_unreaped() >= 1, timeout=30, message="expired")

    result = run(ops, "reap")

    assert result.exit_code == 0, result.output
    assert "out_of_range=1" in result.output
    assert ops.store.get(lost).state in (State.RETRY_WAIT, State.PENDING)
    assert ops.store.get(huge).state is State.RUNNING
    found = [v for v in check(ops.store, liveness=False) if v.kind == "duration_out_of_range"]
    assert [v.task_id for v in found] == [huge], found
    assert "lease_ttl" in found[0].detail
