"""Transactional enqueue with SQLAlchemy (issue 3, "Transactional enqueue").

``apply_async(..., connection=...)`` writes the row in the caller's transaction. The
message is published right after the commit when a hook says the commit happened (a
``Session``, or a connection of ``outbox_transaction()``); on a bare ``Connection``
the reaper publishes the committed row. A rollback publishes nothing, ever.

Every test runs on SQLite and PostgreSQL; "published" is read from the Redis queue
itself (no worker consumes it unless the test starts one).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from sqlalchemy import Column, Engine, Integer, MetaData, Table, create_engine, select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from celery_lease import ConfigurationError, State, admin, outbox_transaction
from celery_lease._runtime import runtime
from celery_lease.store import Store

from ..helpers import WorkerProject, wait_until

TASKS = """
from celery_lease import LeasedTask
from tests.helpers import ExternalSystem

external = ExternalSystem.from_env()


@app.task(base=LeasedTask, bind=True, name="fulfil")
def fulfil(self, order_id):
    return self.step("charge", external.call, "charge", self.idempotency_key("charge"))
"""


class Env:
    """The producer side of one test: the project's app, its store, a business engine on
    the same database, and the broker queue to look into."""

    def __init__(
        self, project: WorkerProject, store: Store, url: str, schema: str | None, redis_url: str
    ) -> None:
        self.project = project
        self.store = store
        self.mod = project.load()
        self.app = self.mod.app
        self.fulfil = self.mod.fulfil
        self.engine: Engine = create_engine(_driver(url))
        self.orders = Table(
            "orders", MetaData(schema=schema), Column("id", Integer, primary_key=True)
        )
        self.orders.metadata.create_all(self.engine)
        self.redis = redis.Redis.from_url(redis_url)

    def queued(self) -> int:
        """Messages waiting in the test's queue."""
        return int(self.redis.llen(self.project.queue))

    def order_ids(self) -> list[int]:
        with self.engine.connect() as conn:
            return [r.id for r in conn.execute(select(self.orders.c.id).order_by("id"))]

    def row(self, task_id: str) -> Any:
        return self.store.get(task_id)

    def close(self) -> None:
        self.engine.dispose()
        self.redis.close()


def _driver(url: str) -> str:
    parsed = make_url(url)
    if parsed.get_backend_name() == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


@pytest.fixture
def env(
    celery_project: Callable[..., WorkerProject],
    lease_config: Any,
    make_store: Any,
    store_url: str,
    store_schema: str | None,
    redis_url: str,
) -> Iterator[Env]:
    store = make_store()
    project = celery_project(TASKS, config=lease_config())
    e = Env(project, store, store_url, store_schema, redis_url)
    yield e
    e.close()


def test_session_commit_publishes_after_the_commit_and_the_task_runs_once(env, external):
    with Session(env.engine) as session, session.begin():
        session.execute(env.orders.insert().values(id=1))
        result = env.fulfil.apply_async((1,), connection=session)
        assert env.queued() == 0  # not before the commit

    assert env.queued() == 1
    assert env.row(result.id).state is State.PENDING
    # recorded a few milliseconds after the publish, off the producer's path
    wait_until(lambda: env.row(result.id).published_at is not None, message="marked published")

    env.project.worker().wait_ready(store=env.store)
    wait_until(lambda: env.row(result.id).state is State.SUCCEEDED, message="ran")
    assert external.count("charge") == 1
    assert env.order_ids() == [1]


def test_a_task_due_far_ahead_is_held_not_published_after_the_commit(env):
    with Session(env.engine) as session, session.begin():
        session.execute(env.orders.insert().values(id=1))
        result = env.fulfil.apply_async((1,), connection=session, countdown=3600)
    assert env.queued() == 0  # committed, held in the store until its ETA
    row = env.row(result.id)
    assert row.state is State.PENDING and row.published_at is None
    assert [h.id for h in env.store.held()] == [result.id]
    assert env.order_ids() == [1]


def test_session_rollback_publishes_nothing_and_leaves_no_row(env):
    with (
        pytest.raises(RuntimeError, match="business rule"),
        Session(env.engine) as session,
        session.begin(),
    ):
        session.execute(env.orders.insert().values(id=1))
        result = env.fulfil.apply_async((1,), connection=session)
        raise RuntimeError("business rule broken")

    assert env.row(result.id) is None
    assert env.order_ids() == []
    assert env.queued() == 0
    assert admin(env.app).reap().republished == 0
    assert env.queued() == 0


def test_a_scoped_session_works_like_its_session(env):
    scoped = scoped_session(sessionmaker(env.engine))
    try:
        with scoped.begin():
            result = env.fulfil.apply_async((1,), connection=scoped)
            assert env.queued() == 0
        assert env.queued() == 1
        wait_until(lambda: env.row(result.id).published_at is not None, message="marked")
    finally:
        scoped.remove()


def test_a_rolled_back_savepoint_drops_only_the_tasks_it_held(env):
    with Session(env.engine) as session, session.begin():
        kept = env.fulfil.apply_async((1,), connection=session)
        savepoint = session.begin_nested()
        dropped = env.fulfil.apply_async((2,), connection=session)
        savepoint.rollback()
        with session.begin_nested():  # a released savepoint is not a commit
            later = env.fulfil.apply_async((3,), connection=session)
        assert env.queued() == 0

    assert env.row(dropped.id) is None
    wait_until(lambda: env.row(kept.id).published_at is not None, message="kept marked")
    wait_until(lambda: env.row(later.id).published_at is not None, message="later marked")
    assert env.queued() == 2


