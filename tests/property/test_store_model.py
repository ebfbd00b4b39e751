"""The store against its reference model (see :mod:`tests.property.store_model`), on a
SQLite file and on PostgreSQL, within a bounded example budget; and planted bugs the
machine must catch: an outcome written without its fence, a limited task's claim
that does not count the slots in use, and a rate-limited claim that starts a paced
row on time without looking at the key's last start.

``CELERY_LEASE_MODEL_PROFILE`` names the Hypothesis profile (default ``model-ci``);
``scripts/model_check.py`` runs the machine for as long as one asks, with a seed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from sqlalchemy import Float, and_, bindparam, insert, or_, select, update

from celery_lease.states import State
from celery_lease.store import Lease, NewTask, Store
from celery_lease.store._slots import PACED
from celery_lease.store.schema import after, db_now

from .model_database import Database
from .store_model import LIMITED, RATE, StoreMachine, machine_for

_QUIET = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much]

#: CI's budget: well under a minute per store on two shared cores (docs/reliability.md);
#: 16 examples since the machine drives limits too (each rule does more).
settings.register_profile(
    "model-ci",
    max_examples=16,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=_QUIET,
)
#: A longer look, by hand (``scripts/model_check.py`` runs for a given time instead).
settings.register_profile(
    "model-long",
    max_examples=2_000,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=_QUIET,
)
PROFILE = os.environ.get("CELERY_LEASE_MODEL_PROFILE", "model-ci")


@pytest.fixture
def database(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Database]:
    url = str(request.getfixturevalue("pg_url")) if backend == "postgresql" else None
    db = Database(url, tmp_path)
    try:
        yield db
    finally:
        db.close()


@pytest.mark.slow
def test_the_store_follows_its_model(database: Database) -> None:
    run_state_machine_as_test(
        machine_for(database), settings=settings(settings.get_profile(PROFILE))
    )


class UnfencedOutcome(StoreMachine):
    """The outcome rule with a planted bug: its UPDATE names the task and the states an
    outcome may leave (RUNNING, or WAIT_MANUAL for a success or failure) but not the
    execution's attempt and token, and it writes a correct audit row, so the trail
    alone looks legal. A stale execution's late outcome then overwrites the task."""

    def _write_outcome(self, lease: Lease, kind: str, batched: bool, delay: float) -> bool:
        if kind == "retry":
            return super()._write_outcome(lease, kind, batched, delay)
        to = {"success": State.SUCCEEDED, "failure": State.FAILED, "cancelled": State.CANCELLED}
        frm = ["RUNNING"] if kind == "cancelled" else ["RUNNING", "WAIT_MANUAL"]
        t, tr = self.store.t.tasks, self.store.t.transitions
        with self.store.engine.begin() as conn:
            row = conn.execute(
                select(t.c.state, t.c.attempt).where(t.c.id == lease.task_id, t.c.state.in_(frm))
            ).first()
            if row is None:
                return False
            conn.execute(
                update(t)
                .where(t.c.id == lease.task_id, t.c.state == row.state)
                .values(state=to[kind].value, finished_at=db_now(), updated_at=db_now())
            )
            conn.execute(
                insert(tr).values(
                    task_id=lease.task_id,
                    from_state=row.state,
                    to_state=to[kind].value,
                    reason=kind,
                    actor="w",
                    attempt=row.attempt,
                    at=db_now(),
                )
            )
        return True


SPEC = {
    "name": "mail",
    "dedup_key": None,
    "lease_ttl": 9.5,
    "max_runtime": None,
    "max_recoveries": 2,
    "on_timeout": "retry",
    "countdown": None,
}


@pytest.mark.violations
def test_the_model_catches_an_unfenced_outcome(database: Database) -> None:
    """The machine's own rules, with the planted bug, in the shortest sequence that
    shows it: the task retries, a second worker claims it, and the first execution's
    late success is accepted. The rule's answer and the invariants both catch it."""
    machine = machine_for(database, UnfencedOutcome)()
    try:
        machine.submit(SPEC)
        machine.claim(w=0, i=0, duplicate=False)  # execution 0, on the first worker
        machine.outcome(e=0, stale=False, kind="retry", batched=False, delay=0.0)
        machine.claim(w=1, i=0, duplicate=False)  # execution 1, on the second worker
        machine.database_equals_model()
        with pytest.raises(
            AssertionError, match="outcome success answered True, the model says False"
        ):
            machine.outcome(e=0, stale=True, kind="success", batched=False, delay=0.0)
        with pytest.raises(AssertionError, match=r"database .*SUCCEEDED.*, model .*RUNNING"):
            machine.database_equals_model()
    finally:
        machine.teardown()


