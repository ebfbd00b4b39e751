"""Self-checks of the shared harness with plain Celery tasks (no lease code involved).

The crash suite relies on these behaviours: a generated project runs in a real worker,
signals reach the processes they should, teardown leaves nothing behind, and the
external stub counts effects across processes.
"""

from __future__ import annotations

import multiprocessing
import signal
import uuid

import pytest

from celery_lease.store import Store

from ..helpers import (
    ExternalSystem,
    call_external_in_process,
    group_pids,
    pid_alive,
    pid_state,
    wait_until,
)

PING = """
from tests.helpers import ExternalSystem

external = ExternalSystem.from_env()

@app.task(name="ping")
def ping(key=None):
    return external.call("ping", key)

@app.task(name="conf")
def conf(name):
    return external.call("conf", payload=repr(app.conf.get(name)))
"""


def test_worker_runs_a_generated_task(broker_url, celery_project, external):
    project = celery_project(PING, broker_url=broker_url)
    worker = project.worker(pool="prefork", concurrency=2).wait_ready()
    assert len(worker.wait_children(2)) == 2

    producer = project.producer()
    for _ in range(3):
        producer.send_task("ping")
    wait_until(lambda: external.count("ping") == 3, message="three pings")

    assert worker.stop() == 0  # warm shutdown exits cleanly
    assert worker.group() == []


def test_settings_reach_the_worker_from_literals_and_env(celery_project, external):
    project = celery_project(
        PING,
        settings={"lease_ttl": 2.5, "lease_max_age": None},
        env={"TEST_CONF_LEASE_REPUBLISH_AFTER": "7.5"},
    )
    project.worker(pool="solo").wait_ready()
    producer = project.producer()
    producer.send_task("conf", args=["lease_ttl"])
    producer.send_task("conf", args=["lease_republish_after"])
    wait_until(lambda: external.count("conf") == 2, message="both settings reported")
    assert sorted(e.payload for e in external.effects("conf")) == ["'7.5'", "2.5"]


def test_project_module_can_be_loaded_in_the_test_process(celery_project):
    project = celery_project(PING)
    module = project.load()
    assert module.app.conf.task_default_queue == project.queue
    assert "ping" in module.app.tasks


def test_projects_loaded_one_after_another_do_not_share_tasks(celery_project, harness):
    import celery

    before = celery.current_app._get_current_object()
    first = celery_project(PING).load()
    second = celery_project(PING).load()  # same task names, another app: no warning
    assert first.app.tasks["ping"] is not second.app.tasks["ping"]
    assert "ping" not in celery.Celery("bystander", set_as_current=False).tasks
    harness.registry.close()  # what teardown does
    assert celery.current_app._get_current_object() is before


def test_settings_must_be_literals(celery_project):
    with pytest.raises(TypeError, match="not a Python literal"):
        celery_project(PING, settings={"lease_ttl": object()})


def test_kill_group_takes_down_main_process_and_pool_children(celery_project):
    worker = celery_project(PING).worker(concurrency=2).wait_ready()
    children = worker.wait_children(2)
    everyone = [worker.pid, *children]
    assert set(worker.group()) >= set(everyone)

    worker.kill_group(signal.SIGKILL)
    worker.wait_group_gone()
    assert not any(pid_alive(p) for p in everyone)
    assert worker.returncode == -signal.SIGKILL


def test_killing_one_pool_child_leaves_the_worker_running(celery_project, external):
    project = celery_project(PING)
    worker = project.worker(concurrency=1).wait_ready()
    (child,) = worker.wait_children(1)

    worker_pid = worker.pid
    import os

    os.kill(child, signal.SIGKILL)
    replacement = wait_until(
        lambda: [p for p in worker.children() if p != child],
        message="prefork replaced the killed child",
    )
    assert worker.is_alive() and worker.pid == worker_pid
    assert replacement and not pid_alive(child)

    project.producer().send_task("ping")
    wait_until(lambda: external.count("ping") == 1, message="the new child runs tasks")


