"""The store's batched outcomes (``Store.finish_many``), on SQLite and PostgreSQL.

A batch writes each execution's outcome fenced by its own attempt and token, with its
audit row, in one statement (PostgreSQL) or one transaction (SQLite); a lost lease is
answered ``False`` and left as it is, whatever else the batch holds.
"""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from sqlalchemy import event

from celery_lease.exceptions import IllegalTransition
from celery_lease.states import State
from celery_lease.store import Claim, Outcome, Refusal

from ..helpers import wait_until
from .test_store_contract import recover, running, snapshot, trail

S = State


class Statements:
    """Statements and commits the store's engine sends (SQLAlchemy events)."""

    def __init__(self, engine):
        self.engine = engine
        self.statements: list[str] = []
        self.commits = 0

    def __enter__(self):
        event.listen(self.engine, "before_cursor_execute", self._statement)
        event.listen(self.engine, "commit", self._commit)
        return self

    def __exit__(self, *exc):
        event.remove(self.engine, "before_cursor_execute", self._statement)
        event.remove(self.engine, "commit", self._commit)

    def _statement(self, conn, cursor, statement, *args):
        self.statements.append(statement.lstrip().split(None, 1)[0].upper())

    def _commit(self, conn):
        self.commits += 1


def test_a_batch_writes_every_outcome_with_its_audit_row(store):
    ran = [running(store) for _ in range(3)]
    outcomes = [
        Outcome(ran[0][1], S.SUCCEEDED, "succeeded", result='{"n":1}'),
        Outcome(ran[1][1], S.FAILED, "task raised ValueError", error="ValueError: bad"),
        Outcome(ran[2][1], S.CANCELLED, "cancelled: asked"),
    ]
    assert store.finish_many(outcomes, actor="worker:w1@host") == [True, True, True]
    for (task_id, _, _), outcome in zip(ran, outcomes, strict=True):
        record = store.get(task_id)
        assert record.state is outcome.to
        assert record.reason == outcome.reason
        assert record.finished_at is not None and record.finished_at >= record.started_at
        last = store.history(task_id)[-1]
        assert (last.from_state, last.to_state) == (S.RUNNING, outcome.to)
        assert (last.reason, last.actor, last.attempt) == (
            outcome.reason,
            "worker:w1@host",
            outcome.lease.attempt,
        )
    assert store.get(ran[0][0]).result == {"n": 1}
    assert store.get(ran[1][0]).error == "ValueError: bad"


def test_a_lost_lease_in_a_batch_is_skipped_and_the_others_are_written(store):
    lost_id, stale, owner = running(store)
    recover(store, lost_id, owner)
    before = snapshot(store, lost_id)
    kept_id, kept, _ = running(store)

    answers = store.finish_many(
        [
            Outcome(stale, S.SUCCEEDED, "late", result="1"),
            Outcome(kept, S.SUCCEEDED, "succeeded", result="2"),
        ],
        actor="w",
    )
    assert answers == [False, True]
    assert snapshot(store, lost_id) == before
    assert store.get(kept_id).state is S.SUCCEEDED and store.get(kept_id).result == 2


def test_two_attempts_of_one_task_in_a_batch_write_only_the_owner(store):
    task_id, stale, owner = running(store)
    fresh = recover(store, task_id, owner)
    answers = store.finish_many(
        [Outcome(stale, S.FAILED, "old", error="x"), Outcome(fresh, S.SUCCEEDED, "new")],
        actor="w",
    )
    assert answers == [False, True]
    assert store.get(task_id).state is S.SUCCEEDED
    assert trail(store, task_id)[-1] == (S.RUNNING, S.SUCCEEDED)


def test_an_owner_over_max_runtime_still_finishes_from_wait_manual(store):
    task_id, lease, _ = running(store, max_runtime=0.05)
    wait_until(lambda: task_id in store.overrun(actor="reaper"))
    assert store.get(task_id).state is S.WAIT_MANUAL
    assert store.finish_many([Outcome(lease, S.SUCCEEDED, "succeeded")], actor="w") == [True]
    assert trail(store, task_id)[-1] == (S.WAIT_MANUAL, S.SUCCEEDED)


def test_a_state_a_batch_does_not_write_raises_and_changes_nothing(store):
    task_id, lease, _ = running(store)
    other_id, other, _ = running(store)
    before = (snapshot(store, task_id), snapshot(store, other_id))
    with pytest.raises(IllegalTransition):
        store.finish_many(
            [Outcome(other, S.SUCCEEDED, "ok"), Outcome(lease, S.PENDING, "nonsense")], actor="w"
        )
    assert (snapshot(store, task_id), snapshot(store, other_id)) == before
    assert store.finish_many([], actor="w") == []