def test_the_same_sequence_passes_with_the_real_rule(database: Database) -> None:
    """The control: the real outcome rule refuses the stale execution's success."""
    machine = machine_for(database)()
    try:
        machine.submit(SPEC)
        machine.claim(w=0, i=0, duplicate=False)
        machine.outcome(e=0, stale=False, kind="retry", batched=False, delay=0.0)
        machine.claim(w=1, i=0, duplicate=False)
        machine.outcome(e=0, stale=True, kind="success", batched=False, delay=0.0)
        machine.database_equals_model()
        machine.lease_check_finds_nothing()
    finally:
        machine.teardown()


def test_a_batch_keeps_the_first_of_two_rows_with_one_dedup_key(store: Store) -> None:
    """What the machine found: on SQLite a batch wrote its rows without a countdown
    before those with one, so a later row could take an earlier row's dedup key."""
    rows = [
        NewTask(
            id=f"b{n}",
            name="mail",
            args="[]",
            kwargs="{}",
            options="{}",
            lease_ttl=9.5,
            max_recoveries=1,
            dedup_key="same",
            countdown=countdown,
        )
        for n, countdown in enumerate((5.0, None, 0.0))
    ]
    assert store.submit_many(rows) == [("b0", True), ("b0", False), ("b0", False)]
    record = store.get("b0")
    assert record is not None and record.eta is not None
    assert store.get("b1") is None and store.get("b2") is None


class UncountedClaims(Store):
    """A store with a planted bug in a copy of the claim statement of a limited task
    (``Claims._claim_slot_spec``): it records the row's key, as the real one does, but
    its ``WHERE`` leaves out the count of the slots in use below the limit. Every due
    delivery is then claimed, whatever the limit."""

    def _claim_slot_spec(self, unseen: Any = None) -> Any:
        t = self.t.tasks
        where, values, returning = self._claim_spec()
        key = bindparam("b_slot_key", type_=t.c.slot_key.type)
        return where, {**values, "slot_key": key, "slot": None}, returning


class UncountedClaimMachine(StoreMachine):
    store_class = UncountedClaims


LIMITED_SPEC = {**SPEC, "name": LIMITED, "key": "k=a"}


def _two_deliveries_of_one_key(machine: StoreMachine) -> None:
    """A limit of 1; two rows of the limited task under one key, the first delivered
    to the first worker and claimed; then the second delivered to the second worker."""
    machine.start(limit=1, spec=LIMITED_SPEC, key="k=a", n=2, workers=[0])
    machine.limits_hold()
    machine.claim_limited(picks=[(1, 0)])


@pytest.mark.violations
def test_the_model_catches_a_claim_that_does_not_count_the_slots(database: Database) -> None:
    """The shortest sequence that shows the planted bug: the second delivery of a key
    whose one slot is taken is claimed. The rule's answer and the invariants both
    catch it."""
    machine = machine_for(database, UncountedClaimMachine)()
    try:
        with pytest.raises(AssertionError, match=r"answered Claim.*the model says it waits"):
            _two_deliveries_of_one_key(machine)
        with pytest.raises(AssertionError, match=r"lim\[k=a\]: 2 running .* limit 1"):
            machine.limits_hold()
    finally:
        machine.teardown()


def test_the_same_deliveries_wait_with_the_real_claim(database: Database) -> None:
    """The control: the real claim leaves the second row waiting, and a grant gives it
    the slot once the first run's outcome frees it."""
    machine = machine_for(database)()
    try:
        _two_deliveries_of_one_key(machine)
        (waiting,) = [t for t in machine.tasks.values() if t.slot == "waiting"]
        machine.limits_hold()
        machine.lease_check_finds_nothing()
        machine.limited_outcome(i=0, kind="success", batched=False, delay=0.0)
        machine.limits_hold()
        machine.grant_freed(lost=False, published=True)
        assert waiting.slot == "granted"
        machine.database_equals_model()
        machine.limits_hold()
        machine.lease_check_finds_nothing()
    finally:
        machine.teardown()


