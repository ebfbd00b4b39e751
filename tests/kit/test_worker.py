"""``lease_worker`` and its levers, on a real app module (:mod:`tests.kit.kitapp`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from celery_lease import State
from celery_lease.testing import (
    LeaseWorker,
    SideEffects,
    assert_check_clean,
    assert_finished,
    pid_alive,
    pid_state,
    wait_until,
)

from .kitapp import app, pay


def gate(tmp_path: Path, name: str = "gate") -> str:
    path = tmp_path / name
    path.touch()
    return str(path)


def test_a_worker_of_the_users_app_runs_on_the_tests_own_store(
    lease_worker: LeaseWorker, lease_effects: SideEffects, tmp_path: Path
):
    result = pay.delay(1)

    record = lease_worker.wait_state(result, State.SUCCEEDED)
    assert record.result == {"order": 1} and record.attempt == 1
    assert_finished(lease_worker.store, result, steps=["reserve", "charge"], attempts=1)
    # the app's own store and queue (which point nowhere) were replaced for this test
    assert str(tmp_path) in lease_worker.store.config.database_url
    assert app.conf.task_default_queue.startswith("lease-test-")
    assert lease_effects.counts() == {"attempt": 1, "reserve": 1, "charge": 1}
    assert lease_worker.pool == "prefork" and len(lease_worker.children()) == 1


def test_kill_task_kills_the_pool_process_running_it_and_the_task_recovers(
    lease_worker: LeaseWorker, lease_effects: SideEffects, tmp_path: Path
):
    result = pay.delay(2, gate(tmp_path))
    # the recorded step, not its effect: the effect comes before the record
    wait_until(
        lambda: any(
            s.name == "reserve" and s.state == "DONE" for s in lease_worker.store.steps(result.id)
        ),
        message="reserved, at the gate",
    )
    main = lease_worker.pid

    pid = lease_worker.kill_task(result)
    assert pid != main and not pid_alive(pid)
    Path(tmp_path / "gate").unlink()

    record = lease_worker.wait_state(result, State.SUCCEEDED)
    assert record.attempt == 2 and record.recoveries == 1
    assert lease_worker.pid == main and lease_worker.is_alive()
    assert lease_effects.counts() == {"attempt": 2, "reserve": 1, "charge": 1}


def test_kill_the_whole_worker_then_restart_it_under_the_same_node_name(
    lease_worker: LeaseWorker, lease_effects: SideEffects, tmp_path: Path
):
    result = pay.delay(3, gate(tmp_path))
    lease_worker.task_pid(result)
    before = lease_worker.incarnation()
    group = lease_worker.group()

    lease_worker.kill()
    assert not lease_worker.is_alive() and not any(pid_alive(p) for p in group)
    assert lease_worker.record(result).state is State.RUNNING  # nobody knows yet
    Path(tmp_path / "gate").unlink()
    lease_worker.restart()

    assert lease_worker.incarnation() != before
    record = lease_worker.wait_state(result, State.SUCCEEDED)
    assert record.attempt == 2
    trail = lease_worker.store.history(result.id)
    assert any(
        lease_worker.nodename in (row.reason or "")
        for row in trail
        if row.to_state is State.TIMEOUT
    )
    assert lease_effects.count("charge") == 1
    assert_check_clean(lease_worker.store)


@pytest.mark.postgres
def test_freeze_stops_every_process_and_thaw_resumes(
    lease_worker: LeaseWorker, lease_effects: SideEffects
):
    # PostgreSQL: SIGSTOP may catch the worker inside a store transaction (a heartbeat,
    # a sweep). On SQLite that transaction holds the database file's write lock, and
    # the submission below would wait for it until lease_db_timeout; on PostgreSQL it
    # holds only the worker's own rows.
    lease_worker.freeze()
    assert {pid_state(p) for p in lease_worker.group()} == {"T"}
    result = pay.delay(4)
    lease_worker.thaw()

    lease_worker.wait_state(result, State.SUCCEEDED)
    assert lease_effects.count("charge") == 1


def test_wait_state_says_where_the_task_is_when_it_times_out(lease_worker: LeaseWorker, tmp_path):
    result = pay.delay(5, gate(tmp_path))
    with pytest.raises(AssertionError, match=r"never reached SUCCEEDED .* state=<State.RUNNING"):
        lease_worker.wait_state(result, State.SUCCEEDED, timeout=1.5)
    Path(tmp_path / "gate").unlink()


@pytest.mark.lease_worker(pool="threads", concurrency=2)
def test_pool_and_concurrency_are_chosen_with_a_marker(lease_worker: LeaseWorker):
    assert lease_worker.pool == "threads" and lease_worker.concurrency == 2
    assert lease_worker.children() == []  # threads: no pool processes
    lease_worker.wait_state(pay.delay(6), State.SUCCEEDED)


@pytest.mark.postgres
def test_on_postgresql_each_test_has_a_schema_of_its_own(lease_worker: LeaseWorker):
    config = lease_worker.store.config
    assert config.database_url.startswith("postgresql") and config.schema
    assert config.schema.startswith("lease_test_")
    result = pay.delay(7)
    lease_worker.wait_state(result, State.SUCCEEDED)
    assert_finished(lease_worker.store, result, steps=["reserve", "charge"])
