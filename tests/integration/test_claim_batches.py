"""The store's batched claims (``Store.claim_many``), on SQLite and PostgreSQL.

A batch claims every eligible PENDING row of its asks with its audit row, in one
statement (PostgreSQL) or one transaction (SQLite); what it does not claim is left
exactly as it was, for the pool process's own claim to decide.
"""

from __future__ import annotations

import dataclasses
import uuid
from datetime import UTC, datetime, timedelta

from celery_lease.states import State

from .test_outcome_batches import Statements
from .test_store_contract import claim, register, running, snapshot, submit, trail

S = State


def _token() -> str:
    return uuid.uuid4().hex


def test_a_batch_claims_every_due_row_with_its_audit_row(store):
    owner = register(store)
    ids = [submit(store) for _ in range(3)]
    asks = [(task_id, _token()) for task_id in ids]
    claims = store.claim_many(asks, owner, "worker:w1@host")
    assert sorted(claims) == sorted(token for _, token in asks)
    for task_id, token in asks:
        got = claims[token]
        assert (got.lease.task_id, got.lease.attempt, got.lease.token) == (task_id, 1, token)
        assert (got.retries, got.recoveries, got.resumed, got.cancel_requested) == (
            0,
            0,
            False,
            False,
        )
        record = store.get(task_id)
        assert record.state is S.RUNNING and record.owner == owner and record.attempt == 1
        last = store.history(task_id)[-1]
        assert (last.from_state, last.to_state, last.actor, last.attempt) == (
            S.PENDING,
            S.RUNNING,
            "worker:w1@host",
            1,
        )
        assert last.reason == "claimed ahead by worker:w1@host"
    # the lease is a real one: its outcome is accepted, fenced by the batch's token
    assert store.finish(claims[asks[0][1]].lease, S.SUCCEEDED, actor="worker:w1@host", reason="ok")
    assert store.get(ids[0]).state is S.SUCCEEDED


def test_rows_a_batch_must_not_claim_are_left_as_they_are(store):
    owner = register(store)
    running_id, _, _ = running(store)
    early = submit(store, eta=datetime.now(UTC) + timedelta(hours=1))
    manual = submit(store, on_timeout="manual")
    limited = submit(store, max_runtime=30.0)
    finished_id, lease, _ = running(store)
    store.finish(lease, S.SUCCEEDED, actor="worker", reason="done")
    skipped = [running_id, early, manual, limited, finished_id, "no-such-task"]
    before = {task_id: snapshot(store, task_id) for task_id in skipped}
    due = submit(store)
    asks = [(task_id, _token()) for task_id in [*skipped, due]]

    claims = store.claim_many(asks, owner, "worker:w1@host")

    assert [c.lease.task_id for c in claims.values()] == [due]
    assert {task_id: snapshot(store, task_id) for task_id in skipped} == before
    # the pool process's own claim still decides each of them, as without batching
    assert claim(store, manual, owner).lease.attempt == 1
    assert claim(store, limited, owner).lease.attempt == 1


def test_two_deliveries_of_one_task_in_a_batch_claim_it_once(store):
    owner = register(store)
    task_id = submit(store)
    first, second = _token(), _token()
    claims = store.claim_many([(task_id, first), (task_id, second)], owner, "worker:w1@host")
    assert len(claims) == 1
    (token,) = claims
    other = second if token == first else first
    assert store.get(task_id).attempt == 1
    lease = claims[token].lease
    # only the token the row took holds the lease
    assert not store.finish(
        dataclasses.replace(lease, token=other), S.SUCCEEDED, actor="w", reason="x"
    )
    assert store.finish(lease, S.SUCCEEDED, actor="w", reason="ok")
    assert trail(store, task_id) == [
        (None, S.PENDING),
        (S.PENDING, S.RUNNING),
        (S.RUNNING, S.SUCCEEDED),
    ]


def test_a_batch_is_one_statement_on_postgresql_and_one_transaction_on_sqlite(store):
    owner = register(store)
    ids = [submit(store) for _ in range(50)]
    with Statements(store.engine) as seen:
        claims = store.claim_many([(i, _token()) for i in ids], owner, "worker:w1@host")
    assert len(claims) == 50
    if store.is_pg:
        assert seen.statements == ["WITH"]  # autocommit: the statement is its transaction
    else:
        assert seen.commits == 1


def test_a_claim_given_back_is_retried_at_once_with_no_recovery_counted(store):
    owner = register(store)
    task_id = submit(store)
    token = _token()
    lease = store.claim_many([(task_id, token)], owner, "worker:w1@host")[token].lease
    # fenced: another token, another owner or another attempt gives nothing back
    for wrong in (
        dataclasses.replace(lease, token=_token()),
        dataclasses.replace(lease, attempt=2),
    ):
        assert not store.unclaim(wrong, owner, "worker:w1@host", "given back")
    assert not store.unclaim(lease, register(store), "worker:w2@host", "given back")
    assert store.get(task_id).state is S.RUNNING

    assert store.unclaim(lease, owner, "worker:w1@host", "claimed ahead, and dropped")
    record = store.get(task_id)
    assert record.state is S.RETRY_WAIT and record.recoveries == 0 and record.attempt == 1
    assert record.next_retry_at is not None  # due now: the reaper publishes it again
    assert trail(store, task_id)[-2:] == [(S.RUNNING, S.TIMEOUT), (S.TIMEOUT, S.RETRY_WAIT)]
    ended = store.history(task_id)[-2]
    assert ended.reason is not None and "no recovery counted" in ended.reason
    # the lease is gone: the claim's outcome is refused, and it cannot be given back twice
    assert not store.finish(lease, S.SUCCEEDED, actor="worker:w1@host", reason="late")
    assert not store.unclaim(lease, owner, "worker:w1@host", "again")


def test_a_claim_whose_cancel_was_requested_is_not_given_back(store):
    owner = register(store)
    task_id = submit(store)
    token = _token()
    lease = store.claim_many([(task_id, token)], owner, "worker:w1@host")[token].lease
    store.request_cancel(task_id, actor="ops", reason="withdrawn")
    assert not store.unclaim(lease, owner, "worker:w1@host", "given back")
    assert store.get(task_id).state is S.RUNNING  # the lease's expiry decides (cancelled)
