"""Crash matrix rows 12, 13 and 14: the broker, the database or the reaper is lost.

Real services are stopped, restarted or cut off (see :mod:`tests.crash.faults`); a test
that restarts a shared service takes ``exclusive_services`` and leaves it running.

* Row 12, Redis restarted with its data lost (``SHUTDOWN NOSAVE``) while one task runs
  and four are queued: the running task finishes; the rows whose messages were lost
  are PENDING and published, and the embedded reaper publishes them again once
  ``lease_republish_after`` (1 s here) has passed; each runs once. SQLite and
  PostgreSQL.
* Row 12, RabbitMQ restarted (``stop_app``/``start_app``) while one task runs and three
  are queued: the worker reconnects (same process) and everything runs once; copies
  published again by the reaper while the broker was away are dropped at claim.
* Row 13 (PostgreSQL store), the database restarted, or every connection to it killed
  with ``pg_terminate_backend``, while two tasks run and three are queued: the worker
  keeps its leases (the TTL, 10 s here, is longer than the outage; what happens past
  the TTL is the next test), its heartbeat resumes, its processes reconnect, every task
  runs once with the audit trail of a run without a fault.
* Row 13, the database unreachable for one worker only, for longer than the TTL (2 s
  here; the worker's store URL goes through a TCP proxy the test cuts, while the test
  and a second worker connect directly): the worker self-fences; the second
  worker's reaper expires its leases and the second worker runs the tasks again; the
  fenced attempts stop at their step boundary (the effect is counted once, the outcome
  written once); once the proxy is restored the worker's heartbeat resumes and it runs
  tasks again.
* Row 13, the same cut with no other worker: the cut-off worker keeps taking messages
  (early acks, the default) and fails to claim them; none is lost: once the proxy is
  restored it expires its own leases and publishes those deliveries again; the tasks
  that were running run again once, the queued ones once; each effect happens once.
* Row 13, the worker fenced while the database answers every statement but its
  heartbeat (a trigger refuses updates of the workers table): it claims nothing while
  fenced, it publishes the deliveries again; once heartbeats pass, each task runs once.
  (Before the fix in ``LeasedTask.__call__`` each delivery was claimed, lost at once at
  the first boundary, retried, six times over, and ended WAIT_MANUAL as a poison task
  that never ran; with an outage the same happened once, now and then, at recovery.)
* Row 14, a ``celery lease reap`` process dies between two batches of one sweep
  (crash point ``reaper_mid_sweep``) with five expired leases: the first batch stays
  expired, the next sweep expires the rest and publishes all five, each runs again
  once, and each transition is in each audit trail once. SQLite and PostgreSQL.

Every test asserts the final state and audit trail of every task, the exact number of
attempts (``start:<key>``) and effects (``done:<key>``) the counting stub saw, and that
the invariant checker finds nothing. Measured figures are printed, never asserted.
"""

from __future__ import annotations

import collections
import re
import signal
from datetime import datetime

import pytest

from celery_lease import State, admin
from celery_lease.check import check
from celery_lease.config import TUNING_ENV
from celery_lease.exceptions import StoreError

from ..helpers import WorkerProcess, wait_until
from .faults import (
    assert_crashed,
    exclusive_services,  # noqa: F401  (fixture)
    pg_restart,
    pg_terminate,
    proxy_to_postgres,
    rabbitmq_restart_app,
    redis_restart_losing_data,
    restarts_redis_of,
    run_reaper,
)
from .support import (
    CLEAN_RUN,
    GIVEN_BACK,
    RECOVERED,
    LeasedProject,
    LeaseEnv,
    Stopwatch,
    pg_only,
    queue_depth,
    released,
    report,
)

