"""A model-based test of the store and its deciders: many tasks, many workers, a clock.

:class:`StoreMachine` is a Hypothesis ``RuleBasedStateMachine`` that drives the real
:class:`~celery_lease.store.Store` (a fresh SQLite file, or a fresh PostgreSQL schema,
for every example) through its public operations, as producers, workers, the reaper
and operators call them: submissions (one, many, with dedup keys, a finished id sent
again, a message without a row adopted at claim), worker incarnations with heartbeats,
claims (one and in batches), steps started and done, progress, outcomes (success,
failure, cancel, retry; one by one and in batches), a lease given up, time passing,
the reaper's sweeps (expiry and its recovery decision: retry, WAIT_MANUAL, poison, too
old, cancel; overruns; due retries; re-publishing), operator moves (retry, fail,
resolve, cancel), cancel requests, pauses, retention and tombstones; and the
concurrency limits of a limited task (``concurrency_limit`` per ``concurrency_key``):
claims with a :class:`~celery_lease.store.Slot` (a claim the count stops leaves the row
waiting), the slots freed by outcomes, retries, expiries, overruns and runs ended, the
grants of the worker whose commit freed them (``Slots.grant``) and the reaper's
backstop (``take_waiting``), cancelled and paused waiting rows; and the global rate
limits (``global_rate_limit``, one start an interval per key): a rate-limited task
(a rate alone, under the key ``""`` of a task without a ``concurrency_key`` and under
a key), and the limited task with a rate as well in half the examples. A claim starts
the row when its key is idle or when the row, paced earlier, comes on time for its
reserved start in an interval no other start took; any other claim paces it (the
key's next free start becomes its ETA, ``slot='paced'``; published again for it by
the worker, or held in the store when it is more than ``lease_hold_eta_after``
away, for the reaper's held sweep). Paced rows are delivered at their start, or
late by up to five seconds (more than an interval); cancelled; published by the
held sweep.

A plain-Python reference model (:class:`Model`: the rules of ``celery_lease/states.py``,
``celery_lease/policy.py`` and DESIGN.md, written again without SQL) predicts every
answer. After every rule the database must equal the model and these must hold:

* ``lease check``'s safety invariants (:func:`celery_lease.check.check`) find nothing;
* every row's fencing token is the token of the execution the model says holds the
  lease (so at most one execution per task is live; :meth:`StoreMachine.probe_leases`
  asks the store itself, through ``check_lease``, about every execution of a task);
* every write is fenced: a step, progress, outcome, retry or give-up from an execution
  that does not hold the lease changes nothing (the database still equals the model);
* the audit trail of every task is exactly the transitions the model saw, in order;
* a done step is never re-run: a step's function is called only while its row is not
  DONE, and a DONE row's result and attempt never change;
* a limit is never exceeded: the slots in use under each (name, key) (RUNNING rows of
  the key, rows granted a slot, overruns whose owner lives) never number more than the
  limit, as the model counts them and as the store's own ``slot_usage`` does; after a
  grant, and after the backstop, no row waits while its key has a slot free (unless
  its task is paused); ``lease check``'s ``waiting_with_free_slot`` reports only rows
  the model says wait with a slot free; every commit that ended a run holding a slot,
  and every commit that marked a row waiting, told ``on_slots_freed`` its (name, key),
  and no other commit did;
* a rate holds: the starts of each rate-limited key (its claims' ``started_at``, in
  database time) number at most ``k + 1`` in any ``k`` intervals, and the ``k``-th
  start after a key's first comes ``k`` intervals after it at least; each key's last
  start and next free start (``concurrency.last_start_at``, ``next_start_at``) are
  the model's; a paced row is PENDING with the ETA the model gave it, or cancelled
  (never started, never counted); every row's ``held`` mark is the model's, and no
  PENDING row is held without an ETA (the held sweep, which publishes it, would never
  take it).

**The clock.** Every decision compares database time, and the test sets the database's
clock in SQL the database evaluates (see :mod:`tests.property.model_database`): time
only passes when the :meth:`StoreMachine.tick` rule says so, so the test is as fast as
the store and deterministic, and Hypothesis can shrink a failure to the shortest
sequence of rules. Time moves in whole seconds and every duration the rules compare
(TTLs, ``max_runtime``, grace periods, retention, countdowns) ends in half a second, so
no comparison ever falls on a boundary (SQLite's REAL timestamps are exact to about
ten microseconds). A rate's interval is 2.5 s or 4.5 s and 1/1024 s, so that the
starts it spaces (whole seconds plus multiples of it) stay off whole seconds, and off
each other, by a millisecond at least. One boundary is the rate's own: a start that
records the moment an interval back (a key idle for long) makes the key idle again at
that same moment, which PostgreSQL reads as idle (the claim's time, read twice, is
one value) and SQLite either way (its time is a REAL, which the claim also reads
rounded to the microsecond); there the model takes SQLite's answer.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import uuid
from datetime import datetime, timezone
from typing import Any

from hypothesis import currently_in_test_context, event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from sqlalchemy import select

from celery_lease.check import check
from celery_lease.exceptions import IllegalTransition, TaskNotFound
from celery_lease.states import STEP_DONE, STEP_STARTED, Actor, State, sources
from celery_lease.store import Claim, Lease, NewTask, Outcome, Refusal, Slot, Store

from .model_database import EPOCH, TIMINGS, Database

# -- what the rules choose from ---------------------------------------------------

#: ``published_at`` of a row held for a pause (``Operator.HELD``), seconds from EPOCH.
HELD = datetime(1970, 1, 1, tzinfo=timezone.utc).timestamp() - EPOCH.timestamp()

LEASE_TTLS = (4.5, 9.5)
MAX_RUNTIMES = (None, 6.5)
COUNTDOWNS = (None, 0.0, 2.5)
RETRY_DELAYS = (0.0, 2.5)
TICKS = (1, 2, 3, 5, 8, 13)
NAMES = ("mail", "ship", "lim", "rate")
#: The limited task: at most ``StoreMachine.limit`` RUNNING at once per concurrency key.
LIMITED = "lim"
#: The rate-limited task: a ``global_rate_limit`` alone (no concurrency limit).
RATE = "rate"
#: Its keys: ``""`` is the one key of a task without a ``concurrency_key`` (and the key
#: of a delivery whose key cannot be made).
RATE_KEYS = ("", "k=a")
#: Seconds between two starts per key a ``global_rate_limit`` gives, drawn per example
#: (for the rate-limited task; the limited task has one too in half the examples).
#: Starts add up intervals from whole seconds: 2.5 s would put every second start on
#: a whole second, where the clock stops (a boundary). The 1/1024 s more keeps whole
#: seconds plus up to a few hundred intervals off whole seconds, and off each other, by
#: about a millisecond at least (exact in binary, and far more than SQLite's REAL
#: timestamps blur).
RATE_INTERVALS = (2.5 + 2**-10, 4.5 + 2**-10)
#: How late a paced row's delivery comes after its start (seconds after the whole
#: second that follows it): on time, or late by more than an interval.
LATENESS = (0, 0, 1, 2, 5)
#: Seconds two database times of the rate may differ by and be one (SQLite's times are
#: REALs, blurred by tens of microseconds; distinct times differ by a millisecond).
SAME_TIME = 2e-4
#: The concurrency keys of the limited task's submissions (its argument ``k``).
SLOT_KEYS = ("k=a", "k=b")
#: The limit an example's limited task gives (drawn once per example).
LIMITS = (1, 2)
DEDUP_KEYS = ("k0", "k1", "k2")
STEPS = ("load", "charge", "send")
NODES = ("n1", "n2", "n3")
#: Rows an example makes at most (few rows, many moves each).
MAX_TASKS = 7
#: Which of the last three workers renew while time passes (a bit each): mostly all.
BEATING = (7, 7, 7, 3, 1, 0)


def _note(what: str) -> None:
    """Record ``what`` as a Hypothesis event (how often the limits' cases come up);
    nothing when a test calls the rules itself, outside a Hypothesis run."""
    if currently_in_test_context():
        event(what)


# -- the reference model ----------------------------------------------------------------

FINISHED = (State.SUCCEEDED, State.FAILED, State.CANCELLED)
LIVE = (State.RUNNING, State.WAIT_MANUAL)
#: What ``lease check`` reports only with ``liveness`` (a reaper not running).
LIVENESS_KINDS = frozenset(
    {
        "dead_owner",
        "unpublished",
        "republish_overdue",
        "held_overdue",
        "retry_overdue",
        "stuck_timeout",
        "follow_ups_overdue",
        "no_publisher",
        "waiting_with_free_slot",
    }
)
#: ``tasks.slot`` values (celery_lease/store/_slots.py), written again.
WAITING, GRANTED, OVERRUN, PACED = "waiting", "granted", "overrun", "paced"


def _seconds(at: datetime | None) -> float | None:
    """A database time as seconds since EPOCH (the model's time)."""
    if at is None:
        return None
    if at.tzinfo is None:
        at = at.replace(tzinfo=timezone.utc)
    return (at - EPOCH).total_seconds()


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) < SAME_TIME


@dataclasses.dataclass
class MStep:
    state: str
    attempt: int
    idempotent: bool
    result: str | None = None


@dataclasses.dataclass
class MTask:
    """One row as the design says it must be."""

    id: str
    name: str
    dedup_key: str | None
    lease_ttl: float
    max_runtime: float | None
    max_recoveries: int
    on_timeout: str
    created_at: float
    state: State = State.PENDING
    attempt: int = 0
    recoveries: int = 0
    retries: int = 0
    owner: str | None = None
    #: Index of the execution whose token the row holds (``None``: no token).
    token_exec: int | None = None
    updated_at: float = 0.0
    eta: float | None = None
    next_retry_at: float | None = None
    finished_at: float | None = None
    progress_at: float | None = None
    published_at: float | None = None
    publish_count: int = 0
    cancel_requested: bool = False
    steps: dict[str, MStep] = dataclasses.field(default_factory=dict)
    #: Bumped when a new run replaces the row (resubmission, adoption after a purge).
    generation: int = 0
    #: The limited task's concurrency key (from its arguments); ``None``: not limited.
    key: str | None = None
    #: ``tasks.slot`` and ``tasks.slot_key`` as the store must have written them.
    slot: str | None = None
    slot_key: str | None = None
    #: ``tasks.held``: kept in the store until the reaper's held sweep publishes it.
    held: bool = False


@dataclasses.dataclass
class MWorker:
    id: str
    node: str
    heartbeat_at: float
    stopped: bool = False


@dataclasses.dataclass
class Exec:
    """One execution (one successful claim), current or stale."""

    lease: Lease
    worker: str
    generation: int


def expiry_decision(task: MTask, now: float, max_age: float | None) -> State:
    """policy.after_timeout, written again: what an expired lease becomes."""
    inflight = any(
        s.state == STEP_STARTED and not s.idempotent and s.attempt == task.attempt
        for s in task.steps.values()
    )
    if inflight:
        return State.WAIT_MANUAL
    if task.cancel_requested:
        return State.CANCELLED
    if task.on_timeout == "manual" or task.recoveries > task.max_recoveries:
        return State.WAIT_MANUAL
    if max_age is not None and now - task.created_at > max_age:
        return State.WAIT_MANUAL
    return State.RETRY_WAIT


def _key_of(spec: dict[str, Any]) -> str | None:
    """The key a submission of ``spec`` counts under (``None``: its task has no limit)."""
    if spec["name"] == LIMITED:
        return str(spec["key"])
    if spec["name"] == RATE:
        return str(spec["rate_key"])
    return None


# -- the machine ------------------------------------------------------------------------

PICK = st.integers(0, 1_000)


class StoreMachine(RuleBasedStateMachine):
    """Rules drive the real store; the model predicts; invariants compare."""

    #: Set by the test (or the script) before the machine runs.
    database: Database
    #: The store the machine drives (a test that plants a bug in a copy of a store
    #: statement drives a subclass).
    store_class: type[Store] = Store

    def __init__(self) -> None:
        super().__init__()
        self.db = self.database
        self.store = self.db.new_store(self.store_class)
        self.now = 0.0
        self.tasks: dict[str, MTask] = {}
        self.trails: dict[str, list[tuple[State | None, State, int]]] = {}
        self.tombstones: dict[str, float] = {}
        self.workers: list[MWorker] = []
        self.execs: list[Exec] = []
        self.paused: set[str] = set()
        #: Calls of each step's function: (task id, generation, step) -> count.
        self.calls: dict[tuple[str, int, str], int] = {}
        self.ids_made = 0
        #: The limited task's limit (drawn by :meth:`choose_limit`).
        self.limit = LIMITS[0]
        #: (name, key) pairs a limited claim locked (the store has a row for each).
        self.keys: set[tuple[str, str]] = set()
        #: The pairs the store told ``on_slots_freed`` since the last grant rule, and
        #: those the model says it must have told (runs holding a slot that ended, and
        #: rows marked waiting).
        self.freed: set[tuple[str, str]] = set()
        self.expected_freed: set[tuple[str, str]] = set()
        self.store.on_slots_freed = self.freed.update
        #: The rate-limited task's seconds between two starts (drawn by
        #: :meth:`start_rate`), and the limited task's (``None``: none; by :meth:`start`).
        self.rate_interval = RATE_INTERVALS[0]
        self.lim_interval: float | None = None
        #: Each rate-limited (name, key) a claim locked: its ``concurrency`` row's last
        #: start and next free start (seconds from EPOCH; ``None``: none yet).
        self.rates: dict[tuple[str, str], list[float | None]] = {}
        #: The starts the store made under each rate-limited (name, key): its claims'
        #: ``started_at`` (database time), whatever the model predicted.
        self.starts: dict[tuple[str, str], list[float]] = {}
        for node in NODES[:2]:  # two workers from the start; more come and go by rules
            self.start_worker(node)

    def teardown(self) -> None:
        self.db.drop(self.store)

    # -- helpers ------------------------------------------------------------------------

    def _new_id(self) -> str:
        self.ids_made += 1
        return f"t{self.ids_made}"

    def _audit(self, task: MTask, frm: State | None, to: State) -> None:
        self.trails.setdefault(task.id, []).append((frm, to, task.attempt))
        if frm is not None:
            assert task.state is frm
        if frm in LIVE and task.slot_key is not None:
            # a run that may hold a slot ended: the commit tells which (the grant counts)
            self.expected_freed.add((task.name, task.slot_key))
        task.state = to
        task.updated_at = self.now

    def _live_workers(self) -> list[MWorker]:
        return [w for w in self.workers if not w.stopped]

    def _pick(self, items: list[Any], i: int) -> Any:
        return items[i % len(items)]

    def _task_ids(self) -> list[str]:
        return sorted(self.tasks)

    def _holds(self, index: int) -> bool:
        """Whether execution ``index`` passes the fence (the row has its token and is
        RUNNING or WAIT_MANUAL)."""
        e = self.execs[index]
        task = self.tasks.get(e.lease.task_id)
        return task is not None and task.token_exec == index and task.state in LIVE

    def _exec(self, e: int, stale: bool) -> int:
        """An execution's index: with ``stale``, any (most are stale); otherwise one that
        holds its lease, if any does."""
        holding = [n for n in range(len(self.execs)) if self._holds(n)]
        if stale or not holding:
            return e % len(self.execs)
        return self._pick(holding, e)

    def _expired(self, task: MTask) -> bool:
        owner = next((w for w in self.workers if w.id == task.owner), None)
        return owner is None or owner.stopped or owner.heartbeat_at + task.lease_ttl < self.now

    def _new_task(self, spec: dict[str, Any], task_id: str) -> MTask:
        countdown = spec["countdown"]
        return MTask(
            id=task_id,
            name=spec["name"],
            key=_key_of(spec),
            dedup_key=spec["dedup_key"],
            lease_ttl=spec["lease_ttl"],
            max_runtime=spec["max_runtime"],
            max_recoveries=spec["max_recoveries"],
            on_timeout=spec["on_timeout"],
            created_at=self.now,
            updated_at=self.now,
            eta=None if countdown is None else self.now + countdown,
        )

    @staticmethod
    def _row(spec: dict[str, Any], task_id: str) -> NewTask:
        return NewTask(
            id=task_id,
            name=spec["name"],
            args="[]",
            kwargs="{}",
            options="{}",
            lease_ttl=spec["lease_ttl"],
            max_recoveries=spec["max_recoveries"],
            dedup_key=spec["dedup_key"],
            countdown=spec["countdown"],
            max_runtime=spec["max_runtime"],
            on_timeout=spec["on_timeout"],
        )

    def _expect_submit(self, spec: dict[str, Any], task_id: str) -> tuple[str, bool]:
        """The model's answer to a submission of ``task_id`` (and its effect)."""
        key = spec["dedup_key"]
        if key is not None:
            for t in self.tasks.values():
                if t.dedup_key == key:
                    return t.id, False
        existing = self.tasks.get(task_id)
        if existing is not None:
            if key is None and existing.state in (State.SUCCEEDED, State.FAILED):
                # a new run of a finished id: a fresh row in place of the old one
                task = self._new_task(spec, task_id)
                task.generation = existing.generation + 1
                self.tasks[task_id] = task
                self._audit(task, None, State.PENDING)
                return task_id, True
            return task_id, False
        task = self._new_task(spec, task_id)
        self.tasks[task_id] = task
        self._audit(task, None, State.PENDING)
        return task_id, True

    def _claimed(self, task: MTask, worker: MWorker, lease: Lease) -> None:
        if task.key is not None:
            # a rate alone holds no slot: its run counts under no key
            task.slot, task.slot_key = None, task.key if task.name == LIMITED else None
        task.attempt += 1
        assert lease.attempt == task.attempt, (lease, task.attempt)
        self._audit(task, State.PENDING, State.RUNNING)
        task.owner = worker.id
        task.progress_at = self.now
        task.finished_at = None
        task.next_retry_at = None
        self.execs.append(Exec(lease, worker.id, task.generation))
        task.token_exec = len(self.execs) - 1

    def _due(self, task: MTask) -> bool:
        return task.eta is None or task.eta <= self.now

    def _expire(self, task: MTask) -> State:
        """RUNNING -> TIMEOUT -> the policy's decision."""
        self._audit(task, State.RUNNING, State.TIMEOUT)
        task.token_exec = None
        task.recoveries += 1
        to = expiry_decision(task, self.now, TIMINGS["max_age"])
        self._audit(task, State.TIMEOUT, to)
        if to is State.RETRY_WAIT:
            task.next_retry_at = self.now
        if to is State.CANCELLED:
            task.finished_at = self.now
        return to

    def _published(self, task: MTask) -> None:
        if task.state is State.PENDING and task.published_at is None:
            task.published_at = self.now
            task.publish_count += 1

    def _unpublished(self, task: MTask) -> bool:
        """The reaper's ``take_unpublished`` takes this row."""
        if task.state is not State.PENDING or task.name in self.paused:
            return False
        if task.slot == WAITING:
            return False  # acked on purpose: published when granted a slot
        if task.published_at is None:
            # a held row is published by the held sweep, when due
            return not task.held and task.updated_at + TIMINGS["publish_grace"] < self.now
        pc = task.publish_count
        backoff = 1 if pc <= 1 else 64 if pc >= 7 else 1 << (pc - 1)
        base = max(task.eta if task.eta is not None else task.published_at, task.published_at)
        return base + TIMINGS["republish_after"] * backoff < self.now

    # -- concurrency limits --------------------------------------------------------------

    def _slot(self, task: MTask) -> Slot | None:
        """The slot a delivery of ``task`` claims with (``None``: not limited)."""
        if task.key is None:
            return None
        if task.name == RATE:
            return Slot(RATE, task.key, 0, self.rate_interval)
        return Slot(LIMITED, task.key, self.limit, self.lim_interval)

    def _locked(self, slot: Slot) -> None:
        """A claim with ``slot`` locked its (name, key): the store has its row."""
        pair = (slot.name, slot.key)
        if slot.limit > 0:
            self.keys.add(pair)
        if slot.interval is not None:
            self.rates.setdefault(pair, [None, None])

    def _in_use(self, name: str, key: str, exclude: str | None = None) -> int:
        """The slots in use under (name, key), as the design counts them: RUNNING rows of
        the key, rows granted a slot (not ``exclude``: a granted row claims its own),
        overruns whose owner lives."""

        def holds(t: MTask) -> bool:
            if t.state is State.PENDING:
                return t.slot == GRANTED and t.id != exclude
            if t.state is State.WAIT_MANUAL:
                return t.slot == OVERRUN and not self._expired(t)
            return t.state is State.RUNNING

        return sum(holds(t) for t in self.tasks.values() if (t.name, t.slot_key) == (name, key))

    def _waiting(self, name: str, key: str) -> list[MTask]:
        """The rows of (name, key) waiting for a slot, in the order grants take them."""
        rows = [
            t
            for t in self.tasks.values()
            if t.name == name
            and t.slot_key == key
            and t.state is State.PENDING
            and t.slot == WAITING
        ]
        return sorted(rows, key=lambda t: (t.created_at, t.id))

    def _waits_with_free_slot(self, name: str, key: str) -> list[str]:
        """Rows of (name, key) a grant should have given a slot (a paused task's wait)."""
        if name in self.paused or self._in_use(name, key) >= self.limit:
            return []
        return [t.id for t in self._waiting(name, key)]

    def _grant(self, name: str, key: str) -> list[str]:
        """``Slots.grant`` of one pair: its free slots to its oldest waiting rows."""
        if (name, key) not in self.keys or name in self.paused:
            return []
        free = self.limit - self._in_use(name, key)
        granted = self._waiting(name, key)[: max(0, free)]
        for task in granted:
            task.slot = GRANTED
            task.published_at = None
            task.updated_at = self.now
            task.held = False
        return [t.id for t in granted]

    def _published_granted(self, ids: list[str], published: bool) -> None:
        """The granter publishes the rows granted (``published``) or dies first (the
        reaper's grace sweep publishes them)."""
        if published and ids:
            self.store.mark_published(ids)
            for task_id in ids:
                self._published(self.tasks[task_id])

    @precondition(lambda self: self.freed)
    @rule(lost=st.sampled_from((False, False, False, True)), published=st.booleans())
    def grant_freed(self, lost: bool, published: bool) -> None:
        """The process whose commit freed slots grants them at once (``on_slots_freed``),
        unless it died first (``lost``: the backstop grants them)."""
        pairs = sorted(self.freed)
        self.freed.clear()
        self.expected_freed.clear()
        if lost:
            return
        rows = self.store.grant(pairs)
        expected = [i for name, key in pairs for i in self._grant(name, key)]
        assert sorted(p.id for p in rows) == sorted(expected), (rows, expected)
        if expected:
            _note("limits: a freed slot granted to a waiting row")
        for name, key in pairs:
            left = self._waits_with_free_slot(name, key)
            assert not left, f"{name}[{key}]: {left} wait with a slot free after its grant"
        self._published_granted(expected, published)

    @rule(published=st.booleans())
    def reap_waiting(self, published: bool) -> None:
        """The reaper's backstop: every key's free slots to its oldest waiting rows."""
        rows = self.store.take_waiting()
        expected = [i for name, key in sorted(self.keys) for i in self._grant(name, key)]
        assert sorted(p.id for p in rows) == sorted(expected), (rows, expected)
        if expected:
            _note("limits: the backstop granted a slot to a waiting row")
        for name, key in sorted(self.keys):
            left = self._waits_with_free_slot(name, key)
            assert not left, f"{name}[{key}]: {left} wait with a slot free after the backstop"
        self._published_granted(expected, published)

    @precondition(lambda self: self.workers)
    @rule(i=PICK)
    def worker_ends_its_runs(self, i: int) -> None:
        """A worker stopping (or restarted) ends every run it owns: its RUNNING rows
        expire, its overruns give their slot back (and stay WAIT_MANUAL)."""
        worker = self._pick(self.workers, i)
        expiries = self.store.expire(
            actor="w", reason="worker stopping", owners=[worker.id], only_expired=False
        )
        for task in self.tasks.values():
            mine = task.owner == worker.id and task.state is State.WAIT_MANUAL
            if mine and task.slot == OVERRUN:
                assert task.slot_key is not None
                task.slot = None
                self.expected_freed.add((task.name, task.slot_key))
                _note("limits: an overrun's run ended, its slot freed")
        expected: dict[str, State] = {}
        for task in self.tasks.values():
            if task.state is State.RUNNING and task.owner == worker.id:
                expected[task.id] = self._expire(task)
        assert {e.task_id: e.to_state for e in expiries} == expected

    # -- time and workers -----------------------------------------------------------------

    @rule(seconds=st.sampled_from(TICKS), beating=st.sampled_from(BEATING))
    def tick(self, seconds: int, beating: int) -> None:
        """Time passes; the workers whose bit is set in ``beating`` renew meanwhile."""
        for i, worker in enumerate(self.workers[-3:]):
            if beating & (1 << i):
                self._renew(worker)
        self.now += seconds
        self.db.set_clock(self.now)

    def _renew(self, worker: MWorker) -> None:
        renewed = self.store.renew(worker.id)
        assert renewed == (not worker.stopped)
        if renewed:
            worker.heartbeat_at = self.now

    @precondition(lambda self: len(self.workers) < 6)
    @rule(node=st.sampled_from(NODES))
    def start_worker(self, node: str) -> None:
        """A new incarnation under ``node``: earlier live ones of that node are superseded."""
        worker = MWorker(f"w{len(self.workers) + 1}-{uuid.uuid4().hex[:6]}", node, self.now)
        superseded = self.store.register_worker(worker.id, node, "host", 1000 + len(self.workers))
        expected = {w.id for w in self.workers if w.node == node and not w.stopped}
        assert set(superseded) == expected
        for w in self.workers:
            if w.id in expected:
                w.stopped = True
        self.workers.append(worker)

    @precondition(lambda self: self.workers)
    @rule(i=PICK)
    def heartbeat(self, i: int) -> None:
        self._renew(self._pick(self.workers, i))

    @precondition(lambda self: self.workers)
    @rule(i=PICK)
    def stop_worker(self, i: int) -> None:
        worker = self._pick(self.workers, i)
        self.store.stop_worker(worker.id, "stopped by the model")
        worker.stopped = True

    # -- submissions ----------------------------------------------------------------------

    specs = st.fixed_dictionaries(
        {
            "name": st.sampled_from((*NAMES, LIMITED)),  # half of them limited
            "dedup_key": st.none() | st.sampled_from(DEDUP_KEYS),
            "lease_ttl": st.sampled_from(LEASE_TTLS),
            "max_runtime": st.sampled_from(MAX_RUNTIMES),
            "max_recoveries": st.integers(0, 2),
            "on_timeout": st.sampled_from(("retry", "retry", "retry", "manual")),
            "countdown": st.sampled_from(COUNTDOWNS),
            "key": st.sampled_from(SLOT_KEYS),
            "rate_key": st.sampled_from(RATE_KEYS),
        }
    )

    @initialize(
        limit=st.sampled_from(LIMITS),
        spec=specs,
        key=st.sampled_from(SLOT_KEYS),
        n=st.integers(2, 3),
        workers=st.lists(PICK, max_size=3),
        interval=st.sampled_from((None, None, *RATE_INTERVALS)),
    )
    def start(
        self,
        limit: int,
        spec: dict[str, Any],
        key: str,
        n: int,
        workers: list[int],
        interval: float | None = None,
    ) -> None:
        """The limited task's ``concurrency_limit`` in this example, its
        ``global_rate_limit`` (or none), and a first burst of its rows (see
        :meth:`submit_limited`): every example starts with work to do, and a limit to
        respect."""
        self.limit, self.lim_interval = limit, interval
        self.submit_limited(spec, key, n, workers)

    @initialize(
        interval=st.sampled_from(RATE_INTERVALS),
        spec=specs,
        key=st.sampled_from(RATE_KEYS),
        n=st.integers(2, 3),
        workers=st.lists(PICK, max_size=3),
    )
    def start_rate(
        self, interval: float, spec: dict[str, Any], key: str, n: int, workers: list[int]
    ) -> None:
        """The rate-limited task's ``global_rate_limit`` in this example, and a first
        burst of its rows (see :meth:`submit_rate`): the first delivered starts, the
        others are paced, one an interval."""
        self.rate_interval = interval
        self.submit_rate(spec, key, n, workers)

    @precondition(lambda self: len(self.tasks) < MAX_TASKS)
    @rule(spec=specs)
    def submit(self, spec: dict[str, Any]) -> None:
        task_id = self._new_id()
        answer = self.store.submit(self._row(spec, task_id))
        assert answer == self._expect_submit(spec, task_id)

    @precondition(lambda self: len(self.tasks) < MAX_TASKS)
    @rule(
        spec=specs,
        key=st.sampled_from(SLOT_KEYS),
        n=st.integers(2, 3),
        workers=st.lists(PICK, max_size=3),
    )
    def submit_limited(self, spec: dict[str, Any], key: str, n: int, workers: list[int]) -> None:
        """A few rows of the limited task under one key, due at once, published, and
        as many delivered as ``workers`` picks (to those workers, in turn: the count
        stops those past the limit)."""
        spec = {**spec, "name": LIMITED, "key": key, "dedup_key": None, "countdown": None}
        self._burst(spec, n, workers)

    @precondition(lambda self: len(self.tasks) < MAX_TASKS)
    @rule(
        spec=specs,
        key=st.sampled_from(RATE_KEYS),
        n=st.integers(2, 4),
        workers=st.lists(PICK, max_size=4),
    )
    def submit_rate(self, spec: dict[str, Any], key: str, n: int, workers: list[int]) -> None:
        """A few rows of the rate-limited task under one key, due at once, published,
        and as many delivered as ``workers`` picks (the rate paces those after the
        first a key starts)."""
        spec = {**spec, "name": RATE, "rate_key": key, "dedup_key": None, "countdown": None}
        self._burst(spec, n, workers)

    def _burst(self, spec: dict[str, Any], n: int, workers: list[int]) -> None:
        ids = [self._new_id() for _ in range(n)]
        answers = self.store.submit_many([self._row(spec, i) for i in ids])
        assert answers == [self._expect_submit(spec, i) for i in ids]
        self.store.mark_published(ids)
        for task_id in ids:
            self._published(self.tasks[task_id])
        for task_id, w in zip(ids, workers, strict=False):
            if self._live_workers():
                self._deliver(self._pick(self._live_workers(), w), self.tasks[task_id])

    @precondition(lambda self: self.tasks)
    @rule(i=PICK, spec=specs)
    def submit_again(self, i: int, spec: dict[str, Any]) -> None:
        """The same task id sent again (no dedup key): a finished run is replaced."""
        task_id = self._pick(self._task_ids(), i)
        spec = {**spec, "dedup_key": None}
        answer = self.store.submit(self._row(spec, task_id))
        assert answer == self._expect_submit(spec, task_id)

    @precondition(lambda self: len(self.tasks) < MAX_TASKS)
    @rule(batch=st.lists(specs, min_size=1, max_size=4))
    def submit_many(self, batch: list[dict[str, Any]]) -> None:
        ids = [self._new_id() for _ in batch]
        answers = self.store.submit_many([self._row(s, i) for s, i in zip(batch, ids, strict=True)])
        expected = [self._expect_submit(s, i) for s, i in zip(batch, ids, strict=True)]
        assert answers == expected, f"submit_many answered {answers}, the model says {expected}"

    @precondition(lambda self: self.tasks)
    @rule(i=PICK)
    def producer_publishes(self, i: int) -> None:
        """The producer handed the row's message to the broker and marks it published."""
        task = self.tasks[self._pick(self._task_ids(), i)]
        self.store.mark_published([task.id])
        self._published(task)

    # -- claims ---------------------------------------------------------------------------

    @precondition(lambda self: self.tasks and self._live_workers())
    @rule(w=PICK, i=PICK, duplicate=st.booleans())
    def claim(self, w: int, i: int, duplicate: bool) -> None:
        """A delivery claimed (``duplicate``: of any task, most often one that is not
        PENDING: a duplicate or stale delivery, refused)."""
        worker = self._pick(self._live_workers(), w)
        pending = [t for t in self._task_ids() if self.tasks[t].state is State.PENDING]
        task = self.tasks[self._pick(pending if pending and not duplicate else self._task_ids(), i)]
        self._deliver(worker, task)

    @precondition(lambda self: self._live_workers() and self._pending_limited())
    @rule(picks=st.lists(st.tuples(PICK, PICK), min_size=1, max_size=3))
    def claim_limited(self, picks: list[tuple[int, int]]) -> None:
        """Deliveries of PENDING rows of the limited or the rate-limited task to some
        workers, one after the other (the count may stop them, or the rate pace them)."""
        for w, i in picks:
            pending = self._pending_limited()
            if not pending or not self._live_workers():
                return
            worker = self._pick(self._live_workers(), w)
            self._deliver(worker, self.tasks[self._pick(pending, i)])

    def _pending_limited(self) -> list[str]:
        return [t.id for t in self.tasks.values() if t.key is not None and t.state is State.PENDING]

    @precondition(lambda self: self._live_workers() and self._paced())
    @rule(w=PICK, i=PICK, late=st.sampled_from(LATENESS))
    def paced_delivery(self, w: int, i: int, late: int) -> None:
        """A paced row's message, published again for its start, arrives: time passes
        to the whole second that follows its ETA (the workers renewing), and ``late``
        seconds more (a backlog ahead of it, a worker stopped)."""
        task = self.tasks[self._pick(self._paced(), i)]
        assert task.eta is not None
        target = max(self.now, math.ceil(task.eta)) + late
        if target > self.now:
            self.tick(seconds=int(target - self.now), beating=7)
        if self._live_workers():
            self._deliver(self._pick(self._live_workers(), w), task)

    def _paced(self) -> list[str]:
        return sorted(
            t.id for t in self.tasks.values() if t.state is State.PENDING and t.slot == PACED
        )

    def _deliver(self, worker: MWorker, task: MTask) -> None:
        slot = self._slot(task)
        answer = self._claim(task.id, worker, slot)
        if slot is not None:
            self._locked(slot)
            self._record_start(task.id, slot, answer)
        if task.state is State.PENDING and self._due(task):
            if slot is not None and not self._starts(task, slot, answer):
                return
            assert isinstance(answer, Claim), (
                f"claim of {task.id} answered {answer}, the model says it claims"
            )
            assert answer.resumed == (task.attempt > 0)
            assert answer.cancel_requested == task.cancel_requested
            assert (answer.retries, answer.recoveries) == (task.retries, task.recoveries)
            self._claimed(task, worker, answer.lease)
            return
        assert isinstance(answer, Refusal), answer
        assert answer.state is task.state
        assert answer.early == (task.state is State.PENDING)
        assert not answer.waiting and not answer.paced

    def _claim(self, task_id: str, worker: MWorker, slot: Slot | None) -> Claim | Refusal:
        return self.store.claim(task_id, worker.id, f"worker:{worker.node}", slot=slot)

    def _starts(self, task: MTask, slot: Slot, answer: Claim | Refusal) -> bool:
        """Whether the claim of a due PENDING row of a limited or rate-limited task
        starts it: with a rate, the key must be idle or the row on time for its
        reserved start (otherwise it is paced, whatever the count); with a limit, a
        slot must be free under its key (otherwise it waits)."""
        if slot.interval is not None and not self._may_start(task, slot, answer):
            self._paces(task, slot, answer)
            return False
        if slot.limit > 0 and self._in_use(slot.name, slot.key, task.id) >= slot.limit:
            self._waits(task, slot, answer)
            return False
        if slot.interval is not None:
            self._took_start(task, slot)
        return True

    def _may_start(self, task: MTask, slot: Slot, answer: Claim | Refusal) -> bool:
        """``Claims._may_start``, written again: the key is idle (its last start's
        interval has ended), or the row was paced and comes on time for its reserved
        start (its ETA passed less than an interval ago) in an interval no other start
        took (the key's last start is an interval before it at least)."""
        assert slot.interval is not None
        last, following = self.rates[(slot.name, slot.key)]
        interval, now = slot.interval, self.now
        on_time = (
            task.slot == PACED
            and task.eta is not None
            and task.eta > now - interval
            and (last is None or last <= task.eta - interval)
        )
        # (a key whose last start is not known is idle once its next start has come)
        idle = (following is None or following <= now) if last is None else last <= now - interval
        if last == now - interval and not on_time and not self.db.is_pg:
            # the boundary of the rate itself (see the module's docstring): SQLite's
            # answer decides
            _note("rate: a delivery at the idle boundary (SQLite's rounding decides)")
            idle = isinstance(answer, Claim) or (isinstance(answer, Refusal) and answer.waiting)
        return idle or on_time

    def _took_start(self, task: MTask, slot: Slot) -> None:
        """``Claims._record_start``, written again: the start the claim records as the
        key's last (a reserved start taken on time: its time; otherwise the end of the
        last start's interval, or the moment an interval back if that is later), and
        the key's next free start, an interval from now at least."""
        assert slot.interval is not None
        pair = (slot.name, slot.key)
        last, following = self.rates[pair]
        interval, now = slot.interval, self.now
        reserved = task.eta if task.slot == PACED else None
        at = max(now if last is None else last + interval, now - interval)
        if reserved is None:
            _note("rate: a delivery started in an idle key")
        elif reserved > now - interval and (last is None or last <= reserved - interval):
            at = reserved
            _note("rate: a paced row started on time, at its reserved start")
        else:
            _note("rate: a paced row, late, started in an idle key")
        soonest = now + interval
        self.rates[pair] = [at, soonest if following is None else max(following, soonest)]

    def _paces(self, task: MTask, slot: Slot, answer: Claim | Refusal) -> None:
        """``Claims._pace``, written again: a due PENDING row that may not start is given
        the key's next free start (its ETA; the next free start moves an interval on),
        published again for it by its worker, or held in the store when it is more
        than ``lease_hold_eta_after`` away."""
        assert slot.interval is not None
        pair = (slot.name, slot.key)
        last, following = self.rates[pair]
        start = following if following is not None and following > self.now else None
        start = self.now + slot.interval if start is None else start
        held = start - self.now > TIMINGS["hold_eta_after"]
        assert isinstance(answer, Refusal) and answer.paced, (
            f"claim of {task.id} answered {answer}, the model says it is paced to the "
            f"start at {start} (now {self.now}; {slot.label()}'s last start {last})"
        )
        assert answer.state is State.PENDING and not answer.waiting and not answer.early
        assert answer.held == held, f"paced to {start} (now {self.now}): held {answer.held}"
        _note("rate: a delivery paced again" if task.slot == PACED else "rate: a delivery paced")
        if held:
            _note("rate: a paced row held in the store")
        self.rates[pair] = [last, start + slot.interval]
        task.slot, task.slot_key, task.eta, task.held = PACED, slot.key, start, held
        task.updated_at = self.now
        if not held:
            # its worker publishes it again at once, due at its start
            rows = self.store.take_pending([task.id])
            assert [p.id for p in rows] == [task.id], rows
            countdown = rows[0].countdown
            assert countdown is not None and abs(countdown - (start - self.now)) < 1e-3, rows
            task.published_at = None
            self.store.mark_published([task.id])
            self._published(task)

    def _record_start(self, task_id: str, slot: Slot, answer: Claim | Refusal) -> None:
        """A start the store made under a rate-limited key, as it recorded it (the
        claim's ``started_at``: database time), whatever the model predicted."""
        if slot.interval is None or not isinstance(answer, Claim):
            return
        t = self.store.t.tasks
        with self.store.engine.connect() as conn:
            at = conn.execute(select(t.c.started_at).where(t.c.id == task_id)).scalar_one()
        started = _seconds(at)
        assert started is not None and _same(started, self.now), (task_id, at, self.now)
        self.starts.setdefault((slot.name, slot.key), []).append(started)

    def _waits(self, task: MTask, slot: Slot, answer: Claim | Refusal) -> None:
        """A due PENDING row whose claim the count stops: it waits for a slot."""
        assert isinstance(answer, Refusal) and answer.waiting, (
            f"claim of {task.id} answered {answer}, the model says it waits: "
            f"{self._in_use(slot.name, slot.key, task.id)} of {slot.label()}'s "
            f"{slot.limit} slots in use"
        )
        assert answer.state is State.PENDING
        _note("limits: a claim found no slot, the row waits")
        task.slot, task.slot_key = WAITING, slot.key
        task.updated_at = self.now
        # once committed, the mark asks for its key's grant (a free it raced, whose
        # grant read before the mark, is given then)
        self.expected_freed.add((slot.name, slot.key))

    @precondition(lambda self: self._live_workers())
    @rule(w=PICK, i=PICK, known=st.booleans(), spec=specs)
    def claim_adopting(self, w: int, i: int, known: bool, spec: dict[str, Any]) -> None:
        """A message with no row: adopted at claim, unless its id has a tombstone."""
        worker = self._pick(self._live_workers(), w)
        tombs = sorted(t for t in self.tombstones if t not in self.tasks)
        if known and tombs:
            task_id = self._pick(tombs, i)
        else:
            if len(self.tasks) >= MAX_TASKS:
                return
            task_id = self._new_id()
        spec = {**spec, "dedup_key": None, "countdown": None}
        task = self._new_task(spec, task_id)
        slot = self._slot(task)
        answer = self.store.claim(
            task_id, worker.id, f"worker:{worker.node}", adopt=self._row(spec, task_id), slot=slot
        )
        if slot is not None:
            self._locked(slot)
            self._record_start(task_id, slot, answer)
        if task_id in self.tombstones:
            assert isinstance(answer, Refusal) and answer.state is None, answer
            return
        task.published_at = self.now
        self.tasks[task_id] = task
        self._audit(task, None, State.PENDING)
        if slot is not None and not self._starts(task, slot, answer):
            return
        assert isinstance(answer, Claim), answer
        assert answer.resumed
        self._claimed(task, worker, answer.lease)

    @precondition(lambda self: self.tasks and self._live_workers())
    @rule(w=PICK, picks=st.sets(PICK, min_size=1, max_size=4))
    def claim_many(self, w: int, picks: set[int]) -> None:
        """Deliveries that arrived together, claimed ahead in one statement."""
        worker = self._pick(self._live_workers(), w)
        ids = sorted({self._pick(self._task_ids(), p) for p in picks})
        # a limited task's deliveries are never claimed ahead (a slot is taken only by
        # the pool process that runs it)
        ids = [i for i in ids if self.tasks[i].key is None]
        if not ids:
            return
        asks = [(task_id, uuid.uuid4().hex) for task_id in ids]
        claims = self.store.claim_many(asks, worker.id, f"worker:{worker.node}")
        for task_id, token in asks:
            task = self.tasks[task_id]
            eligible = (
                task.state is State.PENDING
                and self._due(task)
                and task.max_runtime is None
                and task.on_timeout == "retry"
            )
            assert (token in claims) == eligible, (task, claims)
            if eligible:
                self._claimed(task, worker, claims[token].lease)
        assert set(claims) <= {token for _, token in asks}

    # -- a running task's writes, from the current execution or a stale one ---------------

    @precondition(lambda self: self.execs)
    @rule(e=PICK, stale=st.booleans(), name=st.sampled_from(STEPS), idempotent=st.booleans())
    def step(self, e: int, stale: bool, name: str, idempotent: bool) -> None:
        """A step as a task runs it: a done step returns its stored result without
        running; a non-idempotent one records its start (fenced) before calling out;
        the result is stored first-writer-wins (fenced)."""
        index = self._exec(e, stale)
        ex = self.execs[index]
        lease = ex.lease
        holds = self._holds(index)
        task = self.tasks.get(lease.task_id)
        recorded = self.store.load_steps(lease.task_id)
        model_step = task.steps.get(name) if task is not None else None
        if model_step is not None and model_step.state == STEP_DONE:
            assert recorded[name].state == STEP_DONE
            return  # returned from the record: not run again
        if not idempotent:
            answer = self.store.step_started(lease, name, checkable=False)
            if not holds:
                assert answer is None, "a stale execution's step start was accepted"
                return
            assert task is not None and answer is not None
            task.progress_at = self.now
            assert answer.cancel_requested == task.cancel_requested
            if answer.cancel_requested:
                return  # stops before calling out; nothing recorded
            task.steps[name] = MStep(STEP_STARTED, lease.attempt, False)
        key = (lease.task_id, ex.generation, name)
        assert model_step is None or model_step.state != STEP_DONE, "a done step ran again"
        self.calls[key] = self.calls.get(key, 0) + 1
        result = json.dumps(f"{name}@{lease.attempt}#{self.calls[key]}")
        fenced, stored = self.store.step_done(lease, name, result, idempotent=idempotent)
        if not holds:
            assert fenced is None, "a stale execution's step result was accepted"
            return
        assert task is not None and fenced is not None
        task.progress_at = self.now
        before = task.steps.get(name)
        task.steps[name] = MStep(
            STEP_DONE, lease.attempt, before.idempotent if before else idempotent, result
        )
        assert stored == result

    @precondition(lambda self: self.execs)
    @rule(e=PICK, stale=st.booleans(), value=st.integers(0, 99))
    def save_progress(self, e: int, stale: bool, value: int) -> None:
        index = self._exec(e, stale)
        answer = self.store.save_progress(self.execs[index].lease, json.dumps(value))
        if not self._holds(index):
            assert answer is None, "a stale execution's progress was accepted"
            return
        assert answer is not None
        self.tasks[self.execs[index].lease.task_id].progress_at = self.now

    outcomes = st.sampled_from(("success", "failure", "cancelled", "retry"))

    @precondition(lambda self: self.execs)
    @rule(
        e=PICK,
        stale=st.booleans(),
        kind=outcomes,
        batched=st.booleans(),
        delay=st.sampled_from(RETRY_DELAYS),
    )
    def outcome(self, e: int, stale: bool, kind: str, batched: bool, delay: float) -> None:
        """The execution's own outcome, one by one or through the batch writer."""
        index = self._exec(e, stale)
        lease = self.execs[index].lease
        ok = self._write_outcome(lease, kind, batched, delay)
        self._expect_outcome(index, kind, delay, ok)

    @precondition(lambda self: self._holding_limited())
    @rule(i=PICK, kind=outcomes, batched=st.booleans(), delay=st.sampled_from(RETRY_DELAYS))
    def limited_outcome(self, i: int, kind: str, batched: bool, delay: float) -> None:
        """A run of the limited task ends with its outcome (which frees its slot)."""
        index = self._pick(self._holding_limited(), i)
        lease = self.execs[index].lease
        task = self.tasks[lease.task_id]
        pair = (task.name, str(task.slot_key))
        # on PostgreSQL an outcome written alone that says it holds a slot tells
        # on_slots_freed only when a row waits for the key (one process here: no other
        # change of the key comes between its snapshot and its lock)
        quiet = (
            self.db.is_pg
            and not batched
            and kind != "retry"
            and task.state is State.RUNNING
            and pair not in self.expected_freed
            and not any(
                m.state is State.PENDING and m.slot == WAITING and (m.name, m.slot_key) == pair
                for m in self.tasks.values()
            )
        )
        ok = self._write_outcome(lease, kind, batched, delay, holds_slot=True)
        self._expect_outcome(index, kind, delay, ok)
        if ok and quiet:
            self.expected_freed.discard(pair)
            _note("limits: an outcome freed a slot no row waited for: no grant")

    def _holding_limited(self) -> list[int]:
        """The executions of the limited task that hold their lease."""
        return [
            n
            for n, ex in enumerate(self.execs)
            if self._holds(n) and self.tasks[ex.lease.task_id].name == LIMITED
        ]

    def _write_outcome(
        self, lease: Lease, kind: str, batched: bool, delay: float, holds_slot: bool = False
    ) -> bool:
        if kind == "retry":
            if batched:
                return self.store.retry_many(
                    [Outcome(lease, State.RETRY_WAIT, "retry", delay=delay)], actor="w"
                )[0]
            return self.store.schedule_retry(lease, delay, actor="w", reason="retry", error=None)
        to = {"success": State.SUCCEEDED, "failure": State.FAILED, "cancelled": State.CANCELLED}
        if batched:
            return self.store.finish_many([Outcome(lease, to[kind], kind)], actor="w")[0]
        return self.store.finish(lease, to[kind], actor="w", reason=kind, holds_slot=holds_slot)

    def _expect_outcome(self, index: int, kind: str, delay: float, ok: bool) -> None:
        task = self.tasks.get(self.execs[index].lease.task_id)
        to = {"success": State.SUCCEEDED, "failure": State.FAILED, "cancelled": State.CANCELLED}
        if kind == "retry":
            allowed = self._holds(index) and task is not None and task.state is State.RUNNING
        else:
            allowed = (
                self._holds(index)
                and task is not None
                and task.state in sources(to[kind], Actor.TASK)
            )
        assert ok == allowed, f"outcome {kind} answered {ok}, the model says {allowed}"
        if not ok:
            return
        assert task is not None
        if kind == "retry":
            self._audit(task, State.RUNNING, State.RETRY_WAIT)
            task.retries += 1
            self._audit(task, State.RETRY_WAIT, State.PENDING)
            task.eta = self.now + delay
            task.next_retry_at = None
            task.published_at = None
            task.publish_count = 0
            task.held = False  # published by its worker
            return
        self._audit(task, task.state, to[kind])
        task.finished_at = self.now

    @precondition(lambda self: self.execs)
    @rule(e=PICK, stale=st.booleans())
    def give_up(self, e: int, stale: bool) -> None:
        """The worker saw the execution end without an outcome (its child died)."""
        index = self._exec(e, stale)
        lease = self.execs[index].lease
        expiry = self.store.give_up(lease, actor="w", reason="child lost")
        task = self.tasks.get(lease.task_id)
        if not (self._holds(index) and task is not None and task.state is State.RUNNING):
            assert expiry is None, "a stale execution gave up a lease it did not hold"
            return
        assert expiry is not None
        assert expiry.to_state is self._expire(task)

    # -- the reaper -----------------------------------------------------------------------

    @rule()
    def reap_expired(self) -> None:
        expiries = self.store.expire(actor="reaper", reason="lease expired")
        expected: dict[str, State] = {}
        for task in self.tasks.values():
            if task.state is State.RUNNING and self._expired(task):
                expected[task.id] = self._expire(task)
        assert {e.task_id: e.to_state for e in expiries} == expected

    @rule()
    def reap_overrun(self) -> None:
        moved = self.store.overrun(actor="reaper")
        expected = set()
        for task in self.tasks.values():
            if (
                task.state is State.RUNNING
                and task.max_runtime is not None
                and task.progress_at is not None
                and task.progress_at + task.max_runtime < self.now
                and any(w.id == task.owner for w in self.workers)
                and not self._expired(task)
            ):
                expected.add(task.id)
                self._audit(task, State.RUNNING, State.WAIT_MANUAL)  # the owner keeps its token
                if task.slot_key is not None:
                    task.slot = OVERRUN  # its run goes on: it keeps its slot while its owner lives
                    _note("limits: an overrun keeps its slot")
        assert set(moved) == expected

    @rule()
    def reap_due_retries(self) -> None:
        taken = self.store.take_due_retries(actor="reaper")
        expected = set()
        for task in self.tasks.values():
            due = task.next_retry_at is not None and task.next_retry_at <= self.now
            if task.state is State.RETRY_WAIT and due:
                expected.add(task.id)
                self._audit(task, State.RETRY_WAIT, State.PENDING)
                task.published_at = None
                task.eta = None
                task.publish_count = 0
                task.held = False
        assert {p.id for p in taken} == expected

    @rule()
    def reap_republish(self) -> None:
        """Rows never published, or whose message looks lost: reserved, then published."""
        taken = self.store.take_unpublished()
        expected = {t.id for t in self.tasks.values() if self._unpublished(t)}
        assert {p.id for p in taken} == expected
        for task_id in expected:
            task = self.tasks[task_id]
            task.published_at = None
            task.updated_at = self.now
            task.held = False
        self.store.mark_published(sorted(expected))
        for task_id in expected:
            self._published(self.tasks[task_id])

    @rule(published=st.booleans())
    def reap_held(self, published: bool) -> None:
        """The reaper's held sweep: rows held in the store (a start a rate limit
        reserved far ahead) whose ETA comes within a reaper interval, reserved for
        publishing (``published``: and published; otherwise the grace sweep does it);
        a held row that left PENDING only loses its mark."""
        taken = self.store.take_held()
        expected = []
        for task in self.tasks.values():
            soon = task.eta is not None and task.eta <= self.now + TIMINGS["reaper_interval"]
            if not (task.held and soon and task.name not in self.paused):
                continue
            task.held = False
            if task.state is State.PENDING:
                expected.append(task.id)
                task.published_at = None
                task.updated_at = self.now
        assert sorted(p.id for p in taken) == sorted(expected), (taken, expected)
        if expected:
            _note("rate: the held sweep published a paced row")
        if published and expected:
            self.store.mark_published(expected)
            for task_id in expected:
                self._published(self.tasks[task_id])

    @rule()
    def retention(self) -> None:
        purged = self.store.purge_expired(TIMINGS["retention"])
        gone = [
            t
            for t in self.tasks.values()
            if t.state in FINISHED
            and t.finished_at is not None
            and t.finished_at < self.now - TIMINGS["retention"]
        ]
        assert purged == len(gone)
        for task in gone:
            start = max(task.eta if task.eta is not None else self.now, self.now)
            self.tombstones[task.id] = start + TIMINGS["retention"]
            del self.tasks[task.id]
            del self.trails[task.id]
        dropped = self.store.purge_tombstones()
        old = [i for i, keep in self.tombstones.items() if keep < self.now]
        assert dropped == len(old)
        for task_id in old:
            del self.tombstones[task_id]

    # -- operators ------------------------------------------------------------------------

    actions = st.sampled_from(("retry", "fail", "resolve", "cancel"))

    @precondition(lambda self: self.tasks)
    @rule(i=PICK, action=actions)
    def operator(self, i: int, action: str) -> None:
        task = self.tasks[self._pick(self._task_ids(), i)]
        if action == "cancel":
            self._cancel(task)
            return
        to = {"retry": State.PENDING, "fail": State.FAILED, "resolve": State.SUCCEEDED}[action]
        allowed = task.state in sources(to, Actor.OPERATOR)
        try:
            left = self.store.operator_move(task.id, to, actor="op", reason=f"operator {action}")
        except IllegalTransition:
            assert not allowed, f"operator {action} refused from {task.state}"
            return
        assert allowed, f"operator {action} accepted from {task.state}"
        assert left is task.state
        self._audit(task, task.state, to)
        task.token_exec = None
        if to is State.PENDING:
            task.publish_count = 0
            task.published_at = None
            task.next_retry_at = None
            task.finished_at = None
            task.eta = None
            task.held = False
            task.cancel_requested = False
            # a person decided: steps whose outcome was unknown run again
            task.steps = {n: s for n, s in task.steps.items() if s.state == STEP_DONE}
        else:
            task.finished_at = self.now

    def _cancel(self, task: MTask) -> None:
        try:
            found = self.store.request_cancel(task.id, actor="op", reason="operator cancel")
        except IllegalTransition:
            assert task.state in (State.SUCCEEDED, State.CANCELLED), task.state
            return
        assert found is task.state
        if task.state is State.RUNNING:
            task.cancel_requested = True  # the task stops at its next step boundary
            return
        if task.state is State.PENDING and task.slot in (WAITING, GRANTED):
            _note(f"limits: a {task.slot} row cancelled")  # it stops counting, takes nothing
        if task.state is State.PENDING and task.slot == PACED:
            _note("rate: a paced row cancelled")  # its start is never taken (rates_hold)
        self._audit(task, task.state, State.CANCELLED)
        task.finished_at = self.now
        task.token_exec = None

    @rule(i=PICK)
    def operator_on_a_missing_task(self, i: int) -> None:
        task_id = f"missing-{i}"
        try:
            self.store.operator_move(task_id, State.PENDING, actor="op", reason="retry")
        except TaskNotFound:
            return
        raise AssertionError("an operator moved a task that has no row")

    @rule(name=st.sampled_from(NAMES), pause=st.booleans())
    def pause(self, name: str, pause: bool) -> None:
        if pause:
            assert self.store.pause("task", name, actor="op", reason="p") == (
                name not in self.paused
            )
            self.paused.add(name)
        else:
            assert self.store.resume("task", name, actor="op", reason="r") == (name in self.paused)
            self.paused.discard(name)
        assert {p.target for p in self.store.pauses()} == self.paused

    @precondition(lambda self: self.tasks)
    @rule(i=PICK)
    def hold_for_pause(self, i: int) -> None:
        """A worker dropped a delivery of a paused task: the row waits for the pause."""
        task = self.tasks[self._pick(self._task_ids(), i)]
        assert self.store.hold_for_pause(task.id) == (task.state is State.PENDING)
        if task.state is State.PENDING:
            task.published_at = HELD

    # -- what must hold after every rule --------------------------------------------------

    @precondition(lambda self: self.execs)
    @rule(i=PICK)
    def probe_leases(self, i: int) -> None:
        """Ask the store, execution by execution, which of a task's executions holds its
        lease: at most one, the one the model says."""
        task_id = self._pick(self.execs, i).lease.task_id
        live = [
            n
            for n, ex in enumerate(self.execs)
            if ex.lease.task_id == task_id and self.store.check_lease(ex.lease) is not None
        ]
        assert len(live) <= 1, f"task {task_id} has {len(live)} live executions"
        expected = [
            n for n, ex in enumerate(self.execs) if ex.lease.task_id == task_id and self._holds(n)
        ]
        assert live == expected, f"task {task_id}: live {live}, the model says {expected}"

    @invariant()
    def lease_check_finds_nothing(self) -> None:
        """No safety invariant of ``lease check`` is broken; of its liveness kinds,
        ``waiting_with_free_slot`` (at no grace) names only rows that wait while their
        key has a slot free (the others need a reaper the rules run when they choose)."""
        found = check(self.store, liveness=True, grace=0.0)
        broken = [v for v in found if v.kind not in LIVENESS_KINDS]
        assert broken == [], "\n".join(map(str, broken))
        reported = {v.task_id for v in found if v.kind == "waiting_with_free_slot"}
        free = {i for name, key in self.keys for i in self._waits_with_free_slot(name, key)}
        assert reported <= free, f"lease check: {reported} wait with a slot free, model: {free}"

    @invariant()
    def limits_hold(self) -> None:
        """No (name, key) has more slots in use than its limit, counted from the rows
        themselves and by the store (``slot_usage``); every row's ``slot`` and
        ``slot_key`` are the model's; and every commit that ended a run holding a slot
        told ``on_slots_freed``."""
        t = self.store.t.tasks
        columns = (t.c.id, t.c.name, t.c.slot_key, t.c.state, t.c.slot, t.c.owner, t.c.lease_ttl)
        with self.store.engine.connect() as conn:
            rows = conn.execute(select(*columns)).all()
        beats = {w.id: w.heartbeat_at for w in self.workers if not w.stopped}
        # running (and overruns whose owner lives), granted, waiting
        counted: dict[tuple[str, str], list[int]] = {k: [0, 0, 0] for k in self.keys}
        # (a rate alone holds no slot: its paced rows' keys count nothing)
        for r in (r for r in rows if r.slot_key is not None and r.name != RATE):
            n = counted.setdefault((str(r.name), str(r.slot_key)), [0, 0, 0])
            beat = beats.get(r.owner)
            if r.state == State.RUNNING.value:
                n[0] += 1
            elif r.state == State.PENDING.value and r.slot in (GRANTED, WAITING):
                n[1 if r.slot == GRANTED else 2] += 1
            elif r.state == State.WAIT_MANUAL.value and r.slot == OVERRUN:
                n[0] += beat is not None and beat + float(r.lease_ttl) >= self.now
        for pair, (running, granted, _) in sorted(counted.items()):
            assert running + granted <= self.limit, (
                f"{pair[0]}[{pair[1]}]: {running} running and {granted} granted, "
                f"limit {self.limit}: the limit is exceeded"
            )
        slots = {str(r.id): (r.slot, r.slot_key) for r in rows}
        want = {i: (m.slot, m.slot_key) for i, m in self.tasks.items()}
        assert slots == want, f"slot and slot_key: database {slots}, model {want}"
        usage = self.store.slot_usage()
        assert {u.limit for u in usage} <= {self.limit}
        store = {(u.name, u.key): [u.running, u.granted, u.waiting] for u in usage}
        assert store == counted, f"slot_usage {store}, counted from the rows {counted}"
        assert self.freed == self.expected_freed, (
            f"on_slots_freed told {sorted(self.freed)}, "
            f"the model says {sorted(self.expected_freed)}"
        )

    @invariant()
    def rates_hold(self) -> None:
        """At most ``k + 1`` starts in any ``k`` intervals under each rate-limited key,
        counted from the starts the store made (database time), and the ``k``-th start
        after a key's first ``k`` intervals after it at least; each key's
        ``concurrency`` row (its limit, last start and next free start) is the model's;
        a paced row is PENDING with the model's ETA, or cancelled; every row's ``held``
        mark is the model's, and no PENDING row is held without an ETA."""
        t, c = self.store.t.tasks, self.store.t.concurrency
        with self.store.engine.connect() as conn:
            rows = conn.execute(select(t.c.id, t.c.state, t.c.slot, t.c.eta, t.c.held)).all()
            keys = conn.execute(
                select(c.c.name, c.c.key, c.c.max_slots, c.c.last_start_at, c.c.next_start_at)
            ).all()
        for pair, starts in self.starts.items():
            interval = self.rate_interval if pair[0] == RATE else self.lim_interval
            assert interval is not None
            ordered = sorted(starts)
            for (i, a), (j, b) in itertools.combinations(enumerate(ordered), 2):
                k = j - i - 1  # starts i..j: k + 2 of them, within b - a seconds
                assert b - a > k * interval - SAME_TIME, (
                    f"{pair[0]}[{pair[1]}]: {k + 2} starts within {k} intervals of "
                    f"{interval} s ({a} to {b}): the rate is exceeded; starts {ordered}"
                )
                assert i > 0 or b - a > (k + 1) * interval - SAME_TIME, (
                    f"{pair[0]}[{pair[1]}]: start {k + 1} after the key's first came "
                    f"before its turn ({a} to {b}); starts {ordered}"
                )
        for r in rows:
            task, pending = self.tasks.get(str(r.id)), r.state == State.PENDING.value
            assert task is not None, f"{r.id}: a row the model does not have"
            eta = _seconds(r.eta)
            assert bool(r.held) == task.held, f"{r.id}: held {r.held}, model {task.held}"
            assert not (pending and r.held and eta is None), (
                f"{r.id}: PENDING, held in the store without an ETA: the held sweep never "
                "publishes it, nor does the grace sweep"
            )
            if r.slot == PACED:
                assert pending or r.state == State.CANCELLED.value, (r.id, r.state)
                if pending:
                    assert _same(eta, task.eta), f"{r.id}: paced to {eta}, model {task.eta}"
        stored = {
            (str(k.name), str(k.key)): (
                int(k.max_slots),
                _seconds(k.last_start_at),
                _seconds(k.next_start_at),
            )
            for k in keys
        }
        want: dict[tuple[str, str], tuple[int, float | None, float | None]] = {
            pair: (self.limit, None, None) for pair in self.keys
        }
        for pair, (last, following) in self.rates.items():
            want[pair] = (self.limit if pair[0] == LIMITED else 0, last, following)
        assert stored.keys() == want.keys(), f"concurrency rows {sorted(stored)}, {sorted(want)}"
        for pair, (limit, last, following) in want.items():
            got = stored[pair]
            assert got[0] == limit and _same(got[1], last) and _same(got[2], following), (
                f"{pair[0]}[{pair[1]}]: limit, last and next start {got}, "
                f"the model's {(limit, last, following)}"
            )

    @invariant()
    def database_equals_model(self) -> None:
        records = {r.id: r for r in self.store.list_tasks(limit=1_000)}
        assert set(records) == set(self.tasks)
        for task_id, task in self.tasks.items():
            r = records[task_id]
            got = (
                r.state,
                r.attempt,
                r.recoveries,
                r.retries,
                r.dedup_key,
                r.owner,
                r.cancel_requested_at is not None,
            )
            want = (
                task.state,
                task.attempt,
                task.recoveries,
                task.retries,
                task.dedup_key,
                task.owner,
                task.cancel_requested,
            )
            assert got == want, f"{task_id}: database {got}, model {want}"
        page = self.store.invariant_page(sorted(self.tasks), grace=0.0)
        tokens = {str(r.id): r.token for r in page.tasks}
        for task_id, task in self.tasks.items():
            if task.token_exec is None:
                assert tokens[task_id] is None, task_id
            else:
                assert tokens[task_id] == self.execs[task.token_exec].lease.token, task_id
        trails: dict[str, list[tuple[State | None, State, int]]] = {}
        for a in page.audits:
            frm = State(a.from_state) if a.from_state else None
            trails.setdefault(str(a.task_id), []).append((frm, State(a.to_state), int(a.attempt)))
        assert trails == {i: t for i, t in self.trails.items() if i in self.tasks}
        steps: dict[str, dict[str, tuple[str, int, bool, str | None]]] = {}
        for s in page.steps:
            steps.setdefault(str(s.task_id), {})[str(s.name)] = (
                str(s.state),
                int(s.attempt),
                bool(s.idempotent),
                s.result if s.state == STEP_DONE else None,
            )
        want_steps = {
            task_id: {n: (s.state, s.attempt, s.idempotent, s.result) for n, s in t.steps.items()}
            for task_id, t in self.tasks.items()
            if t.steps
        }
        assert steps == want_steps


def machine_for(
    database: Database, machine: type[StoreMachine] = StoreMachine
) -> type[StoreMachine]:
    """``machine`` bound to ``database`` (a factory for ``run_state_machine_as_test``)."""
    return type(machine.__name__, (machine,), {"database": database})
