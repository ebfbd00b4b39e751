"""Issue 14, retention: the reaper deletes finished rows older than ``lease_retention``.

Store level on both backends (which rows go, in what batches, the ``purged`` counter,
locked rows skipped), then real ``celery worker`` processes whose embedded reaper
purges what they finished and keeps every live row.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text

from celery_lease import State
from celery_lease.reaper import Reaper
from celery_lease.store import Store

from ..crash.support import TASKS, LeaseEnv
from ..helpers import wait_until
from .test_store_contract import new_task, running, submit

S = State


def finished(store: Store, to: State = S.SUCCEEDED, **overrides: Any) -> str:
    """A task run to ``to`` (SUCCEEDED, FAILED or WAIT_MANUAL by its own outcome)."""
    task_id, lease, _ = running(store, **overrides)
    store.step_done(lease, "a", '"x"', idempotent=True)
    assert store.finish(lease, to, actor="w", reason="outcome")
    return task_id


def aged(store: Store, task_ids: list[str], seconds: float) -> None:
    """Wait (database time) until every one of ``task_ids`` finished ``seconds`` ago."""
    last = max(store.get(t).finished_at for t in task_ids)  # type: ignore[union-attr]
    wait_until(lambda: store.now() - last > timedelta(seconds=seconds), message="rows age")


def test_only_finished_rows_older_than_the_horizon_go(store: Store) -> None:
    gone = [finished(store), finished(store, S.FAILED)]
    cancelled = submit(store)
    store.request_cancel(cancelled, actor="op", reason="not needed")
    gone.append(cancelled)
    # live rows, some with a finish time of their own (WAIT_MANUAL by its own outcome)
    manual = finished(store, S.WAIT_MANUAL)
    pending = submit(store)
    live, _, _ = running(store)
    retry_wait, _, _ = running(store)
    (expiry,) = store.expire(
        actor="reaper", reason="test expiry", task_ids=[retry_wait], only_expired=False
    )
    assert expiry.to_state is S.RETRY_WAIT  # due, but no reaper takes it in this test
    aged(store, [*gone, manual], 0.3)

    assert store.purge_expired(3600) == 0
    assert store.purge_expired(0.2) == 3
    for task_id in gone:
        assert store.get(task_id) is None
        assert store.history(task_id) == [] and store.steps(task_id) == []
    kept = {manual: S.WAIT_MANUAL, pending: S.PENDING, live: S.RUNNING, retry_wait: S.RETRY_WAIT}
    for task_id, want in kept.items():
        record = store.get(task_id)
        assert record is not None and record.state is want
        assert store.history(task_id)
    assert store.steps(manual) != []
    assert store.counters()["purged"] == 3
    assert store.purge_expired(0.2) == 0
    assert store.counters()["purged"] == 3


def test_batches_are_bounded_and_the_counter_adds_up(store: Store) -> None:
    ids = [finished(store) for _ in range(5)]
    aged(store, ids, 0.2)
    assert [store.purge_expired(0.1, limit=2) for _ in range(4)] == [2, 2, 1, 0]
    assert store.counters()["purged"] == 5


def test_lease_retention_batch_size_bounds_each_delete(make_store: Callable[..., Store]) -> None:
    # the retention batch (a constant, 1000 rows per transaction), made small here
    store = make_store(tuning={"retention_batch_size": 2})
    ids = [finished(store) for _ in range(3)]
    aged(store, ids, 0.2)
    assert [store.purge_expired(0.1) for _ in range(3)] == [2, 1, 0]
    assert store.counters()["purged"] == 3


def test_a_purged_dedup_key_can_be_submitted_again(store: Store) -> None:
    first = finished(store, dedup_key="export:42")
    again, created = store.submit(new_task(dedup_key="export:42"))
    assert (again, created) == (first, False)  # held while its row exists
    aged(store, [first], 0.2)
    assert store.purge_expired(0.1) == 1
    assert submit(store, dedup_key="export:42") != first


def test_a_success_whose_follow_ups_are_unpublished_is_kept_until_they_are(store: Store) -> None:
    # its row is what the reaper replays the chain, callbacks and chord part-return
    # from: purged first, they would be lost for good (and the tombstone would drop
    # their late message too)
    task_id, lease, _ = running(store)
    assert store.finish(lease, S.SUCCEEDED, actor="w", reason="ok", follow_ups=True)
    plain = finished(store)
    aged(store, [task_id, plain], 0.2)

    assert store.purge_expired(0.1) == 1  # the one without follow-ups
    assert store.purge(older_than=0.1, states_=[S.SUCCEEDED]) == 0
    assert store.purgeable_count([S.SUCCEEDED], 0.1) == 0
    record = store.get(task_id)
    assert record is not None and record.follow_ups_at is not None

    store.follow_ups_sent([task_id])
    assert store.purge_expired(0.1) == 1
    assert store.get(task_id) is None


@pytest.mark.parametrize(
    "backend", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True
)
def test_rows_another_transaction_holds_are_skipped_not_waited_for(store: Store) -> None:
    held, other = finished(store), finished(store)
    aged(store, [held, other], 0.2)
    t = store.t.tasks
    locked = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with store.engine.begin() as conn:
            conn.execute(t.select().where(t.c.id == held).with_for_update())
            locked.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(10)
        started = time.monotonic()
        assert store.purge_expired(0.1) == 1  # the other one; the held row is skipped
        assert time.monotonic() - started < 10  # it did not wait for the lock to go
        assert store.get(held) is not None and store.get(other) is None
    finally:
        release.set()
        holder.join()
    assert store.purge_expired(0.1) == 1


@pytest.mark.parametrize(
    "backend", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True
)
def test_the_purge_query_can_use_the_finished_index(store: Store) -> None:
    # the partial index's predicate must be implied by the query's own words, whatever
    # the parameters: with sequential scans priced out the plan then shows the index
    t = store.t.tasks
    compiled = store._victims().compile(dialect=store.engine.dialect)
    with store.engine.begin() as conn:
        conn.execute(text("SET LOCAL enable_seqscan = off"))
        rows = conn.exec_driver_sql("EXPLAIN " + str(compiled), {"b_older": 60.0, "b_limit": 10})
        plan = "\n".join(r[0] for r in rows)
    assert f"{t.name}_finished" in plan, plan


def test_the_reaper_reports_purged_rows_and_honours_none(make_store: Callable[..., Store]) -> None:
    store = make_store(retention=0.1)
    ids = [finished(store) for _ in range(3)]
    aged(store, ids, 0.2)
    keep = make_store(retention=None)
    from celery import Celery

    app = Celery(set_as_current=False)
    assert Reaper(app, actor="reaper:test", store=keep).sweep().purged == 0
    assert all(keep.get(i) is not None for i in ids)
    report = Reaper(app, actor="reaper:test", store=store).sweep()
    assert report.purged == 3 and report.as_dict()["purged"] == 3
    assert store.counters()["purged"] == 3

    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from celery_lease.metrics import registry

    scraped = generate_latest(registry(app, store)).decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(scraped) for s in f.samples}
    assert samples["celery_lease_purged_total"] == 3


# -- real workers -------------------------------------------------------------------------

#: A task that retries in an hour: PENDING (with its ETA) for the whole test.
RETRY_LATER = """

