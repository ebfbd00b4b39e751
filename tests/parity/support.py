"""The parity harness: one real worker runs each scenario twice, with plain Celery tasks
and with leased tasks (:mod:`tests.parity.tasks`), and each side's outcome is read the
way a project sees it.

An :class:`Outcome` is what a caller can observe of one scenario on one side: the
result and state of its ``AsyncResult`` (or the exception ``apply_async`` raised), how
many times each task's body started and completed (the counting stub), in what order,
whether the chain's ``parent_id``/``root_id`` link each step to the previous one and
to the head, the custom header and time limits each body saw, every state the result
backend was given for each task (a subscriber on the Redis result backend's channels
sees each write, so a FAILURE overwritten a moment later is still seen), and what
Flower shows: the state of each task in Celery's event state (Flower's
``EventsState``, fed by a real event receiver; the task list through
``celery_lease.contrib.flower.format_task``) and whether Flower's state filter finds
it under that state.

A :class:`Scenario` says how to submit itself on a side, which outcome fields it is
about, and the outcome expected: where plain Celery succeeds, plain's outcome is also
checked against it (the harness itself is checked) and the leased outcome must equal
plain's; where plain Celery loses or repeats work, plain's (lossy) outcome is checked
against what the docs say it does, and the leased outcome must equal the outcome of a
run without the fault. :func:`check_all` waits for every scenario together, under one
deadline, and reports every scenario that differs, by name, with both outcomes.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import itertools
import json
import threading
import time
import types
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from celery.result import AsyncResult, GroupResult, ResultBase

from celery_lease import State, TaskRecord
from celery_lease.contrib.flower import format_task

from ..crash.support import LeasedProject, LeaseEnv, queue_depth
from ..helpers import Effect, ExternalSystem, WorkerProcess, wait_until
from ..integration.test_cli_support import EventLog
from .tasks import GATES_ENV, HEADER

#: The generated project: the harness's app, then both sides' tasks.
SOURCE = """
from tests.parity.tasks import define

TASKS = define(app)
"""

#: Celery settings of every parity project (result backend: see :func:`project`).
SETTINGS: dict[str, Any] = {
    "task_serializer": "json",
    "result_serializer": "json",
    "accept_content": ["json"],
    "result_expires": 600,
    "worker_send_task_events": True,
    "task_send_sent_event": False,
}

#: Result-backend states after which a task is done (Celery's READY_STATES).
READY = ("SUCCESS", "FAILURE", "REVOKED")
#: The state Flower shows (task list, through format_task) for a leased row's state.
FLOWER_STATE = {
    State.SUCCEEDED: "SUCCESS",
    State.FAILED: "FAILURE",
    State.WAIT_MANUAL: "WAIT_MANUAL",
    State.CANCELLED: "CANCELLED",
}
#: The result-backend state for a leased row's final state.
BACKEND_STATE = {State.SUCCEEDED: "SUCCESS", State.FAILED: "FAILURE"}


# -- reading the result backend's writes --------------------------------------------------


class BackendWrites:
    """Every state the Redis result backend is given, per task id, in order.

    Celery's Redis backend publishes each stored meta on the channel named after its
    key (``celery-task-meta-<id>``); a pattern subscription sees every write, also one
    overwritten a few milliseconds later. Channels are not per database: only ids a
    test made are looked at (they are unique).
    """

    def __init__(self, redis_url: str) -> None:
        import redis

        self.client = redis.Redis.from_url(redis_url)
        self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        self.pubsub.psubscribe("celery-task-meta-*")
        self._writes: dict[str, list[str]] = collections.defaultdict(list)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> BackendWrites:
        self._thread.start()
        probe = f"probe-{uuid.uuid4().hex}"

        def seen() -> bool:
            self.client.publish(f"celery-task-meta-{probe}", json.dumps({"status": "PROBE"}))
            return bool(self.states(probe))

        wait_until(seen, timeout=10, interval=0.1, message="backend subscriber never ready")
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            message = self.pubsub.get_message(timeout=0.2)
            if message is None or message.get("type") != "pmessage":
                continue
            task_id = message["channel"].decode().removeprefix("celery-task-meta-")
            try:
                status = str(json.loads(message["data"])["status"])
            except (ValueError, KeyError, TypeError):
                status = "<unreadable>"
            with self._lock:
                self._writes[task_id].append(status)

    def states(self, task_id: str) -> list[str]:
        """The states written for ``task_id``, consecutive repeats folded."""
        with self._lock:
            raw = list(self._writes.get(task_id, ()))
        return [s for i, s in enumerate(raw) if i == 0 or raw[i - 1] != s]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        with contextlib.suppress(Exception):
            self.pubsub.close()
        self.client.close()


# -- what Flower shows ------------------------------------------------------------------


def _shows(events: EventLog, task_id: str, want: str) -> bool:
    """Whether Flower lists ``task_id`` in the state ``want`` (its events caught up)."""
    shown, listed, _ = flower_view(events, task_id)
    return listed and shown == want


def flower_events(app: Any) -> EventLog:
    """A real event receiver feeding Flower's own ``EventsState`` (a Celery ``State``
    with the index behind Flower's state filter)."""
    from flower.events import EventsState

    log = EventLog(app)
    log.state = EventsState()
    return log.start()