@pytest.mark.violations
def test_the_machine_finds_the_uncounted_claim_by_itself(database: Database) -> None:
    """Not a chosen sequence: the machine's own search (derandomized, without
    shrinking, to stay fast) runs into the planted bug within a few examples."""
    found = settings(
        max_examples=20,
        stateful_step_count=30,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        report_multiple_bugs=False,
        suppress_health_check=_QUIET,
    )
    with pytest.raises(AssertionError, match=r"the model says it waits|the limit is exceeded"):
        run_state_machine_as_test(machine_for(database, UncountedClaimMachine), settings=found)


class UntakenIntervals(Store):
    """A store with a planted bug in a copy of the rate limit's rule
    (``Claims._may_start``): a paced row that comes on time for its reserved start
    starts without the key's last start being read, so also when a late row already
    took its interval (the real rule paces it again)."""

    def _may_start(self, t: Any, name: Any, key: Any) -> Any:
        c = self.t.concurrency
        interval = bindparam("b_interval", type_=Float)
        now = bindparam("b_now", type_=t.c.eta.type)
        last = c.c.last_start_at
        busy = or_(
            last > after(now, -interval),
            and_(last.is_(None), c.c.next_start_at > now),
        )
        idle = ~select(c.c.name).where(c.c.name == name, c.c.key == key, busy).exists()
        on_time = and_(t.c.slot == PACED, t.c.eta > after(db_now(), -interval))
        return or_(idle, on_time)


class UntakenIntervalMachine(StoreMachine):
    store_class = UntakenIntervals


RATE_SPEC = {**SPEC, "name": RATE, "rate_key": ""}


def _two_late_rows_and_one_on_time(machine: StoreMachine) -> None:
    """One start every 2.5 s (and 1/1024 s: I), four rows of the rate-limited task
    without a key, delivered at 0 s: the first starts, the others are paced to I, 2I
    and 3I. The first paced row comes at 8 s, late: it starts, the key idle, and
    records the start an interval back; the second comes at 9 s, late too, and starts,
    the key idle again; the third comes at 9 s, on time for 3I, but in an interval
    those starts took: a third start within one interval."""
    machine.submit_rate(RATE_SPEC, key="", n=4, workers=[0, 0, 0, 0])
    machine.rates_hold()
    machine.paced_delivery(w=0, i=0, late=5)  # at 8 s
    machine.paced_delivery(w=0, i=0, late=1)  # at 9 s
    machine.rates_hold()
    machine.paced_delivery(w=0, i=0, late=0)  # at 9 s


@pytest.mark.violations
def test_the_model_catches_a_claim_that_ignores_the_last_start(database: Database) -> None:
    """The planted bug, in the shortest sequence of the machine's rules that shows it:
    the third delivery starts. The rule's answer and the invariants both catch it."""
    machine = machine_for(database, UntakenIntervalMachine)()
    try:
        with pytest.raises(AssertionError, match=r"answered Claim.*the model says it is paced"):
            _two_late_rows_and_one_on_time(machine)
        with pytest.raises(AssertionError, match=r"3 starts within 1 intervals.*rate is exceeded"):
            machine.rates_hold()
    finally:
        machine.teardown()


def test_the_same_deliveries_are_paced_with_the_real_claim(database: Database) -> None:
    """The control: the real claim paces the third row again, to the key's next free
    start, where it starts (at its reserved start: the beat goes on)."""
    machine = machine_for(database)()
    try:
        _two_late_rows_and_one_on_time(machine)
        (paced,) = [machine.tasks[i] for i in machine._paced()]
        machine.rates_hold()
        machine.database_equals_model()
        machine.paced_delivery(w=0, i=0, late=0)
        assert paced.state is State.RUNNING
        assert machine.rates[(RATE, "")][0] == paced.eta  # its last start: the reserved one
        machine.rates_hold()
        machine.database_equals_model()
        machine.lease_check_finds_nothing()
    finally:
        machine.teardown()
