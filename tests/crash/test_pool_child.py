"""Crash-point matrix rows 3 and 16: a pool child dies while it runs a task.

The worker's main process sees the child die (WorkerLostError) and expires the lease at
once, without waiting for the TTL: the tasks here have ``lease_ttl=60``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

import pytest

from celery_lease import State
from celery_lease.store import Store

from ..helpers import ExternalSystem, WorkerProcess
from .support import RECOVERED, TASKS, LeasedProject, LeaseEnv, Stopwatch, released, report


@contextlib.contextmanager
def child_killed(
    p: LeasedProject, worker: WorkerProcess, ext: ExternalSystem
) -> Iterator[tuple[str, Stopwatch]]:
    """Submit ``t.long_lease`` (``lease_ttl=60``: only a fast path recovers it), SIGKILL
    the pool child running it at its gate, release the gate; yields the task id and a
    stopwatch started at the kill."""
    gate = p.gates.hold("gate")
    with released(p.gates, gate):
        task_id = p.submit("t.long_lease", "k", gate)
        p.wait_count("start:k", 1)
        p.wait_state(task_id, State.RUNNING)  # the kill hits a claimed, running task
        (first,) = ext.effects("start:k")
        assert first.pid in worker.children()
        os.kill(first.pid, signal.SIGKILL)
        clock = Stopwatch()
        p.gates.release(gate)
        yield task_id, clock


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [
        pytest.param("redis", "postgresql", id="redis-postgresql", marks=pytest.mark.postgres),
        pytest.param("amqp", "sqlite", id="amqp-sqlite"),
    ],
    indirect=True,
)
def test_sigkill_of_a_pool_child_expires_at_once_and_reruns_once(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = lease_env.project(broker_url=broker_url)
    worker = p.worker(concurrency=1)
    main_pid = worker.pid
    ext = lease_env.external
    with child_killed(p, worker, ext) as (task_id, clock):
        # Celery notices a dead child at once or at its next pool check (up to 5 s)
        worker.wait_log(r"exited with 'signal 9 \(SIGKILL\)'", timeout=20)
        noticed = clock.lap()
        p.wait_count("start:k", 2, timeout=15)
        rerun = clock.lap()
        report("SIGKILLed pool child -> Celery noticed (WorkerLostError)", noticed)
        report("SIGKILLed pool child -> re-run started", rerun)
        report("  of which celery-lease (noticed -> re-run started)", rerun - noticed)

    rec = p.wait_state(task_id, State.SUCCEEDED)
    report("SIGKILLed pool child -> SUCCEEDED", clock.lap())
    assert ext.count("done:k") == 1 and ext.count("start:k") == 2
    assert rec.attempt == 2 and rec.recoveries == 1 and rec.retries == 0
    assert rec.owner == p.incarnation(worker) and worker.pid == main_pid
    assert p.trail(task_id) == RECOVERED
    timeout = p.store.history(task_id)[2]
    assert timeout.actor == "worker:w1@lease-test" and timeout.attempt == 1
    assert timeout.reason is not None and "pool child lost" in timeout.reason


@pytest.mark.parametrize(
    "backend", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True
)
def test_task_killing_its_child_every_time_goes_to_wait_manual(lease_env: LeaseEnv) -> None:
    p = lease_env.project()  # redis
    p.worker(concurrency=1)
    task_id = p.submit("t.poison", "k")  # os._exit(1) in the body; max_recoveries=2

    rec = p.wait_state(task_id, State.WAIT_MANUAL, timeout=30)
    assert rec.recoveries == 3 and rec.attempt == 3
    assert rec.reason is not None
    assert "poison task: lease expired 3 times, more than max_recoveries (2) allows" in rec.reason
    trail = p.trail(task_id)
    assert trail.count(("RUNNING", "TIMEOUT")) == 3
    assert trail[-2:] == [("RUNNING", "TIMEOUT"), ("TIMEOUT", "WAIT_MANUAL")]

    # never around the loop again: the worker keeps serving, the poison stays parked
    p.drain()
    assert lease_env.external.count("start:k") == 3
    assert p.get(task_id).state is State.WAIT_MANUAL


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork() with threads (3.12+)
@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_sqlite_store_works_in_a_child_forked_during_a_transaction(
    make_store: Callable[..., Store],
) -> None:
    """What a prefork worker does when a child dies: the main process's fast path writes
    (this thread's transaction) while billiard forks the replacement child (os.fork)."""
    store = make_store(tuning={"sqlite_busy_timeout": 1.0, "db_retries": 0})
    store.try_lock("warm-up", "parent", 5)  # the parent has pooled connections, like a worker
    entered, release = threading.Event(), threading.Event()

    def transaction(conn: object, is_retry: bool) -> None:
        entered.set()
        release.wait(10)

    thread = threading.Thread(target=store._tx, args=(transaction,))
    thread.start()
    assert entered.wait(10)
    threading.Timer(0.3, release.set).start()  # the parent commits soon after the fork
    pid = os.fork()
    if pid == 0:  # the child: one write, as a claim would do
        code = 1
        try:
            store.try_lock("child", "child", 5)
            code = 0
        finally:
            os._exit(code)
    thread.join(10)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child could not write (database is locked)"


#: The worker's pool never reports a child lost while it runs a task (billiard's
#: ``on_job_process_lost`` does nothing): the fault the service's backstop is for.
SILENT_POOL = (
    TASKS
    + """

from celery.concurrency import asynpool

asynpool.AsynPool.on_job_process_lost = lambda self, job, pid, exitcode: None
"""
)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_a_child_loss_the_pool_never_reports_is_recovered_by_the_backstop(
    lease_env: LeaseEnv,
) -> None:
    """A pool child SIGKILLed while the pool never reports it: without a backstop the
    row would stay RUNNING under the live heartbeat for ever (no TTL expires it). The
    worker's service sees the accepted task's child gone and hands it to the lease."""
    p = lease_env.project(source=SILENT_POOL)
    worker = p.worker(concurrency=1)
    ext = lease_env.external
    with child_killed(p, worker, ext) as (task_id, clock):
        rec = p.wait_state(task_id, State.SUCCEEDED, timeout=40)
        report("unreported pool child loss -> SUCCEEDED", clock.lap())

    assert ext.count("start:k") == 2 and ext.count("done:k") == 1
    assert rec.attempt == 2 and rec.recoveries == 1
    assert p.trail(task_id) == RECOVERED
    timeout = p.store.history(task_id)[2]
    assert timeout.attempt == 1 and timeout.reason is not None
    assert "not reported by the pool" in timeout.reason, timeout.reason
    worker.wait_log(r"did not report it; the lease decides now", timeout=5)