@app.task(base=LeasedTask, bind=True, shared=False, name="t.retry_later", max_retries=3)
def retry_later(self):
    external.call("retry_later")
    raise self.retry(countdown=3600, exc=Flaky("later"))
"""


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [
        pytest.param("redis", "sqlite", id="redis-sqlite"),
        pytest.param("redis", "postgresql", id="redis-postgresql", marks=pytest.mark.postgres),
    ],
    indirect=True,
)
def test_workers_purge_what_they_finished_and_keep_live_rows(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = lease_env.project(
        broker_url=broker_url,
        source=TASKS + RETRY_LATER,
        retention=1.0,
        reaper_interval=0.2,
        heartbeat_interval=0.2,
        ttl=2.0,
    )
    p.worker(concurrency=2)
    # live rows first, so that they are older than the horizon when the others go
    manual = p.submit("t.exhaust_manual")
    later = p.submit("t.retry_later")
    waiting = p.submit("t.add", 1, 1, countdown=3600)
    gate = p.gates.hold("retention")
    held = p.submit("t.work", "held", gate)
    p.wait_state(manual, S.WAIT_MANUAL)
    wait_until(lambda: p.get(later).retries == 1, timeout=30, message="retry scheduled")
    p.wait_state(held, S.RUNNING)

    ok = p.submit("t.add", 2, 3)
    boom = p.submit("t.boom", "no luck")
    cancelled = p.submit("t.add", 0, 0, countdown=3600)
    p.store.request_cancel(cancelled, actor="op", reason="not needed")
    p.wait_state(ok, S.SUCCEEDED)
    p.wait_state(boom, S.FAILED)

    for task_id in (ok, boom, cancelled):
        wait_until(
            lambda t=task_id: p.store.get(t) is None, timeout=30, message=f"{task_id} purged"
        )
        assert p.store.history(task_id) == []
    for task_id, want in (
        (manual, S.WAIT_MANUAL),
        (later, S.PENDING),
        (waiting, S.PENDING),
        (held, S.RUNNING),
    ):
        assert p.get(task_id).state is want, task_id
        assert p.store.history(task_id), task_id
    assert p.store.counters()["purged"] == 3
    p.gates.release(gate)
    p.wait_state(held, S.SUCCEEDED)
    wait_until(lambda: p.store.get(held) is None, timeout=30, message="held purged")
    assert p.store.counters()["purged"] == 4
    assert p.get(manual).state is S.WAIT_MANUAL
    # nothing was run more than once on the way
    assert p.external.count("add") == 1 and p.external.count("boom") == 1


# -- tombstones: a late message of a purged row is not adopted ----------------------------


def test_a_purged_id_is_not_adopted_until_its_tombstone_expires(
    make_store: Callable[..., Store],
) -> None:
    store = make_store(retention=0.5)
    task_id = submit(store)
    store.request_cancel(task_id, actor="op", reason="not needed")  # PENDING -> CANCELLED
    assert store.purge(older_than=0, states_=[S.CANCELLED]) == 1
    owner = running(store)[2]
    adopt = new_task(task_id)

    refused = store.claim(task_id, owner, "worker:w1@host", adopt=adopt)
    assert getattr(refused, "why", "").startswith("its row was purged"), refused
    assert store.get(task_id) is None
    # past keep_until (lease_retention after the purge) the reaper deletes the tombstone
    from celery import Celery

    reaper = Reaper(Celery(set_as_current=False), actor="reaper:test", store=store)
    wait_until(
        lambda: reaper.sweep() is not None and store.purge_tombstones() == 0 and _no_tomb(store),
        timeout=30,
        message="tombstone deleted",
    )
    assert store.claim(task_id, owner, "worker:w1@host", adopt=adopt).lease.attempt == 1  # type: ignore[union-attr]


def _no_tomb(store: Store) -> bool:
    p = store.t.purged
    with store.engine.connect() as conn:
        return conn.execute(p.select()).first() is None


def test_retention_leaves_a_tombstone_for_what_it_purges(make_store: Callable[..., Store]) -> None:
    store = make_store(retention=0.1)
    task_id = finished(store)
    aged(store, [task_id], 0.2)
    assert store.purge_expired(0.1) == 1
    refused = store.claim(task_id, running(store)[2], "worker:w@h", adopt=new_task(task_id))
    assert getattr(refused, "why", "").startswith("its row was purged"), refused


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [
        pytest.param("redis", "sqlite", id="redis-sqlite"),
        pytest.param("amqp", "postgresql", id="amqp-postgresql", marks=pytest.mark.postgres),
    ],
    indirect=True,
)
def test_a_cancelled_task_purged_before_its_message_arrives_never_runs(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    # before: the queued message was adopted ("adopted: message without a row") and ran
    from celery_lease import admin

    p = lease_env.project(broker_url=broker_url)
    p.worker()
    api = admin(p.module.app)
    dropped = p.store.counters()["duplicates_dropped"]
    task_id = p.submit("t.add", 7, 7, countdown=10)  # its message waits for its ETA
    assert api.cancel(task_id, reason="not needed", actor="op") is S.PENDING
    assert api.purge(older_than=0) == 1
    assert p.store.get(task_id) is None

    # the message arrives at its ETA, finds no row and a tombstone: dropped, not run
    wait_until(
        lambda: p.store.counters()["duplicates_dropped"] > dropped,
        timeout=60,
        message="the late message dropped",
    )
    assert p.store.get(task_id) is None
    assert p.external.count("add") == 0
    p.drain()
    assert p.external.count("add") == 1  # the drain's own task only
