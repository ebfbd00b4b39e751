"""A database that stops answering or is not there yet, and two workers under one name.

- A store that black-holes (accepts, then never answers) or refuses: every store call
  (a producer's ``.delay()``, the published-marks flush, the reaper, the CLI, a
  worker's heartbeat) ends with ``StoreUnavailable`` within ``lease_db_timeout``
  instead of hanging; the durations are measured and printed, never asserted.
- A worker started while the database refuses connections waits and retries until it
  answers (``lease_db_startup_timeout``); a configuration error exits 78 at once.
- A second live worker started under the node name of a running one refuses to start:
  it must not take the running one for a dead predecessor and expire its leases.

PostgreSQL only: the faults are a TCP proxy in front of the test's database
(:class:`tests.crash.faults.TcpProxy`); nothing else on the machine is touched.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

from celery_lease import State, StoreUnavailable, SubmissionOutcomeUnknown, reap

from ..helpers import flush_published, wait_until
from .faults import TcpProxy, pg_sessions_from, proxy_to_postgres, subprocess_env
from .support import CLEAN_RUN, LeaseEnv, Stopwatch, pg_only, released, report

pytestmark = pg_only()

#: The generated module reads ``TEST_CONF_<KEY>`` after the project's settings.
DATABASE_URL_ENV = "TEST_CONF_LEASE_DATABASE_URL"
#: The bound of the tests' store calls (the default is 10 s).
DB_TIMEOUT = 2.0


def timed(call: Callable[[], Any]) -> tuple[BaseException | None, float]:
    """Run ``call``; (the exception it raised or None, seconds it took)."""
    clock = Stopwatch()
    try:
        call()
    except Exception as error:
        return error, clock.lap()
    return None, clock.lap()


def unavailable(outcome: tuple[BaseException | None, float], label: str) -> float:
    error, seconds = outcome
    assert isinstance(error, StoreUnavailable), f"{label}: {error!r}"
    report(label, seconds)
    return seconds


def test_store_calls_end_with_store_unavailable_when_the_database_black_holes(
    lease_env: LeaseEnv, redis_url: str
) -> None:
    with proxy_to_postgres() as proxy:
        url = lease_env.project(broker_url=redis_url).store.config.database_url
        # the project's processes (this one included) reach the store through the proxy;
        # p.store, which the test checks with, does not
        p = lease_env.project(
            broker_url=redis_url,
            settings={"lease_db_timeout": DB_TIMEOUT},
            env={DATABASE_URL_ENV: proxy.url(url)},
        )
        app = p.module.app
        ok = p.submit("t.add", 1, 2)  # a pooled connection to the database, in use
        assert p.store.get(ok) is not None

        proxy.blackhole()
        unavailable(timed(lambda: p.submit("t.add", 2, 3)), "black hole: .delay(), pooled")
        unavailable(timed(lambda: p.submit("t.add", 3, 4)), "black hole: .delay(), new conn")
        unavailable(timed(lambda: reap(app)), "black hole: reap()")
        from celery_lease._runtime import runtime

        unavailable(timed(runtime(app).store.now), "black hole: store.now()")

        # the published marks: a background thread records them; the flush at exit
        # waits for it, and both end within the bound
        marks = runtime(app).store._marks
        marks.add(ok)
        error, seconds = timed(marks.flush)
        assert error is None  # logged as a warning: a mark is bookkeeping, not a decision
        report("black hole: published-marks flush", seconds)

        # the CLI, in a process of its own
        clock = Stopwatch()
        cli = subprocess.run(
            [sys.executable, "-m", "celery", "-A", p.project.module, "lease", "show", ok],
            cwd=p.project.directory,
            env=subprocess_env(p.project),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        report("black hole: celery lease show", clock.lap())
        assert cli.returncode == 3, cli.stderr  # EXIT_STORE
        assert "unavailable" in cli.stderr and "lease_db_timeout" in cli.stderr, cli.stderr

        proxy.cut()  # refused
        unavailable(timed(lambda: p.submit("t.add", 4, 5)), "refused: .delay()")

        proxy.restore()
        proxy.resume()
        again = p.submit("t.add", 5, 6)
        assert p.store.get(again) is not None, "the store works again once the server answers"


def test_a_black_holed_heartbeat_gives_up_within_the_ttl_and_resumes(
    lease_env: LeaseEnv, redis_url: str
) -> None:
    ttl = 4.0
    p = lease_env.project(broker_url=redis_url, ttl=ttl, heartbeat_interval=0.5)
    with proxy_to_postgres() as proxy:
        worker = p.worker(env={DATABASE_URL_ENV: proxy.url(p.store.config.database_url)})
        proxy.blackhole()
        clock = Stopwatch()
        # the renewal on its pooled connection is abandoned: no hang past the TTL (the
        # heartbeat's own store gives up after min(lease_db_timeout, ttl / 2) = 2 s)
        p.wait_log(worker, r"heartbeat failed: .*no answer within 2 s", timeout=60)
        report("black hole: first heartbeat failure logged", clock.lap())
        p.wait_log(worker, r"heartbeat not renewed for .* treating its leases as lost", 60)
        proxy.resume()
        p.wait_log(worker, r"heartbeat restored; fenced leases expired", timeout=60)
        report("black hole: heartbeat restored after resume", clock.lap())
        assert worker.is_alive()
        p.drain()  # the worker runs tasks again


def test_a_worker_started_while_the_database_refuses_waits_for_it(
    lease_env: LeaseEnv, redis_url: str
) -> None:
    p = lease_env.project(broker_url=redis_url)
    proxy = TcpProxy()  # not listening yet: every connect is refused
    try:
        worker = p.worker(
            env={DATABASE_URL_ENV: proxy.url(p.store.config.database_url)}, ready=False
        )
        p.wait_log(worker, r"unavailable: .*Connection refused.*; retrying in", timeout=60)
        assert worker.is_alive(), worker.log_tail()  # before: exit 78 at once
        proxy.start()
        worker.wait_ready(timeout=60, store=p.store)
        p.drain()
    finally:
        proxy.close()


def test_a_worker_that_never_reaches_the_database_exits_78(
    lease_env: LeaseEnv, redis_url: str
) -> None:
    # settings.md: it retries for up to lease_db_startup_timeout, then exits 78; with
    # lease_db_startup_timeout = 0 it exits 78 without retrying
    p = lease_env.project(broker_url=redis_url)
    proxy = TcpProxy()  # never listening: every connect is refused
    try:
        url = proxy.url(p.store.config.database_url)
        waits = p.worker(
            "waits",
            env={DATABASE_URL_ENV: url, "TEST_CONF_LEASE_DB_STARTUP_TIMEOUT": "2"},
            ready=False,
        )
        # the setting is read: the first retry gives up within its 2 s, not the default 60
        p.wait_log(
            waits, r"retrying in .*\(giving up in [0-2] s, lease_db_startup_timeout\)", timeout=60
        )
        at_once = p.worker(
            "at-once",
            env={DATABASE_URL_ENV: url, "TEST_CONF_LEASE_DB_STARTUP_TIMEOUT": "0"},
            ready=False,
        )
        for worker in (waits, at_once):
            assert worker.proc is not None
            worker.proc.wait(120)
            assert worker.returncode == 78, worker.log_tail()
            assert "cannot start" in worker.log_text(since_start=True), worker.log_tail()
        assert "retrying in" not in at_once.log_text(since_start=True), at_once.log_tail()
    finally:
        proxy.close()


def test_a_worker_with_a_configuration_error_exits_at_once(
    lease_env: LeaseEnv, redis_url: str
) -> None:
    p = lease_env.project(broker_url=redis_url)
    from sqlalchemy.engine import make_url

    url = make_url(p.store.config.database_url).set(database="celery_lease_no_such_db")
    worker = p.worker(
        env={DATABASE_URL_ENV: url.render_as_string(hide_password=False)}, ready=False
    )
    assert worker.proc is not None
    worker.proc.wait(60)
    assert worker.returncode == 78, worker.log_tail()
    log = worker.log_text(since_start=True)
    assert "does not exist" in log and "retrying in" not in log, log[-2000:]


def test_a_second_live_worker_under_the_same_name_refuses_to_start(
    lease_env: LeaseEnv, redis_url: str
) -> None:
    p = lease_env.project(broker_url=redis_url)
    first = p.worker("first", concurrency=2)
    first_id = p.incarnation(first)
    gate = p.gates.hold("gate")
    with released(p.gates, gate):
        ids = [p.submit("t.stepped", f"k{i}", gate) for i in range(2)]
        for i in range(2):
            p.wait_count(f"start:k{i}", 1)

        twin = p.project.worker("twin", nodename=first.nodename)
        assert twin.proc is not None
        twin.proc.wait(60)
        assert twin.returncode == 78, twin.log_tail()
        assert f"another worker named {first.nodename} is running" in twin.log_text(), (
            twin.log_tail()
        )
        # the running worker and its leases are untouched
        for task_id in ids:
            record = p.get(task_id)
            assert (record.state, record.attempt, record.owner) == (State.RUNNING, 1, first_id)
        assert p.incarnation(first) == first_id
    for task_id in ids:
        record = p.wait_state(task_id, State.SUCCEEDED)
        assert record.attempt == 1 and record.recoveries == 0
    for i in range(2):
        assert p.external.count(f"done:k{i}") == 1


def test_a_group_whose_rows_and_messages_went_out_succeeds_though_the_marks_hang(
    lease_env: LeaseEnv, redis_url: str
) -> None:
    """The database black-holes after every row of a group was committed and every
    message sent, before they are marked published: the submission succeeded, so
    ``apply_async`` returns the group's result (it raised ``StoreUnavailable``), and
    every member runs once."""
    from celery import group
    from kombu import Producer

    with proxy_to_postgres() as proxy:
        url = lease_env.project(broker_url=redis_url).store.config.database_url
        p = lease_env.project(
            broker_url=redis_url,
            settings={"lease_db_timeout": DB_TIMEOUT},
            env={DATABASE_URL_ENV: proxy.url(url)},
        )
        app = p.module.app
        members = 20

        class BlackHoleAfterLast(Producer):
            """Sends as usual; the database stops answering once the last member's
            message is out (between the publish and the marks)."""

            sent = 0

            def publish(self, body: Any, **kwargs: Any) -> Any:
                out = super().publish(body, **kwargs)
                type(self).sent += 1
                if type(self).sent == members:
                    proxy.blackhole()
                return out

        with app.connection_for_write() as conn:
            producer = BlackHoleAfterLast(conn)
            outcome: list[Any] = []
            error, seconds = timed(
                lambda: outcome.append(
                    group(app.tasks["t.add"].s(i, i) for i in range(members)).apply_async(
                        producer=producer
                    )
                )
            )
        report("black hole after a group's publish: apply_async", seconds)
        assert error is None, f"the group was submitted, yet apply_async raised {error!r}"
        assert BlackHoleAfterLast.sent == members
        ids = [str(r.id) for r in outcome[0].results]
        proxy.resume()
        p.worker()
        for task_id in ids:
            p.wait_state(task_id, State.SUCCEEDED)
        assert p.external.count("add") == members


def test_a_submission_the_database_gets_after_the_call_gave_up_writes_nothing(
    lease_env: LeaseEnv, redis_url: str
) -> None:
    """``.delay()`` against a black-holed database ends with ``SubmissionOutcomeUnknown``
    naming the task; its INSERT, held in the network and delivered once it heals, runs
    after the call's deadline and writes nothing (it used to commit, and the reaper
    published the task the caller was told had failed). A retry with the same task id
    runs it once."""
    with proxy_to_postgres() as proxy:
        url = lease_env.project(broker_url=redis_url).store.config.database_url
        p = lease_env.project(
            broker_url=redis_url,
            settings={"lease_db_timeout": DB_TIMEOUT},
            env={DATABASE_URL_ENV: proxy.url(url)},
        )
        ok = p.submit("t.add", 1, 2)  # a pooled connection, and a reading of the db clock
        assert p.store.get(ok) is not None
        from celery_lease._runtime import runtime

        # ok's "published" mark recorded now: the one pooled connection is idle, and the
        # next submit sends its INSERT on it (a new connection would not get that far)
        flush_published(runtime(p.module.app).store)

        proxy.blackhole()
        task_id = "late-arrival-1"
        error, seconds = timed(lambda: p.submit("t.add", 2, 3, task_id=task_id))
        report("black hole: .delay() -> SubmissionOutcomeUnknown", seconds)
        assert isinstance(error, SubmissionOutcomeUnknown), repr(error)
        assert error.task_id == task_id and error.task_ids == (task_id,)
        assert "retry with the same task_id" in str(error)

        proxy.resume()  # the held INSERT reaches the server now, past its deadline
        wait_until(
            lambda: pg_sessions_from(url, proxy.upstream_ports) == 0,
            timeout=60,
            message="the server ran and closed what the proxy held",
        )
        assert p.store.get(task_id) is None, "a statement delivered late wrote its row"

        p.worker()
        again = p.submit("t.add", 2, 3, task_id=task_id)  # the documented retry
        assert again == task_id
        p.wait_state(task_id, State.SUCCEEDED)
        p.drain()
        assert p.external.count("add") == 3  # ok, the retried task once, drain


def test_a_submission_whose_answer_is_lost_runs_once_when_retried_with_its_id(
    lease_env: LeaseEnv, redis_url: str
) -> None:
    """The INSERT of ``.delay()`` commits and its answer never comes: the call raises
    ``SubmissionOutcomeUnknown`` (not a plain "failed"); the row is there, the reaper
    publishes it, and the documented retry with the same task id finds it and runs
    nothing twice."""
    with proxy_to_postgres() as proxy:
        url = lease_env.project(broker_url=redis_url).store.config.database_url
        p = lease_env.project(
            broker_url=redis_url,
            settings={"lease_db_timeout": DB_TIMEOUT},
            env={DATABASE_URL_ENV: proxy.url(url)},
        )
        ok = p.submit("t.add", 1, 2)
        from celery_lease._runtime import runtime

        flush_published(runtime(p.module.app).store)  # the pooled connection is idle

        proxy.hold_answers()
        task_id = "answer-lost-1"
        error, seconds = timed(lambda: p.submit("t.add", 2, 3, task_id=task_id))
        report("answers held: .delay() -> SubmissionOutcomeUnknown", seconds)
        assert isinstance(error, SubmissionOutcomeUnknown), repr(error)
        assert error.task_id == task_id
        record = p.get(task_id)  # the statement ran: the row is written, not published
        assert record.state is State.PENDING and record.published_at is None

        proxy.resume()
        again = p.submit("t.add", 2, 3, task_id=task_id)  # the documented retry
        assert again == task_id
        assert p.get(task_id).published_at is None  # a duplicate: nothing published
        p.worker()  # its reaper publishes the row after lease_publish_grace
        assert p.wait_state(task_id, State.SUCCEEDED).attempt == 1
        p.wait_state(ok, State.SUCCEEDED)
        p.drain()
        assert p.external.count("add") == 3  # ok, the task once, drain


def _consumers(broker_url: str, queue: str) -> int:
    """Consumers RabbitMQ counts on ``queue`` (what the broker itself records)."""
    from kombu import Connection

    with Connection(broker_url, connect_timeout=5) as conn:
        channel: Any = conn.channel()
        return int(channel.queue_declare(queue, passive=True).consumer_count)


def test_a_self_fenced_worker_stops_consuming_until_its_heartbeat_is_restored(
    lease_env: LeaseEnv, amqp_url: str, queue_name: str
) -> None:
    # before: it went on taking deliveries and dropping them (each drop putting the
    # row's next publication further out) while healthy workers idled
    p = lease_env.project(broker_url=amqp_url, ttl=4.0, heartbeat_interval=0.5)
    with proxy_to_postgres() as proxy:
        worker = p.worker(env={DATABASE_URL_ENV: proxy.url(p.store.config.database_url)})
        wait_until(lambda: _consumers(amqp_url, queue_name) == 1, timeout=30, message="consumer")
        proxy.blackhole()
        p.wait_log(worker, r"self-fenced: no queue consumed", timeout=60)
        wait_until(
            lambda: _consumers(amqp_url, queue_name) == 0, timeout=30, message="consumer stopped"
        )
        task_id = p.submit("t.add", 1, 2)  # the test's own store is not behind the proxy
        proxy.resume()
        p.wait_log(worker, r"heartbeat restored: queues consumed again", timeout=60)
        wait_until(
            lambda: _consumers(amqp_url, queue_name) == 1, timeout=30, message="consumer back"
        )
        p.wait_state(task_id, State.SUCCEEDED, timeout=60)
        assert p.trail(task_id) == CLEAN_RUN  # never taken and dropped while fenced
        assert worker.is_alive()