def test_sigstop_freezes_the_whole_group_and_sigcont_resumes(celery_project, external):
    project = celery_project(PING)
    worker = project.worker(concurrency=1).wait_ready()
    pids = [worker.pid, *worker.wait_children(1)]

    worker.kill_group(signal.SIGSTOP)
    wait_until(lambda: all(pid_state(p) == "T" for p in pids), message="all stopped")
    worker.kill_group(signal.SIGCONT)
    wait_until(lambda: all(pid_state(p) != "T" for p in pids), message="all resumed")

    project.producer().send_task("ping")
    wait_until(lambda: external.count("ping") == 1, message="resumed worker runs tasks")


def test_restart_keeps_node_name_and_waits_for_the_new_ready_line(celery_project, external):
    project = celery_project(PING)
    worker = project.worker(name="node", pool="solo").wait_ready()
    first_pid = worker.pid
    worker.kill(signal.SIGKILL)

    worker.restart().wait_ready()
    assert worker.pid != first_pid
    assert worker.nodename == "node@lease-test"
    assert worker.log_text().count(" ready.") == 2
    project.producer().send_task("ping")
    wait_until(lambda: external.count("ping") == 1, message="restarted worker runs tasks")


def test_wait_ready_with_store_needs_this_workers_incarnation_row(
    celery_project, make_store, backend
):
    store: Store = make_store()
    worker = celery_project(PING).worker(name="plain", pool="solo").wait_ready()

    # a plain Celery worker writes no incarnation row: readiness by row must not pass
    with pytest.raises(AssertionError, match="no live row"):
        worker.wait_ready(timeout=0.5, store=store)
    # a row for another pid of the same node name does not count either
    store.register_worker(uuid.uuid4().hex, worker.nodename, "host", pid=1)
    with pytest.raises(AssertionError, match="no live row"):
        worker.wait_ready(timeout=0.5, store=store)

    assert worker.pid is not None
    store.register_worker(uuid.uuid4().hex, worker.nodename, "host", worker.pid)
    worker.wait_ready(timeout=5, store=store)


def test_wait_ready_fails_fast_when_the_worker_cannot_start(celery_project):
    worker = celery_project("raise RuntimeError('broken project')").worker(pool="solo", start=True)
    with pytest.raises(AssertionError, match="broken project"):
        worker.wait_ready(timeout=30)


def test_teardown_kills_stopped_workers(celery_project, harness):
    worker = celery_project(PING).worker(concurrency=1).wait_ready()
    pids = [worker.pid, *worker.wait_children(1)]
    worker.kill_group(signal.SIGSTOP)
    harness.registry.close()  # what teardown does
    assert group_pids(pids[0]) == []
    assert not any(pid_alive(p) for p in pids)


# -- the external stub --------------------------------------------------------------------


def test_external_counts_effects_and_honours_idempotency_keys(tmp_path):
    ext = ExternalSystem(tmp_path / "ext.sqlite3")
    first = ext.call("charge", key="order-1")
    assert ext.call("charge", key="order-1") == first  # replayed, not repeated
    other = ext.call("charge", key="order-2")
    ext.call("charge")
    ext.call("charge")
    ext.call("mail", key="order-1")  # keys are per operation name

    assert other != first
    assert ext.count("charge") == 4
    assert ext.calls("charge") == 5
    assert ext.count("mail") == 1
    assert ext.count() == 5
    assert [e.key for e in ext.effects("charge")] == ["order-1", "order-2", None, None]


def test_external_counts_across_processes(tmp_path):
    path = str(tmp_path / "ext.sqlite3")
    ExternalSystem(path)
    ctx = multiprocessing.get_context("spawn")
    n = 4
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [
        ctx.Process(target=call_external_in_process, args=(path, "pay", key, barrier, results))
        for key in ["same", "same", "same", None]
    ]
    for p in procs:
        p.start()
    ids = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    results.close()
    results.join_thread()

    ext = ExternalSystem(path)
    assert ext.calls("pay") == 4
    assert ext.count("pay") == 2  # one keyed effect, one unkeyed
    keyed = next(e.id for e in ext.effects("pay") if e.key == "same")
    assert sorted(ids).count(keyed) == 3
