"""The invariant checker (``celery_lease.check``) on real SQLite and PostgreSQL stores.

Each violation kind is produced the way it would arise (a broken fence, a lost audit
row, a reaper that stopped running) by writing to the tables behind the library's
back, then the checker must name it; a clean history must give no violation at all.
Stores here are not the ``store`` fixture: its teardown audit check would (rightly)
fail on the corruption these tests make on purpose.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import insert, update

from celery_lease.check import KINDS, Violation, check, summarize
from celery_lease.states import State
from celery_lease.store import Claim, Lease, NewTask, Store
from celery_lease.store.schema import db_now

from ..helpers import lease_settings, wait_until


@pytest.fixture
def raw_store(lease_config: Callable[..., Any], harness: Any) -> Store:
    """A migrated store whose trail is *not* checked at teardown (tests corrupt it)."""
    store = harness.track(Store(lease_config()))
    store.migrate()
    return store


def new_task(**overrides: Any) -> NewTask:
    values: dict[str, Any] = {
        "id": uuid.uuid4().hex,
        "name": "tests.job",
        "args": "[]",
        "kwargs": "{}",
        "options": "{}",
        "lease_ttl": 1.0,
        "max_recoveries": 5,
    }
    values.update(overrides)
    return NewTask(**values)


def register(store: Store) -> str:
    worker_id = uuid.uuid4().hex
    store.register_worker(worker_id, f"w-{worker_id[:6]}@host", "host", os.getpid())
    return worker_id


def running(store: Store, owner: str | None = None, **overrides: Any) -> Lease:
    task_id, created = store.submit(new_task(**overrides))
    assert created
    store.mark_published([task_id])
    got = store.claim(task_id, owner or register(store), "worker:w@host")
    assert isinstance(got, Claim), got
    return got.lease


def kinds(violations: list[Violation]) -> dict[str, int]:
    assert all(v.kind in KINDS for v in violations), violations
    return summarize(violations)


def test_a_clean_history_has_no_violation(raw_store: Store) -> None:
    store = raw_store
    owner = register(store)
    ok = running(store, owner)
    store.step_started(ok, "pay", checkable=False)
    store.step_done(ok, "pay", "1", idempotent=False)
    store.step_done(ok, "mail", "2", idempotent=True)
    assert store.finish(ok, State.SUCCEEDED, actor="w", reason="done", result="3")

    # a lease lost with an idempotent step done, retried and finished by the next attempt
    lost = running(store, owner)
    store.step_done(lost, "a", "1", idempotent=True)
    (expiry,) = store.expire(actor="r", reason="t", task_ids=[lost.task_id], only_expired=False)
    assert expiry.to_state is State.RETRY_WAIT
    store.take_due_retries(actor="r")
    again = store.claim(lost.task_id, owner, "worker:w@host")
    assert isinstance(again, Claim)
    store.step_done(again.lease, "b", "2", idempotent=True)
    assert store.finish(again.lease, State.SUCCEEDED, actor="w", reason="done")

    # a non-idempotent step in flight at expiry: WAIT_MANUAL, as the design says
    unknown = running(store, owner)
    store.step_started(unknown, "charge", checkable=False)
    (expiry,) = store.expire(actor="r", reason="t", task_ids=[unknown.task_id], only_expired=False)
    assert expiry.to_state is State.WAIT_MANUAL

    assert check(store) == []


def test_illegal_transition_gap_and_state_mismatch(raw_store: Store) -> None:
    store = raw_store
    t, tr = store.t.tasks, store.t.transitions
    lease = running(store)
    assert store.finish(lease, State.SUCCEEDED, actor="w", reason="done")
    with store.engine.begin() as conn:
        # a SUCCEEDED task "re-run": a transition the table forbids, written by hand
        conn.execute(
            insert(tr).values(
                task_id=lease.task_id,
                from_state="SUCCEEDED",
                to_state="RUNNING",
                reason="bug",
                actor="nobody",
                attempt=1,
                at=db_now(),
            )
        )
    found = kinds(check(store))
    assert found["illegal_transition"] == 1
    assert found["state_mismatch"] == 1  # the row still says SUCCEEDED

    other = running(store)
    with store.engine.begin() as conn:
        # a state change without its audit row
        conn.execute(update(t).where(t.c.id == other.task_id).values(state="FAILED"))
    violations = check(store, task_ids=[other.task_id])
    assert [v.kind for v in violations] == ["state_mismatch"]
    assert violations[0].task_id == other.task_id


def test_audit_gap_and_bad_claim(raw_store: Store) -> None:
    store = raw_store
    tr = store.t.transitions
    lease = running(store)
    with store.engine.begin() as conn:
        # a second claim of the same attempt: two executions that both think they own it
        conn.execute(
            insert(tr).values(
                task_id=lease.task_id,
                from_state="PENDING",
                to_state="RUNNING",
                reason="double claim",
                actor="worker:w2@host",
                attempt=1,
                at=db_now(),
            )
        )
    found = kinds(check(store))
    assert found["audit_gap"] == 1  # RUNNING -> (PENDING -> RUNNING)
    assert found["bad_claim"] == 1
    assert found["attempt_mismatch"] == 1


def test_a_step_written_after_its_lease_was_lost(raw_store: Store) -> None:
    store = raw_store
    s = store.t.steps
    lease = running(store)
    store.step_done(lease, "early", "1", idempotent=True)  # inside the lease: fine
    store.expire(actor="r", reason="t", task_ids=[lease.task_id], only_expired=False)
    # the fenced write refuses now...
    fenced, _ = store.step_done(lease, "late", "2", idempotent=True)
    assert fenced is None
    # safety only: the expired task's retry comes due after a short backoff, and a
    # liveness check run past it (a loaded machine) rightly reports retry_overdue
    assert check(store, liveness=False) == []
    # ...a broken fence would have written it anyway
    with store.engine.begin() as conn:
        conn.execute(
            insert(s).values(
                task_id=lease.task_id,
                name="late",
                state="DONE",
                idempotent=True,
                attempt=lease.attempt,
                result="2",
                started_at=db_now(),
                finished_at=db_now(),
            )
        )
        conn.execute(
            insert(s).values(
                task_id=lease.task_id,
                name="ghost",
                state="DONE",
                idempotent=True,
                attempt=7,
                result="3",
                started_at=db_now(),
                finished_at=db_now(),
            )
        )
    violations = check(store, liveness=False)
    assert kinds(violations) == {"step_outside_lease": 1, "step_unclaimed_attempt": 1}
    assert "'late'" in next(v.detail for v in violations if v.kind == "step_outside_lease")


def test_rerun_after_an_unknown_outcome(raw_store: Store) -> None:
    store = raw_store
    s = store.t.steps
    lease = running(store)
    store.step_started(lease, "charge", checkable=False)
    # a policy bug would retry this task; simulate it by hiding the in-flight step
    # from the expiry (as if it were checkable), then restoring the row
    with store.engine.begin() as conn:
        conn.execute(update(s).where(s.c.task_id == lease.task_id).values(checkable=True))
    (expiry,) = store.expire(actor="r", reason="t", task_ids=[lease.task_id], only_expired=False)
    assert expiry.to_state is State.RETRY_WAIT
    with store.engine.begin() as conn:
        conn.execute(update(s).where(s.c.task_id == lease.task_id).values(checkable=False))
    assert kinds(check(store)) == {"rerun_after_unknown_outcome": 1}

    # an operator retry in between makes a new claim legitimate (and deletes the step)
    ok = running(store)
    store.step_started(ok, "charge", checkable=False)
    (expiry,) = store.expire(actor="r", reason="t", task_ids=[ok.task_id], only_expired=False)
    assert expiry.to_state is State.WAIT_MANUAL
    store.operator_move(ok.task_id, State.PENDING, actor="alice", reason="checked by hand")
    again = store.claim(ok.task_id, register(store), "worker:w@host")
    assert isinstance(again, Claim)
    assert check(store, task_ids=[ok.task_id], liveness=False) == []


def test_liveness_violations_need_the_reaper(raw_store: Store) -> None:
    store = raw_store
    t = store.t.tasks
    # RUNNING, owned by an incarnation that never registered (a dead worker)
    dead = running(store, owner="no-such-incarnation")
    # PENDING, never published
    unpublished, _ = store.submit(new_task())
    # PENDING, held until an ETA that has passed
    held, _ = store.submit(new_task(held=True, countdown=-1.0))
    # RETRY_WAIT, due now
    retry = running(store)
    (expiry,) = store.expire(
        actor="r", reason="worker lost", task_ids=[retry.task_id], only_expired=False
    )
    assert expiry.to_state is State.RETRY_WAIT
    # WAIT_MANUAL without a reason
    manual = running(store)
    with store.engine.begin() as conn:
        conn.execute(update(t).where(t.c.id == manual.task_id).values(reason=""))
    assert store.finish(manual, State.WAIT_MANUAL, actor="w", reason="")
    # SUCCEEDED with its follow-ups recorded and never published
    followed = running(store)
    assert store.finish(followed, State.SUCCEEDED, actor="w", reason="ok", follow_ups=True)

    expected = {
        "dead_owner": 1,
        "unpublished": 1,
        "held_overdue": 1,
        "retry_overdue": 1,
        "manual_without_reason": 1,
        "follow_ups_overdue": 1,
    }
    found = wait_until(
        lambda: (got := kinds(check(store, grace=0.1))) == expected and got,
        timeout=15,
        message="liveness violations",
    )
    assert found == expected
    by_kind = {v.kind: v.task_id for v in check(store, grace=0.1)}
    assert by_kind["dead_owner"] == dead.task_id
    assert by_kind["unpublished"] == unpublished
    assert by_kind["held_overdue"] == held
    assert by_kind["retry_overdue"] == retry.task_id
    assert by_kind["follow_ups_overdue"] == followed.task_id
    # with liveness off (or a generous grace) only the safety invariants remain
    assert kinds(check(store, liveness=False)) == {"manual_without_reason": 1}
    assert kinds(check(store, grace=3600)) == {"manual_without_reason": 1}


def test_orphan_rows(raw_store: Store) -> None:
    store = raw_store
    with store.engine.begin() as conn:
        conn.execute(
            insert(store.t.transitions).values(
                task_id="gone",
                from_state=None,
                to_state="PENDING",
                reason="x",
                actor="x",
                attempt=0,
                at=db_now(),
            )
        )
    assert [(v.kind, v.task_id) for v in check(store)] == [("orphan_audit", "gone")]


def test_check_takes_a_celery_app(lease_config: Callable[..., Any], harness: Any) -> None:
    config = lease_config(auto_migrate=True)
    app = Celery("check-test", set_as_current=False)
    app.conf.update(lease_settings(config))
    from celery_lease._runtime import runtime

    rt = runtime(app)
    harness.finalizers.append(rt.reset)
    store = rt.store
    lease = running(store)
    assert store.finish(lease, State.SUCCEEDED, actor="w", reason="done")
    assert check(app) == []


def test_lease_check_command(
    lease_config: Callable[..., Any], celery_project: Callable[..., Any], harness: Any
) -> None:
    """``celery -A proj lease check``: exit 0 and "no violations" on a clean store; exit 5
    naming each violation (and JSON with ``--json``) once the trail is corrupted."""
    import json
    import subprocess
    import sys

    config = lease_config()
    store = harness.track(Store(config))
    store.migrate()
    project = celery_project("", config=config)
    lease = running(store)
    assert store.finish(lease, State.SUCCEEDED, actor="w", reason="done")

    def lease_check(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", project.module, "lease", "check", *args],
            cwd=project.directory,
            env=project.process_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    clean = lease_check("--no-liveness")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "no violations" in clean.stdout

    t = store.t.tasks
    with store.engine.begin() as conn:
        conn.execute(update(t).where(t.c.id == lease.task_id).values(state="RUNNING"))
    broken = lease_check("--no-liveness")
    assert broken.returncode == 5, (broken.stdout, broken.stderr)
    assert "state_mismatch" in broken.stdout and lease.task_id in broken.stdout
    as_json = lease_check("--no-liveness", "--json")
    assert as_json.returncode == 5
    report = json.loads(as_json.stdout)
    assert report["counts"]["state_mismatch"] == 1
    assert [(v["kind"], v["task_id"]) for v in report["violations"]] == [
        ("state_mismatch", lease.task_id)
    ]

    # liveness: a RUNNING row whose owner never registered is a dead owner; --grace
    # allows that many seconds beyond each liveness deadline (reference-cli.md)
    dead = running(store, owner="no-such-incarnation")

    def found(*args: str) -> list[tuple[str, str]]:
        done = lease_check("--json", *args)
        assert done.returncode == 5, (done.stdout, done.stderr)
        return [(v["kind"], v["task_id"]) for v in json.loads(done.stdout)["violations"]]

    strict = wait_until(
        lambda: (
            ("dead_owner", dead.task_id) in (got := found("--grace", "0", "--no-workers")) and got
        ),
        timeout=30,
        message="the dead owner reported",
    )
    assert ("state_mismatch", lease.task_id) in strict
    lenient = found("--grace", "3600", "--workers-timeout", "0.5")
    assert lenient == [("state_mismatch", lease.task_id)]