def test_listeners_hear_each_transition_of_a_batch_once(store):
    heard = []
    store.listeners.append(lambda events: heard.append(list(events)))
    ran = [running(store) for _ in range(4)]
    heard.clear()
    store.finish_many([Outcome(lease, S.SUCCEEDED, "succeeded") for _, lease, _ in ran], actor="w")
    assert len(heard) == 1  # one commit
    assert sorted((e.task_id, e.from_state, e.to_state, e.attempt) for e in heard[0]) == sorted(
        (task_id, S.RUNNING, S.SUCCEEDED, lease.attempt) for task_id, lease, _ in ran
    )
    assert all(e.name == "tests.job" and e.actor == "w" for e in heard[0])


def test_a_batch_is_one_statement_on_postgresql_and_one_transaction_on_sqlite(store):
    small = [running(store) for _ in range(2)]
    large = [running(store) for _ in range(50)]
    seen = {}
    for label, batch in (("small", small), ("large", large)):
        with Statements(store.engine) as counted:
            answers = store.finish_many(
                [Outcome(lease, S.SUCCEEDED, "succeeded") for _, lease, _ in batch], actor="w"
            )
        assert all(answers)
        seen[label] = counted
    if store.is_pg:
        # the same prepared statement whatever the batch size; autocommit: no COMMIT
        assert seen["small"].statements == seen["large"].statements == ["WITH"]
    else:
        for counted in seen.values():
            assert counted.commits == 1
    for task_id, _, _ in small + large:
        assert store.get(task_id).state is S.SUCCEEDED


# -- retries in batches --------------------------------------------------------------------


def retry_of(lease, delay=0.0, n=1, message='{"v": 1, "retry": true}'):
    return Outcome(
        lease,
        S.RETRY_WAIT,
        f"retry {n} of 3, due in {delay:.3g} s",
        None,
        "Flaky: try",
        delay,
        message,
    )


def test_a_batch_of_retries_makes_each_row_pending_with_its_message_and_audit_rows(store):
    ran = [running(store) for _ in range(3)]
    before = {task_id: store.get(task_id).message for task_id, _, _ in ran}
    retries = [
        retry_of(ran[0][1], 0.0, message='{"v": 1, "n": 0}'),
        retry_of(ran[1][1], 30.0, message='{"v": 1, "n": 1}'),
        retry_of(ran[2][1], 0.0, message=None),  # keeps the row's message
    ]
    assert store.retry_many(retries, actor="worker:w1@host") == [True, True, True]
    for (task_id, lease, _), retry in zip(ran, retries, strict=True):
        record = store.get(task_id)
        assert (record.state, record.retries, record.error) == (S.PENDING, 1, "Flaky: try")
        assert record.published_at is None and record.next_retry_at is None
        assert record.message == (retry.message or before[task_id])
        history = store.history(task_id)[-2:]
        assert [(h.from_state, h.to_state) for h in history] == [
            (S.RUNNING, S.RETRY_WAIT),
            (S.RETRY_WAIT, S.PENDING),
        ]
        assert [h.reason for h in history] == [retry.reason, "retry published by its worker"]
        assert {(h.actor, h.attempt) for h in history} == {("worker:w1@host", lease.attempt)}
    # due in database time: the first at once, the second in 30 s
    owner = ran[0][2]
    assert isinstance(store.claim(ran[0][0], owner, "worker:w1@host"), Claim)
    early = store.claim(ran[1][0], owner, "worker:w1@host")
    assert isinstance(early, Refusal) and early.early
    # the row is its outbox: unpublished, the reaper's grace sweep would publish it
    assert store.take_due_retries(actor="reaper") == []


def test_a_lost_lease_in_a_batch_of_retries_is_skipped(store):
    lost_id, stale, owner = running(store)
    recover(store, lost_id, owner)
    before = snapshot(store, lost_id)
    kept_id, kept, _ = running(store)
    answers = store.retry_many([retry_of(stale), retry_of(kept)], actor="w")
    assert answers == [False, True]
    assert snapshot(store, lost_id) == before
    assert store.get(kept_id).state is S.PENDING


def test_a_batch_of_retries_takes_nothing_but_retries(store):
    task_id, lease, _ = running(store)
    before = snapshot(store, task_id)
    with pytest.raises(IllegalTransition):
        store.retry_many([retry_of(lease), Outcome(lease, S.SUCCEEDED, "ok")], actor="w")
    assert snapshot(store, task_id) == before
    assert store.retry_many([], actor="w") == []


