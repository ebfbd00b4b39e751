"""A lost execution's event, handled late, never expires the task's next execution.

When a pool process loses the database while its task runs, it tells the worker's main
process, which expires that lease as soon as the database answers. The event may be
kept for a while (the database is away), and meanwhile the task may be recovered (by
the worker's own fence recovery or its embedded reaper) and claimed again by this very
worker. Handled then, an expiry of "the task's RUNNING row owned by this worker" would
cut that next execution short: a recovery too many (attempt 3 where 2 was right).

Three fences keep it exact: the attempt the pool process had claimed travels with the
event; an event raised before the worker recovered from a self-fence is covered by
that recovery; and an event with no attempt (a pool child killed, a hard time limit:
the main process never learns the attempt) expires only a claim made before the main
process saw the loss, by the database's clock (the row's ``started_at``). The
service's event handling runs here in the test process, on a real store (SQLite and
PostgreSQL), with its threads not started; the events are made by the service's own
entry point, as the worker's requests call it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from celery_lease import State
from celery_lease._runtime import runtime
from celery_lease.store import Store
from celery_lease.worker.main.service import Event, WorkerService

from ..helpers import WorkerProject, wait_until
from .test_cli_support import Ops, close_ops, make_ops

REASON = "lease store unavailable while the task ran: test"
LOST = "pool child lost while running the task: test"


def _db_clock_moves(store: Store, seconds: float = 0.05) -> None:
    """Wait until the database's clock has moved ``seconds`` on: what comes after is
    later by its clock, whatever its precision (SQLite's is a millisecond)."""
    start = store.now()
    wait_until(
        lambda: (store.now() - start).total_seconds() >= seconds,
        message="the database clock moves",
    )


@pytest.fixture
def service(
    celery_project: Callable[..., WorkerProject],
    make_store: Callable[..., Store],
    redis_url: str,
) -> Iterator[tuple[Ops, WorkerService]]:
    # an hour's TTL: the worker's row stays alive with no heartbeat thread running
    ops = make_ops(celery_project, make_store(ttl=3600), settings={"result_backend": redis_url})
    svc = WorkerService(runtime(ops.app), "late@lease-test")
    yield ops, svc
    svc.store.stop_worker(svc.incarnation.id, "test over")
    close_ops(ops)


def _claim_again(ops: Ops, svc: WorkerService, task_id: str) -> int:
    """Recover the task's current attempt the way the reaper does (expired, retried,
    re-published) and claim the next one as the same worker: the new attempt."""
    svc.store.expire(
        actor="reaper:test", reason="lease expired", task_ids=[task_id], only_expired=False
    )
    svc.reaper.publish_due()
    assert ops.store.get(task_id).state == State.PENDING
    return ops.claim(task_id, (svc.incarnation.id, svc.incarnation.nodename)).attempt


def test_a_late_event_with_its_attempt_expires_that_attempt_only(
    service: tuple[Ops, WorkerService],
) -> None:
    ops, svc = service
    inc = svc.incarnation
    task_id = ops.submit()
    first = ops.claim(task_id, (inc.id, inc.nodename)).attempt
    late = Event("lost", task_id, REASON, recoveries=0, attempt=first)
    second = _claim_again(ops, svc, task_id)
    assert (first, second) == (1, 2)

    svc._handle([late])
    rec = ops.store.get(task_id)
    assert (rec.state, rec.attempt, rec.recoveries) == (State.RUNNING, 2, 1)

    # the event of the execution that runs now still expires it at once
    svc._handle([Event("lost", task_id, REASON, recoveries=0, attempt=2)])
    rec = ops.store.get(task_id)
    assert (rec.state, rec.attempt, rec.recoveries) == (State.PENDING, 2, 2)


def test_an_event_raised_before_a_fence_recovery_is_covered_by_it(
    service: tuple[Ops, WorkerService],
) -> None:
    ops, svc = service
    inc = svc.incarnation
    task_id = ops.submit()
    ops.claim(task_id, (inc.id, inc.nodename))
    # its claim's outcome unknown to the pool process: no attempt in the event
    late = Event("lost", task_id, REASON, recoveries=0, attempt=None)
    svc._expire_own("heartbeat lapsed past the TTL")  # the fence recovery: attempt 1 goes
    svc.reaper.publish_due()
    assert ops.store.get(task_id).state == State.PENDING
    assert ops.claim(task_id, (inc.id, inc.nodename)).attempt == 2

    svc._handle([late])
    rec = ops.store.get(task_id)
    assert (rec.state, rec.attempt, rec.recoveries) == (State.RUNNING, 2, 1)

    # an event raised after the recovery, attempt unknown, expires what runs now
    svc._handle([Event("lost", task_id, REASON, recoveries=1, attempt=None)])
    assert ops.store.get(task_id).state == State.PENDING


def test_a_late_loss_without_its_attempt_spares_the_next_claim(
    service: tuple[Ops, WorkerService],
) -> None:
    """A pool child killed (``WorkerLostError``): the main process never knew the
    attempt. Its event, handled after the task was recovered and claimed again by this
    very worker, used to expire that next execution: the task ran twice."""
    ops, svc = service
    inc = svc.incarnation
    task_id = ops.submit()
    assert ops.claim(task_id, (inc.id, inc.nodename)).attempt == 1
    _db_clock_moves(ops.store)
    svc.child_lost(task_id, LOST)  # what LeasedRequest.on_failure calls: no attempt
    late = svc._events.get_nowait()
    assert late.attempt is None and late.recoveries == 0
    _db_clock_moves(ops.store)
    assert _claim_again(ops, svc, task_id) == 2  # recovered, not by a fence recovery

    svc._handle([late])
    rec = ops.store.get(task_id)
    assert (rec.state, rec.attempt, rec.recoveries) == (State.RUNNING, 2, 1)
    assert [h.to_state for h in ops.store.history(task_id)].count(State.TIMEOUT) == 1

    # the loss of the execution that runs now still expires it at once
    _db_clock_moves(ops.store)
    svc.child_lost(task_id, LOST)
    svc._handle([svc._events.get_nowait()])
    rec = ops.store.get(task_id)
    assert (rec.state, rec.attempt, rec.recoveries) == (State.PENDING, 2, 2)


def test_a_loss_handled_again_spares_the_execution_claimed_since(
    service: tuple[Ops, WorkerService],
) -> None:
    """An event whose expiry committed and whose next statement then failed on the
    database is kept, and handled again once it answers: by then the task may run
    again on this worker, and the second expiry must miss that execution."""
    ops, svc = service
    inc = svc.incarnation
    task_id = ops.submit()
    ops.claim(task_id, (inc.id, inc.nodename))
    _db_clock_moves(ops.store)
    svc.child_lost(task_id, LOST)
    event = svc._events.get_nowait()
    svc._handle([event])  # expired, retried at once and published again
    assert ops.store.get(task_id).state == State.PENDING
    _db_clock_moves(ops.store)
    assert ops.claim(task_id, (inc.id, inc.nodename)).attempt == 2

    svc._handle([event])
    rec = ops.store.get(task_id)
    assert (rec.state, rec.attempt, rec.recoveries) == (State.RUNNING, 2, 1)


def test_an_expiry_fenced_by_the_claims_age_takes_only_an_older_claim(
    service: tuple[Ops, WorkerService],
) -> None:
    """The store's fence on its own: ``claimed_before`` (a moment of this process's
    monotonic clock) selects a RUNNING row only if its claim is older by the database's
    clock; the moment's age is measured as the statement runs."""
    ops, svc = service
    inc = svc.incarnation
    owner = (inc.id, inc.nodename)
    older, newer = ops.submit(), ops.submit()
    ops.claim(older, owner)
    _db_clock_moves(ops.store)
    seen = time.monotonic()
    _db_clock_moves(ops.store)
    ops.claim(newer, owner)

    expired = ops.store.expire(
        actor=inc.actor,
        reason=LOST,
        task_ids=[older, newer],
        owners=[inc.id],
        claimed_before=seen,
        only_expired=False,
    )
    assert [e.task_id for e in expired] == [older]
    assert ops.store.get(older).state is State.RETRY_WAIT
    assert ops.store.get(newer).state is State.RUNNING

    # a moment after both claims takes the newer one too
    _db_clock_moves(ops.store)
    expired = ops.store.expire(
        actor=inc.actor,
        reason=LOST,
        task_ids=[newer],
        owners=[inc.id],
        claimed_before=time.monotonic(),
        only_expired=False,
    )
    assert [e.task_id for e in expired] == [newer]