#: Overrides ``lease_database_url`` in one worker (the generated module reads
#: ``TEST_CONF_<KEY>`` after the project's settings).
DATABASE_URL_ENV = "TEST_CONF_LEASE_DATABASE_URL"
#: The TTL of the tests in which no lease may expire (row 12; row 13 while the outage
#: is shorter than the TTL, so that heartbeats resume): far longer than any restart, so
#: neither the outage nor a heartbeat delayed on a loaded machine turns them into a
#: lease-expiry test. Nothing in those tests waits for it.
LONG_TTL = 10.0
#: Row 13 past the TTL: short, since the test waits for it twice (the worker fences
#: itself, the other worker's reaper expires the leases), yet twice the usual 1 s so
#: that a heartbeat delayed by load is not mistaken for the outage.
CUT_TTL = 2.0

exclusive = pytest.mark.usefixtures("exclusive_services")


# -- reading the store -------------------------------------------------------------------


def queued(p: LeasedProject) -> int:
    """Messages waiting in the project's queue."""
    return queue_depth(p.project.broker_url, p.project.queue)


def db_now(p: LeasedProject, timeout: float = 60.0) -> datetime:
    """The database's time, as soon as it answers again."""
    now: datetime = wait_until(
        p.store.now, timeout=timeout, interval=0.2, ignore=(StoreError,), message="database"
    )
    return now


def wait_heartbeat(p: LeasedProject, worker_id: str, since: datetime) -> None:
    """Wait until incarnation ``worker_id`` renewed its heartbeat after ``since`` (DB time)."""

    def renewed() -> bool:
        (row,) = [w for w in p.store.workers() if w.id == worker_id]
        return row.heartbeat_at > since

    wait_until(
        renewed,
        timeout=60,
        interval=0.1,
        ignore=(StoreError,),
        message=f"incarnation {worker_id} renewed its heartbeat",
    )


def assert_clean_runs(
    p: LeasedProject, ids: dict[str, str], worker: WorkerProcess, timeout: float = 60.0
) -> None:
    """Each ``key -> task id`` SUCCEEDED on ``worker``, one run and one effect counted,
    no recovery: the audit trail of a run without a fault, or of one whose claim made
    ahead was given back before any of its code ran (its delivery lost with the broker's
    data: a second attempt, the first one never started)."""
    for key, task_id in ids.items():
        rec = p.wait_state(task_id, State.SUCCEEDED, timeout=timeout)
        trail = p.trail(task_id)
        assert trail in (CLEAN_RUN, GIVEN_BACK), (key, trail)
        assert rec.attempt == (1 if trail == CLEAN_RUN else 2) and rec.recoveries == 0, rec
        assert rec.result == {"key": key, "node": worker.nodename}
        assert p.external.count(f"start:{key}") == 1, key
        assert p.external.count(f"done:{key}") == 1, key


def assert_clean(p: LeasedProject) -> None:
    assert check(p.store, liveness=False) == []


# -- row 12: the broker ------------------------------------------------------------------


@exclusive
@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [
        pytest.param("redis", "sqlite", id="redis-sqlite"),
        pytest.param("redis", "postgresql", id="redis-postgresql", marks=pytest.mark.postgres),
    ],
    indirect=True,
)
def test_row12_redis_restarted_losing_its_queue(lease_env: LeaseEnv, broker_url: str) -> None:
    if not restarts_redis_of(broker_url):
        pytest.skip("the broker is a Redis of this session's own: only the shared one restarts")
    p = lease_env.project(broker_url=broker_url, ttl=LONG_TTL, republish_after=1.0)
    worker = p.worker(concurrency=1)
    keys = [f"q{i}" for i in range(4)]
    gate = p.gates.hold("gate")
    with released(p.gates, gate):
        running = p.submit("t.work", "running", gate)
        p.wait_count("start:running", 1)
        ids = {key: p.submit("t.work", key) for key in keys}
        # the worker holds at most one message besides the running one (prefetch 1)
        lost = queued(p)
        assert lost >= len(keys) - 1, lost
        clock = Stopwatch()
        redis_restart_losing_data()
        report("row 12: Redis SHUTDOWN NOSAVE + start", clock.lap())
        assert p.get(running).state is State.RUNNING
    assert_clean_runs(p, {"running": running, **ids}, worker)
    report(f"row 12: Redis restart -> all {len(ids) + 1} SUCCEEDED", clock.lap())

    # every message Redis held is gone: only the reaper's second publish can have run
    # those rows (its sweeps log how many rows they published again)
    republished = sum(int(n) for n in re.findall(r"'republished': (\d+)", worker.log_text()))
    assert republished >= len(keys) - 1, (republished, lost)
    p.drain()  # copies published twice have been received (and dropped) by now
    for key in ["running", *keys]:
        assert p.external.count(f"start:{key}") == 1, key
    assert worker.is_alive() and worker.starts == 1
    assert_clean(p)


