"""The operator API (``celery_lease.admin(app)``) against a real database (SQLite and
PostgreSQL): every decision is a legal transition with actor and reason in the audit
trail; an illegal or unknown request raises and changes nothing."""

from __future__ import annotations

import json

import pytest

from celery_lease import IllegalTransition, State, TaskNotFound
from celery_lease.operations import percentile

from .test_cli_support import Ops, ops_fixture  # noqa: F401  (the ops fixture)


def last_audit(ops: Ops, task_id: str) -> tuple[str, str, str | None]:
    row = ops.store.history(task_id)[-1]
    return row.to_state.value, row.actor, row.reason


def test_retry_keeps_done_steps_drops_unknown_ones_and_republishes(ops: Ops) -> None:
    task_id = ops.wait_manual()
    assert ops.state(task_id) is State.WAIT_MANUAL

    left = ops.admin.retry(task_id, actor="alice", reason="PSP says: not charged")

    assert left is State.WAIT_MANUAL
    record = ops.store.get(task_id)
    assert record is not None
    assert record.state is State.PENDING
    assert record.published_at is not None  # re-published, not waiting for the reaper
    steps = {s.name: s.state for s in ops.store.steps(task_id)}
    assert steps == {"reserve": "DONE"}  # the unknown 'charge' step will run again
    assert last_audit(ops, task_id) == ("PENDING", "alice", "PSP says: not charged")


def test_fail_and_resolve_record_actor_reason_and_result(ops: Ops) -> None:
    failed, resolved = ops.wait_manual(), ops.wait_manual()

    assert ops.admin.fail(failed, actor="bob", reason="customer cancelled") is State.WAIT_MANUAL
    assert (
        ops.admin.resolve(resolved, actor="carol", reason="charged by hand", result={"ref": 7})
        is State.WAIT_MANUAL
    )

    f, r = ops.store.get(failed), ops.store.get(resolved)
    assert f is not None and r is not None
    assert (f.state, f.error) == (State.FAILED, "customer cancelled")
    assert (r.state, r.result) == (State.SUCCEEDED, {"ref": 7})
    assert last_audit(ops, failed) == ("FAILED", "bob", "customer cancelled")
    assert last_audit(ops, resolved) == ("SUCCEEDED", "carol", "charged by hand")


def test_actor_defaults_to_the_os_user(ops: Ops) -> None:
    import getpass

    task_id = ops.wait_manual()
    ops.admin.fail(task_id, reason="no")
    assert last_audit(ops, task_id)[1] == getpass.getuser()


@pytest.mark.parametrize(
    ("setup", "action"),
    [
        ("succeeded", "retry"),
        ("succeeded", "cancel"),
        ("succeeded", "fail"),
        ("running", "resolve"),
        ("running", "retry"),
        ("pending", "fail"),
        ("pending", "resolve"),
        ("cancelled", "retry"),  # CANCELLED is terminal (DESIGN.md)
        ("failed", "resolve"),
    ],
)
def test_illegal_requests_raise_and_change_nothing(ops: Ops, setup: str, action: str) -> None:
    task_id = {
        "succeeded": lambda: ops.finished(State.SUCCEEDED),
        "running": lambda: ops.running(),
        "pending": lambda: ops.submit(),
        "cancelled": lambda: ops.submit(),
        "failed": lambda: ops.finished(State.FAILED),
    }[setup]()
    if setup == "cancelled":
        ops.admin.cancel(task_id, reason="setup")
    before = (ops.store.get(task_id), ops.store.history(task_id), ops.store.steps(task_id))

    call = {
        "retry": lambda: ops.admin.retry(task_id, reason="r"),
        "cancel": lambda: ops.admin.cancel(task_id, reason="r"),
        "fail": lambda: ops.admin.fail(task_id, reason="r"),
        "resolve": lambda: ops.admin.resolve(task_id, reason="r"),
    }[action]
    with pytest.raises(IllegalTransition) as info:
        call()

    assert info.value.task_id == task_id
    assert info.value.from_state is before[0].state  # type: ignore[union-attr]
    after = (ops.store.get(task_id), ops.store.history(task_id), ops.store.steps(task_id))
    assert after == before


def test_unknown_ids_raise_task_not_found(ops: Ops) -> None:
    api = ops.admin
    for call in (
        lambda: api.retry("nope", reason="r"),
        lambda: api.fail("nope", reason="r"),
        lambda: api.resolve("nope", reason="r"),
        lambda: api.cancel("nope"),
        lambda: api.history("nope"),
        lambda: api.steps("nope"),
    ):
        with pytest.raises(TaskNotFound):
            call()
    assert api.get("nope") is None


def test_fail_and_resolve_need_a_reason(ops: Ops) -> None:
    task_id = ops.wait_manual()
    with pytest.raises(ValueError, match="reason"):
        ops.admin.fail(task_id, reason="  ")
    assert ops.state(task_id) is State.WAIT_MANUAL


def test_cancel_pending_at_once_and_running_cooperatively(ops: Ops) -> None:
    pending, running = ops.submit(), ops.running()

    assert ops.admin.cancel(pending, actor="dan", reason="duplicate order") is State.PENDING
    assert ops.admin.cancel(running, actor="dan", reason="duplicate order") is State.RUNNING

    assert ops.state(pending) is State.CANCELLED
    assert last_audit(ops, pending) == ("CANCELLED", "dan", "duplicate order")
    record = ops.store.get(running)
    assert record is not None
    assert record.state is State.RUNNING  # it stops at its next step boundary
    assert (record.cancel_actor, record.cancel_reason) == ("dan", "duplicate order")
    assert record.cancel_requested_at is not None