def flower_view(log: EventLog, task_id: str) -> tuple[str | None, bool, list[str]]:
    """(state in Flower's task list, whether Flower's state filter lists the task under
    that state, the task event types received for it)."""
    from flower.utils.tasks import iter_tasks

    with log._lock:
        task = log.state.tasks.get(task_id)
        if task is None:
            return None, False, []
        shown = format_task(copy.copy(task)).state
        raw = task.state
        events = types.SimpleNamespace(state=log.state)
        listed = any(tid == task_id for tid, _ in iter_tasks(events, state=raw))
    return shown, listed, log.of(task_id)


# -- one side of the parity project ---------------------------------------------------------


@dataclasses.dataclass
class Side:
    """Plain (``p``) or leased (``l``) tasks of one loaded project module."""

    prefix: str
    module: Any

    @property
    def leased(self) -> bool:
        return self.prefix == "l"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return self.module.app.tasks[f"{self.prefix}.{name}"]


class Parity:
    """A parity project on one broker and store, with the readers of its outcomes."""

    def __init__(self, p: LeasedProject, redis_url: str) -> None:
        self.p = p
        self.ext: ExternalSystem = p.external
        self.sides = {prefix: Side(prefix, p.module) for prefix in ("p", "l")}
        self.backend = BackendWrites(redis_url).start()
        self.events: EventLog | None = None
        self.worker: WorkerProcess | None = None

    def start_worker(self, concurrency: int, name: str = "w1") -> WorkerProcess:
        """A worker sending task events (``-E``), as Flower needs; the event receiver
        is started with the first worker. Its node name is unique: RabbitMQ's
        remote-control queue of a node name is exclusive to one connection, and other
        test sessions on the same broker start workers named ``w1@lease-test`` too."""
        if self.events is None:
            self.events = flower_events(self.p.module.app)
        worker = self.p.project.worker(
            name,
            concurrency=concurrency,
            nodename=f"parity-{uuid.uuid4().hex[:8]}@lease-test",
            extra_args=["-E"],
        )
        self.p.workers.append(worker)
        worker.wait_ready(timeout=60, store=self.p.store)
        self.worker = worker
        return worker

    def close(self) -> None:
        if self.events is not None:
            self.events.stop()
        self.backend.stop()

    # -- effects ------------------------------------------------------------------------

    def effects(self, prefix: str, tag: str, phase: str) -> list[tuple[str, Effect]]:
        """(short task name, effect) of one side and scenario, oldest first."""
        out = []
        for effect in self.ext.effects():
            full, _, rest = effect.name.partition(":")
            etag, _, ephase = rest.rpartition(":")
            side, _, short = full.partition(".")
            if side == prefix and etag == tag and ephase == phase:
                out.append((short, effect))
        return out

    def starts(self, prefix: str, tag: str) -> list[tuple[str, dict[str, Any]]]:
        return [
            (short, json.loads(e.payload or "{}"))
            for short, e in self.effects(prefix, tag, "start")
        ]

    def wait_started(
        self, side: Side, tag: str, task: str = "gate", timeout: float = 30, step: str | None = None
    ) -> Effect:
        """Wait until ``task`` of the scenario started (it waits at its gate), the
        worker's main process has accepted it (its ``task-started`` event: the main
        process took the pool child's acknowledgement of the job), and, on the leased
        side, until the store shows its row RUNNING (and ``step`` recorded as
        started): a kill after that point hits a claimed, running task (inside that
        step), never one still being claimed or recording the step. Killed before the
        main process took its acknowledgement, a job is one billiard believes its
        child died reading, and hands to another child: plain Celery then runs it
        again instead of losing it."""

        def started() -> Effect | None:
            found = [e for short, e in self.effects(side.prefix, tag, "start") if short == task]
            if not found:
                return None
            effect = found[-1]
            task_id = json.loads(effect.payload or "{}")["id"]
            if self.events is not None and "task-started" not in self.events.of(task_id):
                return None
            if side.leased:
                record = self.p.store.get(task_id)
                if record is None or record.state is not State.RUNNING:
                    return None
                if step is not None and not any(
                    r.name == step and r.attempt == record.attempt
                    for r in self.p.store.steps(task_id)
                ):
                    return None
            return effect

        return wait_until(started, timeout=timeout, message=f"{side.prefix}:{tag} {task} started")

    def gate(self, side: Side, tag: str, task: str = "gate") -> str:
        return self.p.gates.hold(f"{side.prefix}.{task}:{tag}")

    def drain(self, concurrency: int) -> None:
        """One ``barrier`` per pool slot, all running at once: every message received
        before them has finished (ETA messages excepted: the worker holds them)."""
        tag = f"drain-{uuid.uuid4().hex[:6]}"
        side = self.sides["p"]
        for _ in range(concurrency):
            side.barrier.apply_async((concurrency, tag))
        wait_until(
            lambda: len(self.effects("p", tag, "done")) >= concurrency,
            timeout=60,
            message="drain barrier",
        )

    # -- the outcome of one scenario on one side -------------------------------------------

    def outcome(self, scenario: Scenario, side: Side, handle: Any) -> dict[str, Any]:
        tag = scenario.tag
        starts = self.starts(side.prefix, tag)
        done = self.effects(side.prefix, tag, "done")
        ids: dict[str, list[str]] = collections.defaultdict(list)
        for short, info in starts:
            if info["id"] is not None and info["id"] not in ids[short]:
                ids[short].append(info["id"])
        out: dict[str, Any] = {}
        if isinstance(handle, BaseException):
            out["raised"] = type(handle).__name__
        elif isinstance(handle, ResultBase):
            out["result"] = result_of(handle)
            if isinstance(handle, AsyncResult) and not isinstance(handle, GroupResult):
                out["state"] = handle.state
        out["starts"] = dict(collections.Counter(short for short, _ in starts))
        out["done"] = dict(collections.Counter(short for short, _ in done))
        out["order"] = [short for short, _ in done]
        out["lineage"] = lineage(starts)
        out["trace"] = sorted(
            {str(info.get("trace")) for short, info in starts if short == scenario.traced}
        )
        out["limits"] = sorted({str(info.get("limits")) for _, info in starts})
        out["values"] = sorted(str(info["value"]) for _, info in starts if "value" in info)
        out["not_before"] = (
            None
            if scenario.not_before is None
            else all(info["at"] >= scenario.not_before - 0.1 for _, info in starts)
        )
        # every state the result backend was given, per task: ready states only (the
        # lease may show its own not-ready states while it decides) unless asked for all
        written: dict[str, list[list[str]]] = {}
        flower: dict[str, list[str]] = {}
        for short, task_ids in sorted(ids.items()):
            seqs = []
            shown = []
            for task_id in task_ids:
                seq = self.backend.states(task_id)
                if not scenario.all_states:
                    seq = [s for s in seq if s in READY]
                seqs.append(seq)
                if self.events is not None:
                    state, listed, _ = flower_view(self.events, task_id)
                    shown.append(f"{state}" if listed else f"{state} (not found by filter)")
            written[short] = sorted(seqs)
            flower[short] = sorted(shown)
        out["backend"] = written
        out["flower"] = flower
        out["rows"] = self.rows(side, ids) if side.leased else {}
        if side.leased and isinstance(handle, AsyncResult) and not isinstance(handle, GroupResult):
            record = self.p.store.get(handle.id)
            out["row"] = record.state.value if record is not None else "no row"
        return {k: v for k, v in out.items() if k in scenario.fields}

    def rows(self, side: Side, ids: dict[str, list[str]]) -> dict[str, list[str]]:
        """The leased rows' states, per task name."""
        out = {}
        for short, task_ids in sorted(ids.items()):
            states = []
            for task_id in task_ids:
                record: TaskRecord | None = self.p.store.get(task_id)
                states.append(record.state.value if record is not None else "no row")
            out[short] = sorted(states)
        return out

    def unfinished(self, ids: dict[str, list[str]]) -> str:
        """For a failure report: the audit trail of each leased row not SUCCEEDED, and
        the worker's log lines that name it (what decided, or failed to decide, it)."""
        out = []
        log = self.worker.log_path.read_text(errors="replace") if self.worker else ""
        for short, task_ids in sorted(ids.items()):
            for task_id in task_ids:
                record = self.p.store.get(task_id)
                if record is not None and record.state is State.SUCCEEDED:
                    continue
                out.append(f"  {short} {task_id}:")
                for t in self.p.store.history(task_id):
                    was = t.from_state.value if t.from_state else "-"
                    out.append(f"    {was}->{t.to_state.value} ({t.actor}): {t.reason}")
                lines = [line for line in log.splitlines() if task_id in line]
                out += [f"    | {line}" for line in lines[-20:]]
        return "\n".join(out)

    def truth_problems(self, side: Side, tag: str) -> list[str]:
        """Leased tasks of the scenario whose row and what callers see disagree: Flower
        shows another state than the row's; a ``task-failed`` event or a FAILURE in the
        result backend for a row that is not FAILED; a final result-backend state that
        is not the row's (tasks with ``ignore_result`` excepted: nothing is stored)."""
        if self.events is None or not side.leased:
            return []
        problems = []
        seen: set[str] = set()
        for short, info in self.starts(side.prefix, tag):
            task_id = info["id"]
            if task_id is None or task_id in seen:
                continue
            seen.add(task_id)
            record = self.p.store.get(task_id)
            if record is None or record.state not in FLOWER_STATE:
                continue
            want = FLOWER_STATE[record.state]
            shown, listed, kinds = flower_view(self.events, task_id)
            if shown != want or not listed:
                # the worker's events reach the receiver through the broker, after the
                # row may have been written: wait for the event state to reach it
                caught_up = functools.partial(_shows, self.events, task_id, want)
                with contextlib.suppress(AssertionError):
                    wait_until(
                        caught_up,
                        timeout=10,
                        interval=0.1,
                        message=f"Flower's view of {task_id}",
                    )
                shown, listed, kinds = flower_view(self.events, task_id)
            if shown != want or not listed:
                problems.append(
                    f"{short} {task_id}: row {record.state.value}, Flower shows {shown}"
                    f"{'' if listed else ' (not found by the state filter)'}; events {kinds}"
                )
            if record.state is not State.FAILED and "task-failed" in kinds:
                problems.append(
                    f"{short} {task_id}: row {record.state.value} but a task-failed event "
                    f"was sent; events {kinds}"
                )
            backend = self.backend.states(task_id)
            if record.state is not State.FAILED and "FAILURE" in backend:
                problems.append(
                    f"{short} {task_id}: row {record.state.value} but the result backend "
                    f"was given FAILURE; writes {backend}"
                )
            final = AsyncResult(task_id, app=self.p.module.app).state
            if backend and record.state in BACKEND_STATE and final != BACKEND_STATE[record.state]:
                problems.append(
                    f"{short} {task_id}: row {record.state.value} but the result backend "
                    f"says {final}; writes {backend}"
                )
        return problems


