"""Issue 14, bulk operator actions: filters on retry / fail / resolve / cancel, a dry
run, a required reason, batched transactions that stop cleanly on the first task the
table refuses; from the API and ``celery lease``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from celery.bin.base import CLIContext
from click.testing import CliRunner

from celery_lease import State
from celery_lease.cli import lease

from .test_cli_support import Ops, ops_fixture  # noqa: F401  (the ops fixture)


def manual(ops: Ops, n: int) -> list[str]:
    """``n`` WAIT_MANUAL tasks, oldest first, all with the same reason."""
    return [ops.wait_manual() for _ in range(n)]


def test_fail_every_task_with_the_same_reason(ops: Ops) -> None:
    stuck = manual(ops, 5)
    other = ops.wait_manual(step=None)  # WAIT_MANUAL for another reason
    reason = ops.store.get(stuck[0]).reason  # type: ignore[union-attr]
    assert "charge" in reason and "charge" not in (ops.store.get(other).reason or "")  # type: ignore[union-attr]

    dry = ops.admin.bulk("fail", reason_contains="charge", reason="partner lost them", dry_run=True)
    assert dry.dry_run and dry.batches == 0 and dry.refused is None
    assert [c.id for c in dry.changed] == stuck
    assert {(c.from_state, c.to_state) for c in dry.changed} == {(State.WAIT_MANUAL, State.FAILED)}
    assert all(ops.state(t) is State.WAIT_MANUAL for t in stuck)  # nothing changed

    done = ops.admin.bulk(
        "fail", reason_contains="charge", reason="partner lost them", actor="alice", batch=2
    )
    assert done.refused is None and done.batches == 3 and len(done.changed) == 5
    for task_id in stuck:
        assert ops.state(task_id) is State.FAILED
        last = ops.store.history(task_id)[-1]
        assert (last.actor, last.reason) == ("alice", "partner lost them")
    assert ops.state(other) is State.WAIT_MANUAL


def test_a_refused_task_stops_the_action_and_leaves_it_and_the_rest(ops: Ops) -> None:
    first = manual(ops, 3)
    done_already = ops.finished(State.SUCCEEDED, "ops.charge")
    after = manual(ops, 2)
    # by task name: oldest first, three WAIT_MANUAL, then a SUCCEEDED one, then two more
    dry = ops.admin.bulk("resolve", name="ops.charge", reason="done by hand", dry_run=True)
    assert [c.id for c in dry.changed] == first
    assert dry.refused is not None and dry.refused.id == done_already
    assert dry.refused.state is State.SUCCEEDED and "does not apply" in dry.refused.why

    done = ops.admin.bulk(
        "resolve", name="ops.charge", reason="done by hand", result={"by": "hand"}, batch=2
    )
    assert [c.id for c in done.changed] == first and done.batches == 2
    assert done.refused is not None and done.refused.id == done_already
    for task_id in first:
        record = ops.store.get(task_id)
        assert record is not None and record.state is State.SUCCEEDED
        assert record.result == {"by": "hand"}
    assert ops.state(done_already) is State.SUCCEEDED
    assert all(ops.state(t) is State.WAIT_MANUAL for t in after)  # left as they were


def test_retry_and_cancel_in_bulk(ops: Ops) -> None:
    stuck = manual(ops, 3)
    done = ops.admin.bulk("retry", state="WAIT_MANUAL", reason="partner back", limit=2)
    assert [c.id for c in done.changed] == stuck[:2] and done.refused is None
    for task_id in stuck[:2]:
        record = ops.store.get(task_id)
        assert record is not None and record.state is State.PENDING
        assert record.published_at is not None  # published again
    assert ops.state(stuck[2]) is State.WAIT_MANUAL

    running = [ops.running() for _ in range(2)]
    pending = ops.submit()
    done = ops.admin.bulk("cancel", name="ops.add", reason="not needed any more")
    assert done.refused is None
    by_id = {c.id: c for c in done.changed}
    assert all(by_id[t].requested and by_id[t].to_state is State.RUNNING for t in running)
    assert by_id[pending].to_state is State.CANCELLED and ops.state(pending) is State.CANCELLED
    for task_id in running:
        record = ops.store.get(task_id)
        assert record is not None and record.cancel_requested_at is not None


def test_bulk_needs_a_reason_a_filter_and_a_known_action(ops: Ops) -> None:
    manual(ops, 1)
    for kwargs in (
        {"action": "fail", "state": "WAIT_MANUAL", "reason": " "},
        {"action": "fail", "reason": "why"},  # no filter at all
        {"action": "explode", "state": "WAIT_MANUAL", "reason": "why"},
        {"action": "fail", "state": "NOPE", "reason": "why"},
    ):
        with pytest.raises(ValueError):
            ops.admin.bulk(**kwargs)


def run(ops: Ops, *args: str) -> Any:
    obj = CLIContext(app=ops.app, no_color=True, workdir=None, quiet=True)
    return CliRunner().invoke(lease, list(args), obj=obj)


def test_the_commands_take_filters(ops: Ops) -> None:
    stuck = manual(ops, 3)
    dry = run(ops, "fail", "--reason-contains", "charge", "--reason", "lost", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert all(t in dry.output for t in stuck) and "would change 3 task(s)" in dry.output
    assert all(ops.state(t) is State.WAIT_MANUAL for t in stuck)

    as_json = run(ops, "fail", "-s", "wait_manual", "-r", "lost", "--dry-run", "--json")
    assert [c["id"] for c in json.loads(as_json.output)["changed"]] == stuck

    # usage: ids or filters, not both; a reason with filters; --dry-run with filters
    assert run(ops, "retry", stuck[0], "--state", "WAIT_MANUAL", "-r", "x").exit_code == 2
    assert run(ops, "retry", "--state", "WAIT_MANUAL").exit_code == 2
    assert run(ops, "retry", stuck[0], "--dry-run").exit_code == 2
    assert run(ops, "retry").exit_code == 2

    ops.finished(State.SUCCEEDED, "ops.charge")
    manual(ops, 1)
    done = run(ops, "fail", "--name", "ops.charge", "--reason", "lost", "--batch", "2")
    assert done.exit_code == 1, done.output  # stopped at the SUCCEEDED task
    assert "changed 3 task(s) in 2 transaction(s)" in done.output
    assert "stopped at" in done.output
    assert all(ops.state(t) is State.FAILED for t in stuck)
    # the ids form still works as before
    one = ops.wait_manual()
    assert run(ops, "fail", one, "--reason", "by id").exit_code == 0
    assert ops.state(one) is State.FAILED