def test_a_batch_of_retries_is_one_statement_on_postgresql_and_one_transaction_on_sqlite(store):
    heard = []
    store.listeners.append(lambda events: heard.append(list(events)))
    for size in (2, 40):
        batch = [running(store) for _ in range(size)]
        heard.clear()
        with Statements(store.engine) as counted:
            assert all(store.retry_many([retry_of(lease) for _, lease, _ in batch], actor="w"))
        if store.is_pg:
            assert counted.statements == ["WITH"]
        else:
            assert counted.commits == 1
        assert len(heard) == 1  # one commit: listeners hear both transitions of each row
        assert sorted((e.task_id, e.from_state, e.to_state) for e in heard[0]) == sorted(
            (task_id, frm, to)
            for task_id, _, _ in batch
            for frm, to in ((S.RUNNING, S.RETRY_WAIT), (S.RETRY_WAIT, S.PENDING))
        )


# -- the outcome writer: hand-over from a forked pool process, back-pressure -------------


def make_writer(store, app=None, **overrides):
    from celery import Celery

    from celery_lease.worker.main.outcome_writer import OutcomeWriter

    options = {"batch_size": 100, "flush_interval": 0.0, "buffer": 1000, "hand_over_timeout": 5.0}
    options.update(overrides)
    app = app or Celery("writer-test", set_as_current=False)
    return app, OutcomeWriter(app, store, "worker:w1@host", **options)


def test_outcomes_handed_over_by_a_forked_child_outlive_it_and_are_written(store):
    import multiprocessing

    ran = [running(store) for _ in range(5)]
    _app, writer = make_writer(store)
    outcomes = [
        Outcome(lease, S.SUCCEEDED, "succeeded", result=str(i))
        for i, (_, lease, _) in enumerate(ran)
    ]

    def child():
        for outcome in outcomes:
            assert writer.hand_over(outcome, "tests.job")

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0  # the child is gone before anything was written
    assert all(store.get(task_id).state is S.RUNNING for task_id, _, _ in ran)

    writer.flush()
    assert (writer.written, writer.rejected) == (5, 0)
    for i, (task_id, _, _) in enumerate(ran):
        record = store.get(task_id)
        assert record.state is S.SUCCEEDED and record.result == i
        assert store.history(task_id)[-1].actor == "worker:w1@host"
    writer.close()


def test_the_writer_thread_writes_what_arrives_and_logs_a_lost_lease(store):
    import logging

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__()
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    # on the writer's own logger, enabled: an in-process worker of another test may
    # have configured logging (propagation, levels, disabled loggers)
    heard = Lines()
    log = logging.getLogger("celery_lease")
    saved = (log.disabled, log.level)
    log.disabled = False
    log.setLevel(logging.WARNING)
    log.addHandler(heard)
    try:
        lost_id, stale, owner = running(store)
        recover(store, lost_id, owner)
        kept_id, kept, _ = running(store)
        _app, writer = make_writer(store, flush_interval=0.01)
        writer.start()
        assert writer.hand_over(Outcome(stale, S.SUCCEEDED, "late"), "tests.job")
        assert writer.hand_over(Outcome(kept, S.CANCELLED, "cancelled: asked"), "tests.job")
        wait_until(lambda: writer.written + writer.rejected == 2)
        assert (writer.written, writer.rejected) == (1, 1)
        assert store.get(kept_id).state is S.CANCELLED
        assert store.get(lost_id).state is not S.SUCCEEDED
        assert any(
            f"tests.job[{lost_id}] attempt {stale.attempt}: outcome" in line
            and "rejected, the lease was lost" in line
            for line in heard.lines
        ), heard.lines
        assert writer.close() == 0
    finally:
        log.removeHandler(heard)
        log.disabled, log.level = saved


def test_a_writer_that_cannot_keep_up_holds_the_hand_over_back(store):
    # nothing reads the socket (the writer's buffer is full, or its thread never runs):
    # the hand-over blocks, and gives up after its timeout, rather than queue forever
    _, lease, _ = running(store)
    _app, writer = make_writer(store, buffer=1, batch_size=1, hand_over_timeout=0.2)
    handed = 0
    big = Outcome(lease, S.SUCCEEDED, "succeeded", result='"' + "x" * 60_000 + '"')
    for _ in range(10_000):
        if not writer.hand_over(big, "tests.job"):
            break
        handed += 1
    else:
        pytest.fail("10,000 outcomes of 60 kB were queued without the hand-over blocking")
    assert handed > 0
    writer.close()  # the first is written, the copies are rejected by the fence
    assert writer.written == 1 and writer.rejected == handed - 1
    assert store.get(lease.task_id).state is S.SUCCEEDED