def result_of(handle: ResultBase) -> Any:
    """A ready result's value (exceptions by type name), or ``"<STATE>"``."""
    try:
        if not handle.ready():
            state = getattr(handle, "state", "not ready")
            return f"<{state}>"
        value = handle.get(timeout=5, propagate=False, disable_sync_subtasks=False)
    except Exception as error:  # what the caller would get
        return f"<raised {type(error).__name__}>"
    return _plain(value)


def _plain(value: Any) -> Any:
    if isinstance(value, BaseException):
        return type(value).__name__
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def lineage(starts: Sequence[tuple[str, dict[str, Any]]]) -> bool | None:
    """Whether the first start of each task, in order, names the previous task as its
    parent and the first as its root (a chain's ``parent_id``/``root_id``)."""
    firsts: list[dict[str, Any]] = []
    seen: set[str] = set()
    for _, info in starts:
        if info["id"] not in seen:
            seen.add(info["id"])
            firsts.append(info)
    if len(firsts) < 2:
        return None
    head = firsts[0]["id"]
    return all(
        cur["parent"] == prev["id"] and cur["root"] == head
        for prev, cur in itertools.pairwise(firsts)
    )


# -- scenarios ----------------------------------------------------------------------------


#: Outcome fields only the leased side has (rows), never compared with plain Celery.
LEASE_ONLY = ("row", "rows")
#: Outcome fields every scenario compares unless it says otherwise.
FIELDS = ("raised", "result", "state", "starts", "done", "backend", "flower")