@exclusive
@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [pytest.param("amqp", "postgresql", id="amqp-postgresql", marks=pytest.mark.postgres)],
    indirect=True,
)
def test_row12_rabbitmq_restarted_with_tasks_queued_and_running(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = lease_env.project(broker_url=broker_url, ttl=LONG_TTL, republish_after=1.0)
    worker = p.worker(concurrency=1)
    pid = worker.pid
    keys = [f"q{i}" for i in range(3)]
    gate = p.gates.hold("gate")
    with released(p.gates, gate):
        running = p.submit("t.work", "running", gate)
        p.wait_count("start:running", 1)
        ids = {key: p.submit("t.work", key) for key in keys}
        clock = Stopwatch()
        rabbitmq_restart_app()
        report("row 12: RabbitMQ stop_app + start_app", clock.lap())
        assert p.get(running).state is State.RUNNING
    assert_clean_runs(p, {"running": running, **ids}, worker, timeout=120)
    report(f"row 12: RabbitMQ restart -> all {len(ids) + 1} SUCCEEDED", clock.lap())

    p.drain(timeout=60)  # the reconnected worker still serves the queue
    for key in ["running", *keys]:
        assert p.external.count(f"start:{key}") == 1, key
    # the same process reconnected (celery logs each connection)
    assert worker.pid == pid and worker.is_alive()
    assert len(re.findall(r"Connected to amqp://", worker.log_text())) >= 2
    assert_clean(p)


@exclusive
@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [pytest.param("amqp", "postgresql", id="amqp-postgresql", marks=pytest.mark.postgres)],
    indirect=True,
)
def test_row12_the_first_sweep_after_a_rabbitmq_restart_publishes(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    # The reaper does not retry a publish (its next sweep does), yet the connection a
    # broker restart left in this process's pool fails at once: that failure alone is
    # tried again on a fresh connection, so the sweep publishes what is due.
    p = lease_env.project(broker_url=broker_url, hold_eta_after=0.0)
    p.submit("t.add", 1, 1)  # a publish: this process now pools a broker connection
    held = p.submit("t.add", 2, 2, countdown=0.5)
    assert p.get(held).published_at is None
    rabbitmq_restart_app()
    due = p.get(held).eta
    wait_until(lambda: p.store.database_time() >= due, timeout=30, message="ETA passed")
    before = queued(p)

    done = admin(p.module.app).reap()

    assert (done.released, done.publish_failed) == (1, 0), done
    assert queued(p) == before + 1  # the held task's message, published once


# -- row 13: the database ----------------------------------------------------------------


def _database_outage_survived(lease_env: LeaseEnv, fault: str) -> None:
    """Row 13 while the outage is shorter than the TTL: ``fault`` is applied while two
    tasks wait at a gate (leases held, pooled connections open in every process) and
    three are queued; nothing may change but the connections."""
    p = lease_env.project(ttl=LONG_TTL)
    worker = p.worker(concurrency=2)
    inc = p.incarnation(worker)
    gate = p.gates.hold("gate")
    with released(p.gates, gate):
        running = {key: p.submit("t.stepped", key, gate) for key in ("r0", "r1")}
        for key in running:
            p.wait_count(f"start:{key}", 1)
        queued_ids = {key: p.submit("t.stepped", key) for key in ("q0", "q1", "q2")}
        clock = Stopwatch()
        if fault == "restart":
            pg_restart()
            report("row 13: PostgreSQL restart", clock.lap())
            since = db_now(p)
            wait_heartbeat(p, inc, since)
            report("row 13: PostgreSQL restart -> heartbeat renewed", clock.lap())
        else:
            for _ in range(3):
                killed = pg_terminate(p.store.config.database_url)
                assert killed >= 1, "the worker's pooled connections were terminated"
                wait_heartbeat(p, inc, db_now(p))
            report("row 13: 3 x pg_terminate_backend -> heartbeat renewed", clock.lap())
        for task_id in running.values():
            rec = p.get(task_id)
            assert rec.state is State.RUNNING and rec.owner == inc and rec.attempt == 1
    # the children reconnect for their steps and outcomes; the queued tasks are claimed
    assert_clean_runs(p, {**running, **queued_ids}, worker)
    report(f"row 13: {fault} -> all 5 SUCCEEDED", clock.lap())
    for key in (*running, *queued_ids):
        assert p.external.calls(f"done:{key}") == 1, key
    log = worker.log_text()
    assert "treating its leases as lost" not in log, "the outage outlasted the TTL"
    print(f"MEASURED row 13: {fault}: {log.count('heartbeat failed')} failed heartbeats")
    assert worker.is_alive() and p.incarnation(worker) == inc
    assert_clean(p)


@exclusive
@pg_only()
def test_row13_postgresql_restarted_mid_run(lease_env: LeaseEnv) -> None:
    _database_outage_survived(lease_env, "restart")


@exclusive
@pg_only()
def test_row13_connections_terminated_mid_run(lease_env: LeaseEnv) -> None:
    _database_outage_survived(lease_env, "terminate")


@pg_only()
def test_row13_database_unreachable_past_the_ttl_for_one_worker(lease_env: LeaseEnv) -> None:
    # acks_late: a worker holds no more messages than it runs. The cut-off worker's two
    # slots stay busy until the test releases the gate, so every message published in
    # the meantime (the queued tasks, the re-runs) goes to the worker that can claim it;
    # with early acks the cut-off worker would take some and fail to claim them, and
    # they would wait for the reaper's republish backoff
    p = lease_env.project(ttl=CUT_TTL, settings={"task_acks_late": True})
    keys = ["k0", "k1"]
    with proxy_to_postgres() as proxy:
        cut = p.worker(
            "cut", concurrency=2, env={DATABASE_URL_ENV: proxy.url(p.store.config.database_url)}
        )
        cut_id = p.incarnation(cut)
        gate = p.gates.hold("gate")
        with released(p.gates, gate):
            ids = {key: p.submit("t.stepped", key, gate) for key in keys}
            for key in keys:
                p.wait_count(f"start:{key}", 1)
            queued_ids = {key: p.submit("t.stepped", key) for key in ("q0", "q1")}

            proxy.cut()
            clock = Stopwatch()
            p.wait_log(cut, r"heartbeat not renewed for .* treating its leases as lost", 60)
            report(f"row 13: database cut (TTL {CUT_TTL:g} s) -> worker self-fenced", clock.lap())
            direct = p.worker("direct", concurrency=4)
            direct_id = p.incarnation(direct)
            # its reaper expires the cut-off worker's leases; the re-runs wait at the gate
            for key in keys:
                p.wait_count(f"start:{key}", 2, timeout=60)
            report("row 13: database cut -> re-runs started elsewhere", clock.lap())
            for key in keys:
                assert p.get(ids[key]).owner == direct_id
        # the gate opens for both attempts: the fenced one stops at its step boundary
        for task_id in ids.values():
            p.wait_state(task_id, State.SUCCEEDED, timeout=60)
            fenced = rf"{task_id}\]: task {task_id} attempt 1: lease lost: the worker could not"
            p.wait_log(cut, fenced, timeout=60)
            # it cannot even give its lease up: the worker's main process does that later.
            # Celery is told to ignore the delivery, not that the task failed (it runs again)
            gave_up = rf"Task t.stepped\[{task_id}\] ignored"
            p.wait_log(cut, gave_up, timeout=60)
        for task_id in queued_ids.values():
            p.wait_state(task_id, State.SUCCEEDED, timeout=60)
        trails = {task_id: p.store.history(task_id) for task_id in ids.values()}

        cut_at = db_now(p)
        proxy.restore()
        clock = Stopwatch()
        p.wait_log(cut, r"heartbeat restored; fenced leases expired", timeout=60)
        wait_heartbeat(p, cut_id, cut_at)
        report("row 13: proxy restored -> heartbeat renewed", clock.lap())

        # the worker that was cut off serves again once it is the only one
        direct.stop()
        after = p.submit("t.work", "after")
        assert_clean_runs(p, {"after": after}, cut)
        assert p.incarnation(cut) == cut_id

    ext = p.external
    for key, task_id in ids.items():
        rec = p.get(task_id)
        assert rec.state is State.SUCCEEDED and rec.attempt == 2 and rec.recoveries == 1
        assert rec.owner == direct_id
        assert rec.result == {"key": key, "node": direct.nodename}
        trail = p.store.history(task_id)
        assert trail == trails[task_id], "the fenced worker changed the row after recovering"
        assert p.trail(task_id) == RECOVERED
        assert trail[2].actor == "reaper:direct@lease-test"
        outcomes = [(r.to_state, r.attempt) for r in trail if r.from_state is State.RUNNING]
        assert outcomes == [(State.TIMEOUT, 1), (State.SUCCEEDED, 2)]
        # two attempts reached the body; one effect, made by the attempt that held the lease
        assert [e.payload for e in ext.effects(f"start:{key}")] == [cut.nodename, direct.nodename]
        assert [e.payload for e in ext.effects(f"done:{key}")] == [direct.nodename]
        assert ext.calls(f"done:{key}") == 1
    for key, task_id in queued_ids.items():
        rec = p.get(task_id)
        assert rec.attempt == 1 and p.trail(task_id) == CLEAN_RUN
        assert rec.result == {"key": key, "node": direct.nodename}
        assert ext.count(f"start:{key}") == 1 and ext.count(f"done:{key}") == 1
    assert_clean(p)


@pg_only()
def test_row13_database_unreachable_past_the_ttl_for_the_only_worker(lease_env: LeaseEnv) -> None:
    """No other worker: the cut-off worker recovers by itself once the database is back.
    Meanwhile it is fenced and consumes nothing: messages sent meanwhile wait in the
    queue, none of them claimed or lost, and run once it consumes again."""
    p = lease_env.project(ttl=CUT_TTL)
    keys, queued_keys = ["k0", "k1"], ["q0", "q1", "q2"]
    with proxy_to_postgres() as proxy:
        worker = p.worker(
            concurrency=2, env={DATABASE_URL_ENV: proxy.url(p.store.config.database_url)}
        )
        inc = p.incarnation(worker)
        gate = p.gates.hold("gate")
        with released(p.gates, gate):
            ids = {key: p.submit("t.stepped", key, gate) for key in keys}
            for key in keys:
                p.wait_count(f"start:{key}", 1)
            proxy.cut()
            p.wait_log(worker, r"heartbeat not renewed for .* treating its leases as lost", 60)
            p.wait_log(worker, r"worker self-fenced: no queue consumed", timeout=60)
            # the producer (this test) still reaches the database: rows and messages exist
            queued_ids = {key: p.submit("t.stepped", key) for key in queued_keys}
        # the fenced attempts stop at their step boundary; the queued messages wait
        for task_id in ids.values():
            fenced = rf"{task_id}\]: task {task_id} attempt 1: lease lost: the worker could not"
            p.wait_log(worker, fenced, timeout=60)
        for task_id in ids.values():
            # ignored, not failed: nothing reports FAILURE for a task that runs again
            failed = rf"Task t.stepped\[{task_id}\] ignored"
            p.wait_log(worker, failed, timeout=60)
        for task_id in ids.values():
            rec = p.get(task_id)
            assert (rec.state, rec.attempt, rec.owner) == (State.RUNNING, 1, inc)
        for task_id in queued_ids.values():
            rec = p.get(task_id)
            assert (rec.state, rec.attempt) == (State.PENDING, 0)
        assert queued(p) == len(queued_keys), "the fenced worker consumed nothing"
        ext = p.external
        assert [ext.count(f"start:{key}") for key in [*keys, *queued_keys]] == [1, 1, 0, 0, 0]
        assert ext.count("done:k0") == ext.count("done:k1") == 0

        proxy.restore()
        clock = Stopwatch()
        p.wait_log(worker, r"heartbeat restored; fenced leases expired", timeout=60)
        for task_id in [*ids.values(), *queued_ids.values()]:
            p.wait_state(task_id, State.SUCCEEDED, timeout=60)
        report("row 13: proxy restored -> all 5 SUCCEEDED (no other worker)", clock.lap())
        p.drain()

    for key, task_id in ids.items():
        rec = p.get(task_id)
        assert rec.attempt == 2 and rec.recoveries == 1 and rec.owner == inc
        assert p.trail(task_id) == RECOVERED
        # recovered by this worker: by its heartbeat's own recovery, by its embedded
        # reaper (whichever reaches the database first once it answers again), or by
        # its main process handling the fenced attempt's end
        assert p.store.history(task_id)[2].actor in {"worker:w1@lease-test", "reaper:w1@lease-test"}
        assert ext.count(f"start:{key}") == 2
        assert ext.count(f"done:{key}") == 1 and ext.calls(f"done:{key}") == 1
    # each message sent while the worker was fenced waited in the queue (counted above)
    # and was delivered after the worker consumed again
    log = worker.log_text()
    for task_id in queued_ids.values():
        assert re.search(rf"Task t.stepped\[{task_id}\] received", log)
    assert_clean_runs(p, queued_ids, worker)
    assert p.incarnation(worker) == inc
    assert_clean(p)


@pg_only()
def test_row13_a_fenced_worker_claims_nothing_until_its_heartbeat_is_renewed(
    lease_env: LeaseEnv,
) -> None:
    """The window the previous test hits now and then, held open: the worker's heartbeat
    statement fails (a trigger refuses updates of the workers table) while every other
    statement succeeds. The worker fences itself and stops consuming its queues: tasks
    submitted meanwhile are not claimed (a lease claimed now would be lost at once, a
    recovery of a task that never ran) and wait in the queue; once heartbeats pass
    again the worker consumes again and they run once."""
    p = lease_env.project()  # lease_ttl 1 s
    workers = p.store.t.workers
    table = f'"{workers.schema}"."{workers.name}"'
    refuse = f'"{workers.schema}".lease_test_refuse_update'
    worker = p.worker(concurrency=2)
    keys = ["f0", "f1", "f2"]
    with p.store.engine.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE FUNCTION {refuse}() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'heartbeats refused by the test'; END $$"
        )
        conn.exec_driver_sql(
            f"CREATE TRIGGER refuse_heartbeat BEFORE UPDATE ON {table} "
            f"FOR EACH ROW EXECUTE FUNCTION {refuse}()"
        )
    try:
        p.wait_log(worker, r"heartbeat not renewed for .* treating its leases as lost", 60)
        p.wait_log(worker, r"worker self-fenced: no queue consumed", timeout=60)
        ids = {key: p.submit("t.work", key) for key in keys}
        for task_id in ids.values():
            rec = p.get(task_id)
            assert (rec.state, rec.attempt, rec.recoveries) == (State.PENDING, 0, 0), rec
        assert [p.external.count(f"start:{key}") for key in keys] == [0, 0, 0]
    finally:
        with p.store.engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS refuse_heartbeat ON {table}")
    p.wait_log(worker, r"heartbeat restored; fenced leases expired", timeout=60)
    p.wait_log(worker, r"heartbeat restored: queues consumed again", timeout=60)
    assert_clean_runs(p, ids, worker)
    p.drain()
    for key in keys:
        assert p.external.count(f"start:{key}") == 1, key
    assert_clean(p)