def test_hand_over_writes_through_what_it_must(store):
    from types import SimpleNamespace

    from celery_lease.worker.protocol import hand_over

    _, lease, _ = running(store)
    app, writer = make_writer(store)
    plain = SimpleNamespace(chord=None, callbacks=None, errbacks=None, chain=None)
    linked = SimpleNamespace(chord=None, callbacks=[{"task": "x"}], errbacks=None, chain=None)
    ok = Outcome(lease, S.SUCCEEDED, "succeeded")
    # in the writer's own process (solo, threads, an in-process test worker): through
    assert not hand_over(app, plain, False, "tests.job", ok)
    writer.owner = -1  # as a forked pool process sees it
    assert hand_over(app, plain, False, "tests.job", ok)
    assert not hand_over(app, plain, True, "tests.job", ok)  # self-fenced
    assert not hand_over(app, linked, False, "tests.job", ok)  # follow-ups need the row
    # a run holding a concurrency slot: its outcome frees the slot before the next claim
    assert not hand_over(app, plain, False, "tests.job", ok, holds_slot=True)
    assert not hand_over(app, plain, False, "tests.job", retry_of(lease), holds_slot=True)
    assert not hand_over(app, plain, False, "tests.job", Outcome(lease, S.FAILED, "raised"))
    # a retry carries its message, which the writer publishes after the row; Celery runs
    # no follow-up on a retry, so a task with callbacks hands it over too
    assert hand_over(app, plain, False, "tests.job", retry_of(lease))
    assert hand_over(app, linked, False, "tests.job", retry_of(lease))
    assert not hand_over(app, plain, False, "tests.job", retry_of(lease, message=None))
    huge = Outcome(lease, S.SUCCEEDED, "succeeded", result='"' + "x" * 300_000 + '"')
    assert not hand_over(app, plain, False, "tests.job", huge)  # larger than one hand-over
    writer.close()
    assert not hand_over(app, plain, False, "tests.job", ok)  # closed: write through


def retry_app(broker_url):
    from celery import Celery

    app = Celery("writer-retry-test", broker=broker_url, set_as_current=False)
    app.conf.update(
        broker_connection_retry=False, task_publish_retry=False, broker_connection_timeout=0.5
    )

    @app.task(name="tests.job", shared=False)
    def job(n):
        return n

    return app, job


def test_the_writer_publishes_a_retry_after_writing_its_row(store, redis_url):
    import json as json_
    import uuid

    import redis

    from celery_lease.producer import message as _message

    app, job = retry_app(redis_url)
    queue = f"writer-retry-{uuid.uuid4().hex[:8]}"
    (soon_id, soon, _), (later_id, later, _) = running(store), running(store)
    messages = {
        task_id: _message.build(job, (1,), {}, task_id, queue=queue).stored()
        for task_id in (soon_id, later_id)
    }
    _, writer = make_writer(store, app)
    assert writer.hand_over(retry_of(soon, 0.0, message=messages[soon_id]), "tests.job")
    assert writer.hand_over(retry_of(later, 60.0, message=messages[later_id]), "tests.job")
    writer.flush()
    assert (writer.written, writer.rejected, writer.unpublished) == (2, 0, 0)

    client = redis.Redis.from_url(redis_url)
    try:
        sent = [json_.loads(raw) for raw in client.lrange(queue, 0, -1)]
    finally:
        client.delete(queue)
        client.close()
    headers = {m["headers"]["id"]: m["headers"] for m in sent}
    assert set(headers) == {soon_id, later_id}  # one message each, sent after its row
    assert headers[soon_id]["eta"] is None
    # the rest of its countdown: due in about a minute, by the message's ETA
    eta = datetime.fromisoformat(headers[later_id]["eta"])
    assert 50 < (eta - datetime.now(timezone.utc)).total_seconds() <= 60
    # the message is never due before its row (a claim then would be refused as early)
    assert eta >= store.get(later_id).eta
    for task_id in (soon_id, later_id):
        record = store.get(task_id)
        assert record.state is S.PENDING and record.retries == 1
        wait_until(lambda task_id=task_id: store.get(task_id).published_at is not None)
    writer.close()


def test_a_retry_the_writer_cannot_publish_stays_in_its_row_for_the_reaper(store):
    from celery_lease.producer import message as _message

    app, job = retry_app("redis://127.0.0.1:1/0")  # nothing listens there
    task_id, lease, _ = running(store)
    message = _message.build(job, (1,), {}, task_id).stored()
    _, writer = make_writer(store, app)
    assert writer.hand_over(retry_of(lease, 0.0, message=message), "tests.job")
    writer.flush()  # the broker's error is not the writer's: nothing is lost
    assert (writer.written, writer.unpublished) == (1, 1)
    record = store.get(task_id)
    assert record.state is S.PENDING and record.published_at is None
    assert record.message == message  # what the reaper publishes after the grace
    writer.close()