def test_list_filters_by_state_name_age_and_worker(ops: Ops) -> None:
    waiting = ops.wait_manual(nodename="node-a@ops-test")
    pending = ops.submit("ops.add")
    running = ops.running("ops.add", nodename="node-b@ops-test")
    api = ops.admin

    assert [r.id for r in api.tasks(state="wait_manual")] == [waiting]
    assert [r.id for r in api.tasks(state=State.PENDING)] == [pending]
    assert {r.id for r in api.tasks(name="ops.add")} == {pending, running}
    assert [r.id for r in api.tasks(worker="node-b@ops-test")] == [running]
    record = ops.store.get(running)
    assert record is not None and record.owner is not None
    assert [r.id for r in api.tasks(worker=record.owner)] == [running]
    assert api.tasks(older_than=3600) == []
    assert len(api.tasks(limit=2)) == 2
    assert [r.id for r in api.tasks()] == [running, pending, waiting]  # newest first
    with pytest.raises(ValueError, match="unknown state"):
        api.tasks(state="STUCK")
    with pytest.raises(ValueError):
        api.tasks(limit=0)


def test_stats_counts_ages_durations_and_rates(ops: Ops) -> None:
    for _ in range(3):
        ops.finished(State.SUCCEEDED)
    ops.finished(State.FAILED)
    cancelled = ops.submit()
    ops.admin.cancel(cancelled, reason="not needed")
    ops.submit()  # pending
    zombie = ops.running()
    record = ops.store.get(zombie)
    assert record is not None and record.owner is not None
    ops.store.stop_worker(record.owner, "gone")  # its lease is expired, nobody reaped it

    stats = ops.admin.stats(window=600)

    assert stats.counts[State.SUCCEEDED] == 3
    assert stats.counts[State.PENDING] == 1
    assert stats.running == 1
    assert stats.expired_unreaped == 1
    assert stats.oldest_pending_age is not None and stats.oldest_pending_age >= 0
    assert stats.finished == 5
    assert stats.failure_rate == pytest.approx(1 / 5)
    assert stats.cancel_rate == pytest.approx(1 / 5)
    assert stats.run_p50 is not None and stats.run_p99 is not None
    assert 0 <= stats.run_p50 <= stats.run_p99
    assert json.loads(json.dumps(stats.as_dict()))["counts"]["FAILED"] == 1
    with pytest.raises(ValueError):
        ops.admin.stats(window=0)


def test_stats_of_an_empty_store(ops: Ops) -> None:
    stats = ops.admin.stats()
    assert set(stats.counts.values()) == {0}
    assert stats.oldest_pending_age is None
    assert (stats.finished, stats.run_p50, stats.failure_rate) == (0, None, None)


def test_workers_report_liveness_and_tasks_owned(ops: Ops) -> None:
    ops.running(nodename="busy@ops-test")
    ops.running(nodename="busy2@ops-test")
    gone_id, _ = ops.register_worker("gone@ops-test")
    ops.store.stop_worker(gone_id, "shutdown")

    by_node = {w.nodename: w for w in ops.admin.workers()}

    assert by_node["busy@ops-test"].running == 1
    assert not by_node["gone@ops-test"].alive
    assert by_node["gone@ops-test"].stop_reason == "shutdown"
    # alive is "not stopped, heartbeat younger than the TTL", and the test
    # configuration's TTL is 1 s, which a stall of a loaded machine between the
    # registration and the read can outlast: read with a horizon no stall reaches, so
    # that only the stop tells the two apart
    alive = {w.nodename: w.alive for w in ops.store.workers(ttl=3600.0)}
    assert alive["busy@ops-test"] and not alive["gone@ops-test"]


def test_purge_deletes_old_finished_rows_in_batches_and_frees_dedup_keys(ops: Ops) -> None:
    done = [ops.finished(State.SUCCEEDED) for _ in range(5)]
    failed = ops.finished(State.FAILED)
    keyed = ops.submit(dedup_key="order-42")
    ops.admin.cancel(keyed, reason="setup")
    waiting = ops.wait_manual()
    api = ops.admin
    assert api.purgeable(older_than=0) == 6

    batches: list[int] = []
    deleted = api.purge(older_than=0, batch=2, progress=batches.append)

    assert deleted == 6 and batches == [2, 2, 2]
    for task_id in [*done, keyed]:
        assert ops.store.get(task_id) is None
        assert ops.store.history(task_id) == []
        assert ops.store.steps(task_id) == []
    assert ops.state(failed) is State.FAILED  # FAILED only when asked for
    assert ops.state(waiting) is State.WAIT_MANUAL
    again = ops.submit(dedup_key="order-42")  # the key is free again
    assert again != keyed and ops.state(again) is State.PENDING

    assert api.purge(older_than=0, states=["FAILED"]) == 1
    assert api.purge(older_than=3600, states=["SUCCEEDED"]) == 0


def test_purge_refuses_live_states_and_bad_arguments(ops: Ops) -> None:
    waiting = ops.wait_manual()
    with pytest.raises(ValueError, match="finished tasks only"):
        ops.admin.purge(older_than=0, states=["WAIT_MANUAL"])
    with pytest.raises(ValueError):
        ops.admin.purge(older_than=-1)
    with pytest.raises(ValueError):
        ops.admin.purge(older_than=0, states=[])
    assert ops.state(waiting) is State.WAIT_MANUAL


def test_percentile_interpolates() -> None:
    assert percentile([], 0.5) is None
    assert percentile([4.0], 0.99) == 4.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
    assert percentile([float(i) for i in range(101)], 0.99) == pytest.approx(99.0)