@dataclasses.dataclass
class Scenario:
    """One feature on one path.

    ``submit(side, tag)`` submits it and returns the handle a caller gets (or the
    exception ``apply_async`` raised: return it). ``expected`` is the outcome of a
    run without a fault (the leased side must show it); ``plain`` is what plain
    Celery does on this path when it differs (``None``: plain must show
    ``expected`` too, and then the leased outcome must equal plain's).
    """

    name: str
    submit: Callable[[Side, str], Any]
    expected: dict[str, Any]
    plain: dict[str, Any] | None = None
    fields: tuple[str, ...] = FIELDS
    #: wall time before which no body of the scenario may start (countdown/eta)
    not_before: float | None = None
    #: compare every state written to the backend, not only the ready ones
    all_states: bool = False
    #: the task whose custom header is reported as ``trace`` (Celery does not pass a
    #: task's custom headers on to its callbacks)
    traced: str = ""
    tag: str = ""
    handles: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tag = self.tag or f"{self.name}-{uuid.uuid4().hex[:6]}"
        extra = set(self.expected) | set(self.plain or {})
        self.fields = tuple(dict.fromkeys((*self.fields, *sorted(extra))))

    def run(self, sides: Sequence[Side]) -> Scenario:
        """Submit on each side (a side of any module of the project: the counts are by
        task name and tag)."""
        for side in sides:
            try:
                self.handles[side.prefix] = self.submit(side, self.tag)
            except Exception as error:  # what the caller of apply_async gets
                self.handles[side.prefix] = error
        return self

    def wanted(self, prefix: str) -> dict[str, Any]:
        if prefix == "p":
            if self.plain is not None:
                return self.plain
            return {k: v for k, v in self.expected.items() if k not in LEASE_ONLY}
        return self.expected


