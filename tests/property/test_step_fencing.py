"""Property tests of steps, attempts and fencing against the real store (hypothesis).

A rule-based state machine drives one task through any interleaving of claims,
duplicate deliveries, steps (through :class:`celery_lease.worker.pool.execution.Execution`, the
code tasks use) from the current *and from stale* executions, progress writes, lease
expiries, due retries, operator retries and outcomes. A plain-Python model predicts
every answer; after each rule the database must equal the model. Hence:

* a step is marked done once: its stored result and attempt never change;
* no write from a stale attempt is ever accepted (step start, step result, progress,
  outcome), and a stale execution never calls a non-idempotent step's function;
* a done step is never run again by a later attempt;
* a lease that expires with a non-idempotent step of *this* attempt in flight goes to
  a person, any other expiry is retried (or goes to a person past max_recoveries).

Runs on a SQLite file and on PostgreSQL (the ``backend`` fixture).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from celery_lease import DuplicateStep, LeaseLost, State
from celery_lease.states import RETRYABLE
from celery_lease.store import Claim, NewTask, Refusal, Store
from celery_lease.worker.pool.execution import Execution

MAX_RECOVERIES = 3
NAMES = st.sampled_from(["load", "charge", "ship", "mail"])
#: Which execution acts (modulo the executions so far): the current one or a stale one.
RUNS = st.integers(0, 7)


@dataclasses.dataclass
class Run:
    """One execution (one claim) as the model sees it."""

    execution: Execution
    seen: set[str] = dataclasses.field(default_factory=set)
    #: The steps this execution believes done (it loads them once, at its first step).
    snapshot: dict[str, str] | None = None


class StepFencing(RuleBasedStateMachine):
    def __init__(self, store: Store) -> None:
        super().__init__()
        self.store = store
        self.task_id = f"prop-{uuid.uuid4().hex}"
        tid, created = store.submit(
            NewTask(
                id=self.task_id,
                name="prop",
                args="[]",
                kwargs="{}",
                options="{}",
                lease_ttl=30.0,
                max_recoveries=MAX_RECOVERIES,
            )
        )
        assert created and tid == self.task_id
        self.state = State.PENDING
        self.runs: list[Run] = []
        self.current: int | None = None  # index of the run holding the lease
        self.recoveries = 0
        self.done: dict[str, tuple[str, int]] = {}  # name -> (result, attempt)
        self.started: dict[str, int] = {}  # non-idempotent, not done: name -> attempt
        self.progress: Any = None
        self.calls: dict[str, int] = {}  # real calls of each step's function
        self.expected_calls: dict[str, int] = {}

    # -- helpers ----------------------------------------------------------------------

    def _holder(self, index: int) -> bool:
        return self.state is State.RUNNING and index == self.current

    def _fn(self, name: str, attempt: int) -> Any:
        def fn() -> str:
            self.calls[name] = self.calls.get(name, 0) + 1
            return f"{name}@{attempt}#{self.calls[name]}"

        return fn

    def _pick(self, who: int) -> int:
        return who % len(self.runs)

    # -- the task's life --------------------------------------------------------------

    @precondition(lambda self: self.state is State.PENDING)
    @rule()
    def claim(self) -> None:
        claim = self.store.claim(self.task_id, "worker-id", "worker:prop")
        assert isinstance(claim, Claim), claim
        assert claim.lease.attempt == len(self.runs) + 1
        assert claim.resumed == (claim.lease.attempt > 1)
        execution = Execution(
            store=self.store, claim=claim, fenced=lambda: False, check_interval=3600.0
        )
        self.runs.append(Run(execution, snapshot=None if claim.resumed else {}))
        self.current = len(self.runs) - 1
        self.state = State.RUNNING

    @precondition(lambda self: self.state is not State.PENDING)
    @rule()
    def duplicate_delivery(self) -> None:
        refusal = self.store.claim(self.task_id, "worker-id", "worker:prop")
        assert isinstance(refusal, Refusal) and refusal.state is self.state

    @precondition(lambda self: len(self.runs) > 0)
    @rule(who=RUNS, name=NAMES, idempotent=st.booleans())
    def step(self, who: int, name: str, idempotent: bool) -> None:
        index = self._pick(who)
        run = self.runs[index]
        attempt = run.execution.attempt
        fn = self._fn(name, attempt)
        holder = self._holder(index)
        if name in run.seen:
            try:
                run.execution.step(name, fn, (), {}, idempotent=idempotent, check=None)
            except DuplicateStep:
                return
            raise AssertionError("a step name was accepted twice in one run")
        run.seen.add(name)
        if run.snapshot is None:  # the execution loads the recorded steps now
            run.snapshot = {n: r for n, (r, _) in self.done.items()}
        try:
            value = run.execution.step(name, fn, (), {}, idempotent=idempotent, check=None)
        except LeaseLost:
            assert not holder, "the lease holder was fenced off"
            if idempotent and name not in run.snapshot:
                # an idempotent call may run; its result is refused
                self.expected_calls[name] = self.expected_calls.get(name, 0) + 1
            return
        if name in run.snapshot:
            assert value == run.snapshot[name]  # returned from the record, not re-run
            return
        assert holder, "a stale execution's step result was accepted"
        self.expected_calls[name] = self.expected_calls.get(name, 0) + 1
        assert name not in self.done, "a done step ran again"
        self.done[name] = (value, attempt)
        self.started.pop(name, None)
        run.snapshot[name] = value

    @precondition(lambda self: len(self.runs) > 0)
    @rule(who=RUNS, name=NAMES)
    def step_raises(self, who: int, name: str) -> None:
        """A non-idempotent step whose call raises: its start stays recorded."""
        index = self._pick(who)
        run = self.runs[index]
        if name in run.seen:
            return
        run.seen.add(name)
        if run.snapshot is None:
            run.snapshot = {n: r for n, (r, _) in self.done.items()}
        counted = self._fn(name, run.execution.attempt)

        def declined() -> None:
            counted()
            raise RuntimeError("declined")

        try:
            value = run.execution.step(name, declined, (), {}, idempotent=False, check=None)
        except LeaseLost:
            assert not self._holder(index)
            return
        except RuntimeError:
            assert self._holder(index) and name not in run.snapshot
            self.expected_calls[name] = self.expected_calls.get(name, 0) + 1
            self.started[name] = run.execution.attempt
            return
        assert name in run.snapshot and value == run.snapshot[name]

    @precondition(lambda self: len(self.runs) > 0)
    @rule(who=RUNS)
    def task_retries(self, who: int) -> None:
        """``self.retry()``: RUNNING -> RETRY_WAIT -> PENDING (published at once), fenced."""
        index = self._pick(who)
        ok = self.store.schedule_retry(
            self.runs[index].execution.lease, 0.0, actor="w", reason="retry", error=None
        )
        assert ok == self._holder(index)
        if ok:
            self.state = State.PENDING
            self.current = None

    @precondition(lambda self: len(self.runs) > 0)
    @rule(who=RUNS, name=NAMES)
    def stale_start(self, who: int, name: str) -> None:
        """A non-idempotent start straight through the store, from any execution."""
        index = self._pick(who)
        lease = self.runs[index].execution.lease
        answer = self.store.step_started(lease, name, checkable=False)
        if not self._holder(index):
            assert answer is None
            return
        assert answer is not None and not answer.cancel_requested
        if name not in self.done:
            self.started[name] = lease.attempt

    @precondition(lambda self: len(self.runs) > 0)
    @rule(who=RUNS, value=st.integers(0, 10_000))
    def save_progress(self, who: int, value: int) -> None:
        index = self._pick(who)
        try:
            self.runs[index].execution.save_progress(value)
        except LeaseLost:
            assert not self._holder(index)
            return
        assert self._holder(index), "a stale execution's progress was accepted"
        self.progress = value

    @precondition(lambda self: self.state is State.RUNNING)
    @rule()
    def expire(self) -> None:
        expiries = self.store.expire(
            actor="reaper:prop", reason="lease expired", task_ids=[self.task_id], only_expired=False
        )
        assert len(expiries) == 1
        self.recoveries += 1
        attempt = len(self.runs)
        if any(a == attempt for a in self.started.values()) or self.recoveries > MAX_RECOVERIES:
            expected = State.WAIT_MANUAL
        else:
            expected = State.RETRY_WAIT
        assert expiries[0].to_state is expected, (expiries[0], self.started)
        self.state = expected
        self.current = None

    @precondition(lambda self: self.state is State.RETRY_WAIT)
    @rule()
    def retry_due(self) -> None:
        taken = self.store.take_due_retries(actor="reaper:prop", limit=100_000)
        assert self.task_id in {p.id for p in taken}
        self.state = State.PENDING

    @precondition(lambda self: self.state in RETRYABLE)
    @rule()
    def operator_retry(self) -> None:
        self.store.operator_move(
            self.task_id, State.PENDING, actor="op", reason="retry", allowed=tuple(RETRYABLE)
        )
        self.started.clear()  # a person decided: steps of unknown outcome run again
        self.state = State.PENDING

    @precondition(lambda self: len(self.runs) > 0)
    @rule(who=RUNS)
    def finish(self, who: int) -> None:
        index = self._pick(who)
        ok = self.store.finish(
            self.runs[index].execution.lease, State.SUCCEEDED, actor="w", reason="done"
        )
        assert ok == self._holder(index)
        if ok:
            self.state = State.SUCCEEDED
            self.current = None

    # -- what must always hold --------------------------------------------------------

    @invariant()
    def database_equals_model(self) -> None:
        record = self.store.get(self.task_id)
        assert record is not None
        assert record.state is self.state
        assert record.attempt == len(self.runs)
        assert record.progress == self.progress
        stored = {s.name: s for s in self.store.steps(self.task_id)}
        for name, (result, attempt) in self.done.items():
            assert stored[name].state == "DONE"
            assert stored[name].result == json.loads(json.dumps(result))
            assert stored[name].attempt == attempt  # never overwritten
        for name, attempt in self.started.items():
            assert stored[name].state == "STARTED" and stored[name].attempt == attempt
        assert set(stored) == set(self.done) | set(self.started)

    @invariant()
    def functions_ran_only_when_allowed(self) -> None:
        assert self.calls == self.expected_calls


def test_steps_attempts_and_fencing_hold_under_any_interleaving(store: Store) -> None:
    run_state_machine_as_test(
        lambda: StepFencing(store),
        settings=settings(
            max_examples=100,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        ),
    )


def test_a_step_left_started_by_an_earlier_attempt_is_not_in_flight(store: Store) -> None:
    """The interleaving hypothesis found against the first version of the expiry: a
    non-idempotent call raised, the task retried, and the next attempt lost its lease
    before reaching that step again; nothing of *that* attempt was in flight."""
    machine = StepFencing(store)
    machine.claim()
    machine.stale_start(0, "load")
    machine.task_retries(0)  # published at once: PENDING
    machine.claim()
    machine.expire()  # the model expects RETRY_WAIT
    machine.database_equals_model()
    machine.teardown()
