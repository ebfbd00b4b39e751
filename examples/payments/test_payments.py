"""The payment task, crashed for real: SIGKILLed pool processes, a SIGKILLed worker.

Run with ``python -m pytest examples/payments`` (Redis on 127.0.0.1:6379, or
``CELERY_LEASE_TESTING_BROKER_URL``).
"""

from __future__ import annotations

from payments.app import settle_invoice

from celery_lease import State
from celery_lease.testing import (
    CrashPoint,
    CrashPoints,
    LeaseWorker,
    SideEffects,
    assert_check_clean,
    assert_crash_safe,
    assert_finished,
)


def test_an_invoice_is_charged_once(lease_worker: LeaseWorker, lease_effects: SideEffects):
    result = settle_invoice.delay(1)

    lease_worker.wait_state(result, State.SUCCEEDED)
    record = assert_finished(lease_worker.store, result, steps=["load", "charge", "receipt"])
    assert record.result == {"invoice": 1, "charged_cents": 4250}
    assert lease_effects.counts() == {"charge": 1, "receipt": 1}


def test_every_crash_point_charges_at_most_once(
    lease_worker: LeaseWorker, lease_effects: SideEffects
):
    matrix = assert_crash_safe(
        lease_worker,
        lambda: settle_invoice.delay(1),
        effects=lease_effects,
        # the card was charged but the step is not recorded: only a person can tell
        manual={"after_step:charge"},
    )

    assert len(matrix.runs) == 7  # before and after each of 3 steps, before the outcome
    for run in matrix.runs:
        assert run.effects.get("charge") == 1, run.describe()
    parked = matrix["after_step:charge"]
    assert parked.record.reason is not None and "'charge'" in parked.record.reason
    assert parked.steps == {"load": "DONE", "charge": "STARTED"}
    assert "receipt" not in parked.effects


def test_a_charge_in_doubt_is_never_retried(
    lease_worker: LeaseWorker, lease_effects: SideEffects, lease_crash: CrashPoints
):
    point = lease_crash.arm(CrashPoint.after_step(settle_invoice, "charge"))
    result = settle_invoice.delay(2)

    record = lease_worker.wait_state(result, State.WAIT_MANUAL)
    assert lease_crash.fired(point)
    assert record.attempt == 1
    # a whole new worker (same node name) does not run it again either
    lease_worker.kill()
    lease_worker.restart()
    after = settle_invoice.delay(1)
    lease_worker.wait_state(after, State.SUCCEEDED)
    assert lease_worker.record(result).state is State.WAIT_MANUAL
    assert lease_effects.count("charge") == 2  # invoice 2 once, invoice 1 once
    assert_check_clean(lease_worker.store)