def _differs(want: dict[str, Any], have: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {k: (v, have.get(k)) for k, v in want.items() if have.get(k) != v}


def check_all(
    parity: Parity,
    scenarios: Sequence[Scenario],
    *,
    timeout: float = 60.0,
    concurrency: int = 1,
) -> list[str]:
    """Wait (one deadline for all) until each scenario's sides show their wanted
    outcomes, then drain the pool and look again (a repeat shows up then); returns a
    line per difference, naming its scenario (see :func:`assert_parity`)."""

    def pending() -> list[str]:
        out = []
        for s in scenarios:
            for prefix, handle in s.handles.items():
                have = parity.outcome(s, parity.sides[prefix], handle)
                if _differs(s.wanted(prefix), have):
                    out.append(f"{prefix}:{s.name}")
        return out

    deadline = time.monotonic() + timeout
    while pending() and time.monotonic() < deadline:
        time.sleep(0.2)
    with contextlib.suppress(AssertionError):
        parity.drain(concurrency)
    failures = []
    for s in scenarios:
        outcomes = {
            prefix: parity.outcome(s, parity.sides[prefix], handle)
            for prefix, handle in s.handles.items()
        }
        for prefix, have in outcomes.items():
            diff = _differs(s.wanted(prefix), have)
            if diff:
                what = "plain Celery" if prefix == "p" else "leased"
                failures.append(
                    f"[{s.name}] {what}: "
                    + "; ".join(f"{k}: want {w!r}, got {g!r}" for k, (w, g) in diff.items())
                )
        if s.plain is None and "p" in outcomes and "l" in outcomes:
            plain = {k: v for k, v in outcomes["p"].items() if k not in LEASE_ONLY}
            diff = _differs(plain, outcomes["l"])
            if diff:
                failures.append(
                    f"[{s.name}] leased differs from plain Celery: "
                    + "; ".join(f"{k}: plain {w!r}, leased {g!r}" for k, (w, g) in diff.items())
                )
        if "l" in s.handles:
            failures += [
                f"[{s.name}] row vs callers: {problem}"
                for problem in parity.truth_problems(parity.sides["l"], s.tag)
            ]
    if failures:
        rows = "\n".join(
            f"  {s.name}: {parity.rows(parity.sides['l'], _ids(parity, s))}" for s in scenarios
        )
        unfinished = "\n".join(parity.unfinished(_ids(parity, s)) for s in scenarios).strip("\n")
        if unfinished:
            rows += f"\nleased rows not SUCCEEDED (trail, log lines):\n{unfinished}"
        failures.append(f"leased rows of these scenarios:\n{rows}{parity.p.stacks()}")
    return failures


def assert_parity(failures: Sequence[str]) -> None:
    """Raise one AssertionError listing every difference (the harness appends the
    workers' log tails to the report)."""
    problems = [f for f in failures if not f.startswith("leased rows")]
    assert not problems, f"{len(problems)} parity failures:\n" + "\n".join(failures)


def _ids(parity: Parity, s: Scenario) -> dict[str, list[str]]:
    ids: dict[str, list[str]] = collections.defaultdict(list)
    for short, info in parity.starts("l", s.tag):
        if info["id"] is not None and info["id"] not in ids[short]:
            ids[short].append(info["id"])
    return ids


# -- fixtures' building blocks ------------------------------------------------------------


def project(env: LeaseEnv, broker_url: str, redis_url: str, **overrides: Any) -> LeasedProject:
    """A parity project on ``broker_url`` whose result backend is the test's Redis db."""
    settings = {**SETTINGS, "result_backend": redis_url}
    return env.project(broker_url=broker_url, source=SOURCE, settings=settings, **overrides)


def purge(p: LeasedProject) -> int:
    """Delete every message waiting in the project's queue (a broker losing them);
    returns how many there were."""
    from kombu import Connection

    before = queue_depth(p.project.broker_url, p.project.queue)
    with Connection(p.project.broker_url, connect_timeout=5) as conn:
        channel: Any = conn.channel()
        try:
            channel.queue_purge(p.project.queue)
        finally:
            with contextlib.suppress(Exception):
                channel.close()
    return before


@contextlib.contextmanager
def parity_env(p: LeasedProject, redis_url: str) -> Iterator[Parity]:
    parity = Parity(p, redis_url)
    try:
        yield parity
    finally:
        parity.close()


__all__ = [
    "GATES_ENV",
    "HEADER",
    "Parity",
    "Scenario",
    "Side",
    "assert_parity",
    "check_all",
    "parity_env",
    "project",
    "purge",
]