def test_a_session_joined_to_an_outer_transaction_waits_for_the_real_commit(env):
    with env.engine.connect() as conn:
        outer = conn.begin()
        session = Session(bind=conn, join_transaction_mode="create_savepoint")
        result = env.fulfil.apply_async((1,), connection=session)
        session.commit()  # only releases a savepoint: the row is not committed yet
        session.close()
        assert env.queued() == 0
        outer.commit()

    # committed by its owner, out of the session's sight: the reaper publishes it
    assert env.row(result.id).published_at is None
    wait_until(lambda: admin(env.app).reap().republished == 1, message="reaper published")
    assert env.queued() == 1


def test_a_bare_connection_is_published_by_the_reaper_once_committed(env):
    with env.engine.begin() as conn:
        conn.execute(env.orders.insert().values(id=1))
        committed = env.fulfil.apply_async((1,), connection=conn)
    with pytest.raises(RuntimeError), env.engine.begin() as conn:
        rolled_back = env.fulfil.apply_async((2,), connection=conn)
        raise RuntimeError("rolled back")

    assert env.queued() == 0  # no after-commit hook on a bare connection
    assert env.row(committed.id).published_at is None
    assert env.row(rolled_back.id) is None
    # lease_publish_grace (0.5 s here) after the insert, one reaper sweep publishes it
    wait_until(lambda: admin(env.app).reap().republished == 1, message="reaper published")
    assert env.queued() == 1
    assert env.row(committed.id).published_at is not None


@pytest.mark.parametrize("bind", ["engine", "connection"])
def test_outbox_transaction_publishes_when_its_block_commits(env, bind):
    def begin() -> Any:
        return outbox_transaction(env.engine if bind == "engine" else env.engine.connect())

    with begin() as conn:
        conn.execute(env.orders.insert().values(id=1))
        result = env.fulfil.apply_async((1,), connection=conn)
        assert env.queued() == 0
    assert env.queued() == 1
    wait_until(lambda: env.row(result.id).published_at is not None, message="marked published")

    with pytest.raises(RuntimeError), begin() as conn:
        conn.execute(env.orders.insert().values(id=2))
        gone = env.fulfil.apply_async((2,), connection=conn)
        raise RuntimeError("rolled back")
    assert env.row(gone.id) is None
    assert env.order_ids() == [1]
    assert env.queued() == 1


def test_outbox_transaction_refuses_a_connection_already_in_a_transaction(env):
    with env.engine.connect() as conn:
        conn.execute(select(1))  # autobegins
        with (
            pytest.raises(ConfigurationError, match="already in a transaction"),
            outbox_transaction(conn),
        ):
            pass


def test_a_dedup_key_in_a_transaction_submits_once(env):
    with Session(env.engine) as session, session.begin():
        first = env.fulfil.apply_async((1,), connection=session, dedup_key="order-1")
        again = env.fulfil.apply_async((1,), connection=session, dedup_key="order-1")
    assert again.id == first.id
    assert env.queued() == 1


def test_listeners_hear_of_a_transactional_submit_only_after_the_commit(env):
    heard: list[tuple[str, State]] = []
    store = runtime(env.app).store
    store.listeners.append(lambda events: heard.extend((e.task_id, e.to_state) for e in events))

    with Session(env.engine) as session:
        with session.begin():
            committed = env.fulfil.apply_async((1,), connection=session)
            assert heard == []
        with pytest.raises(RuntimeError), session.begin():
            env.fulfil.apply_async((2,), connection=session)
            raise RuntimeError("rolled back")

    assert heard == [(committed.id, State.PENDING)]


def test_a_connection_on_another_database_is_refused(env, tmp_path, backend):
    other = create_engine(f"sqlite:///{tmp_path / 'other.sqlite3'}")
    try:
        with other.begin() as conn, pytest.raises(ConfigurationError):
            env.fulfil.apply_async((1,), connection=conn)
        with pytest.raises(ConfigurationError, match="Connection or Session"):
            env.fulfil.apply_async((1,), connection=object())
    finally:
        other.dispose()
    assert env.queued() == 0


PRODUCER = """
import os
import sys

from sqlalchemy import create_engine, event
from sqlalchemy.orm import Session, scoped_session, sessionmaker

sys.path[:0] = [{project_dir!r}]
import {module} as proj

engine = create_engine({url!r})
with Session(engine) as session:
    # registered before the task's publisher: the process dies right after the commit
    event.listen(session, "after_commit", lambda s: os._exit(137))
    with session.begin():
        result = proj.fulfil.apply_async((1,), connection=session, task_id="outbox-crash")
"""


def test_a_producer_dying_between_commit_and_publish_is_covered_by_the_reaper(env, external):
    script = PRODUCER.format(
        project_dir=str(env.project.directory),
        module=env.project.module,
        url=env.engine.url.render_as_string(hide_password=False),
    )
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env.project.process_env(),
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 137, done.stderr.decode()
    row = env.row("outbox-crash")
    assert row is not None and row.state is State.PENDING and row.published_at is None
    assert env.queued() == 0

    env.project.worker().wait_ready(store=env.store)  # its embedded reaper publishes the row
    wait_until(lambda: env.row("outbox-crash").state is State.SUCCEEDED, message="ran")
    assert external.count("charge") == 1
    assert env.row("outbox-crash").attempt == 1