# -- row 14: the reaper ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [
        pytest.param("redis", "sqlite", id="redis-sqlite"),
        pytest.param("redis", "postgresql", id="redis-postgresql", marks=pytest.mark.postgres),
    ],
    indirect=True,
)
def test_row14_reaper_killed_mid_sweep(lease_env: LeaseEnv, broker_url: str) -> None:
    # batches of 2: five expired leases take three batches, the crash point fires after
    # the first (committed) one
    p = lease_env.project(broker_url=broker_url, env={TUNING_ENV: "reaper_batch_size=2"})
    keys = [f"k{i}" for i in range(5)]
    victim = p.worker("victim", pool="threads", concurrency=len(keys))
    victim_id = p.incarnation(victim)
    gate = p.gates.hold("gate")
    with released(p.gates, gate):
        ids = {key: p.submit("t.work", key, gate) for key in keys}
        for key in keys:
            p.wait_count(f"start:{key}", 1)
        victim.kill_group(signal.SIGKILL)
        victim.wait_group_gone()
    ttl = p.store.config.ttl

    def expired() -> bool:
        (row,) = [w for w in p.store.workers() if w.id == victim_id]
        return (p.store.now() - row.heartbeat_at).total_seconds() > ttl

    wait_until(expired, timeout=30, message="the dead worker's leases expired")
    for task_id in ids.values():
        assert p.get(task_id).state is State.RUNNING  # nobody else reaps in this test

    died = run_reaper(p.project, crash_at="reaper_mid_sweep")
    assert_crashed(died, "reaper_mid_sweep")
    states = collections.Counter(p.get(t).state for t in ids.values())
    assert states == {State.RETRY_WAIT: 2, State.RUNNING: 3}, states

    clock = Stopwatch()
    swept = run_reaper(p.project, crash_at=None)
    report("row 14: the next sweep (subprocess)", clock.lap())
    assert swept.returncode == 0, swept.stderr
    found = re.search(r"expired=(\d+) retried=(\d+) manual=(\d+) .*due=(\d+)", swept.stdout)
    assert found, swept.stdout
    assert [int(n) for n in found.groups()] == [3, 3, 0, 5], swept.stdout
    for task_id in ids.values():
        rec = p.get(task_id)
        assert rec.state is State.PENDING and rec.published_at is not None

    rescuer = p.worker("rescuer", pool="threads", concurrency=2)
    for key, task_id in ids.items():
        rec = p.wait_state(task_id, State.SUCCEEDED, timeout=60)
        assert rec.attempt == 2 and rec.recoveries == 1
        assert rec.result == {"key": key, "node": rescuer.nodename}
    report("row 14: rescuer started -> all 5 SUCCEEDED", clock.lap())
    p.drain(2)
    for key, task_id in ids.items():
        assert p.trail(task_id) == RECOVERED, (key, p.trail(task_id))
        expiry = p.store.history(task_id)[2]
        assert expiry.actor.startswith("admin:"), expiry
        assert expiry.reason == "lease expired: owner's heartbeat older than the TTL"
        assert p.external.count(f"start:{key}") == 2, key
        assert p.external.count(f"done:{key}") == 1, key
    assert_clean(p)
