"""The invariant checker: scan a store and report what the design says cannot happen.

``check(app_or_store)`` returns a list of :class:`Violation` (empty when the store is
consistent). The crash suite asserts it is empty at the end of every test; operators
run it as ``celery -A proj lease check``.

What it proves, and from what:

* **Audit trail** (``transitions``): every row is a legal transition of
  :data:`celery_lease.states.TRANSITIONS`; the first creates the task
  (``None -> PENDING``); each starts where the previous one ended; attempts never go
  back; each claim (``PENDING -> RUNNING``) has the next attempt number, exactly once;
  the task's current state and attempt agree with its trail.
* **Steps**: each recorded step was written by an attempt that held the lease at that
  moment: the attempt has a claim in the trail, and the write's database time lies
  inside that attempt's lease window (from its claim to the first transition that
  took the lease away). A step written outside it is a write the fence should have
  refused. Windows are compared in database time, and every transition that ends a
  window takes the row lock after any fenced write it races with committed (PostgreSQL:
  ``FOR UPDATE [SKIP LOCKED]`` before the change; SQLite: one writer at a time), so the
  comparison is exact, not a heuristic.
* **Non-idempotent steps**: a step that is not idempotent (and has no ``check=``),
  recorded STARTED by attempt *a* and never finished, means the outcome of attempt
  *a*'s call is unknown. A later claim without an operator retry in between (an
  operator retry deletes such a row) is an automatic re-run after an unknown outcome.
  What the trail cannot prove: a started step re-run by a later attempt overwrites
  the row (attempt and start time), so an unsafe re-run that then *finished* leaves
  no trace in the store; the crash suite counts those calls in its external stub.
* **Liveness** (needs the reaper to run): RUNNING rows whose owner is dead, stopped
  or silent for longer than the task's TTL plus ``grace``; PENDING rows never
  published (or whose message was lost) past their window plus ``grace``; RETRY_WAIT
  rows overdue by ``grace``; rows resting in TIMEOUT (a transient state); PENDING and
  RETRY_WAIT rows of a broker no live worker uses (apps on several brokers sharing a
  store: each reaper publishes only its own broker's rows, so no one publishes these);
  rows waiting for a concurrency slot while their key has one free and nothing of
  that key changed for ``grace`` (no grant in flight: the reaper grants such a slot).
  ``grace`` defaults to one reaper interval.
* **Shape**: a RUNNING row without a fencing token, a WAIT_MANUAL row without a
  reason, audit rows or steps of a task that has no row.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any

from .config import MAX_SECONDS
from .states import RETRYABLE, STEP_DONE, STEP_STARTED, State, is_legal
from .store import REOPENABLE, Store

#: Kind of violation -> what it means (the CLI prints these).
KINDS: dict[str, str] = {
    "illegal_transition": "an audit row the transition table does not allow",
    "audit_gap": "an audit row that does not start where the previous one ended",
    "bad_first_transition": "a trail that does not begin with the task's creation",
    "missing_audit": "a task without audit rows",
    "state_mismatch": "the task's state differs from its last audit row's to_state",
    "attempt_regression": "an audit row whose attempt is lower than an earlier one",
    "bad_claim": "a claim whose attempt is not the next one (duplicate or skipped)",
    "attempt_mismatch": "the task's attempt differs from the number of claims in its trail",
    "step_unclaimed_attempt": "a step written by an attempt that never claimed the task",
    "step_outside_lease": "a step written outside its attempt's lease (the fence failed)",
    "rerun_after_unknown_outcome": (
        "a non-idempotent step's outcome was unknown, yet the task was claimed again "
        "without an operator retry"
    ),
    "dead_owner": "RUNNING past its TTL with a dead, stopped or silent owner (reaper not running?)",
    "running_without_token": "a RUNNING row without a fencing token",
    "duration_out_of_range": (
        "a live row whose lease_ttl or max_runtime is not finite, not positive or over ten "
        "years (written unchecked): the sweeps clamp it"
    ),
    "unpublished": "PENDING, never published, past lease_publish_grace (reaper not running?)",
    "republish_overdue": "PENDING, published, unclaimed past its re-publish window",
    "held_overdue": "PENDING, held until its ETA, still held past it (reaper not running?)",
    "retry_overdue": "RETRY_WAIT past next_retry_at (reaper not running?)",
    "stuck_timeout": "resting in TIMEOUT, which only exists inside an expiry",
    "follow_ups_overdue": (
        "SUCCEEDED with follow-ups recorded and unpublished past lease_publish_grace "
        "(reaper not running?)"
    ),
    "no_publisher": (
        "PENDING or RETRY_WAIT on a broker no live worker uses: no reaper publishes it "
        "(each app publishes only its own broker's rows)"
    ),
    "waiting_with_free_slot": (
        "PENDING, waiting for a concurrency slot while its key has one free, past the "
        "grace (reaper not running?)"
    ),
    "manual_without_reason": "WAIT_MANUAL without a reason for the person who must decide",
    "orphan_audit": "audit rows of a task that has no row",
    "orphan_step": "step rows of a task that has no row",
    "worker_on_other_store": (
        "a live worker whose incarnation this store has never seen: it uses another store"
    ),
}

#: Slack for comparing database times that went through SQLite's REAL column.
_EPSILON = timedelta(milliseconds=2)

#: States whose durations no sweep reads any more.
_FINISHED = frozenset({State.SUCCEEDED, State.FAILED, State.CANCELLED})

#: Tasks checked per round trip (bounded memory on a large store).
_PAGE = 500


@dataclasses.dataclass(frozen=True)
class Violation:
    """One broken invariant: its ``kind`` (a key of :data:`KINDS`), the task, the detail."""

    kind: str
    task_id: str | None
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} {self.task_id or '-'}: {self.detail}"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class _Audit:
    id: int
    frm: State | None
    to: State
    attempt: int
    actor: str
    at: datetime


@dataclasses.dataclass(frozen=True)
class _Step:
    name: str
    state: str
    idempotent: bool
    checkable: bool
    attempt: int
    started_at: datetime
    finished_at: datetime | None


def _store_of(target: Any) -> Store:
    if isinstance(target, Store):
        return target
    from ._runtime import runtime

    return runtime(target).store


def check(
    app_or_store: Any,
    *,
    task_ids: Iterable[str] | None = None,
    grace: float | None = None,
    liveness: bool = True,
) -> list[Violation]:
    """Scan the store of a Celery app (or a :class:`~celery_lease.store.Store`).

    Args:
        app_or_store: a Celery app using celery-lease, or a store.
        task_ids: check only these tasks (default: every task, in pages).
        grace: seconds allowed beyond each liveness deadline (default: one
            ``lease_reaper_interval``; raise it when the reaper runs less often).
        liveness: also report what only a running reaper would have fixed by now
            (``dead_owner``, ``unpublished``, ``republish_overdue``, ``held_overdue``,
            ``retry_overdue``, ``stuck_timeout``, ``follow_ups_overdue``,
            ``waiting_with_free_slot``). Safety
            invariants are always checked.

    Returns:
        The violations found, grouped by task; empty when everything holds.
    """
    store = _store_of(app_or_store)
    slack = store.config.reaper_interval if grace is None else float(grace)
    out: list[Violation] = []
    if task_ids is not None:
        wanted = list(dict.fromkeys(task_ids))
        for start in range(0, len(wanted), _PAGE):
            out.extend(_check_page(store, wanted[start : start + _PAGE], slack, liveness))
        return out
    for page in _pages(store):
        out.extend(_check_page(store, page, slack, liveness))
    out.extend(_orphans(store))
    return out


def _pages(store: Store) -> Iterator[list[str]]:
    last: str | None = None
    while True:
        ids = store.task_ids_after(last, limit=_PAGE)
        if not ids:
            return
        yield ids
        last = ids[-1]


_ORPHAN_KINDS = {"transitions": "orphan_audit", "steps": "orphan_step"}


def _orphans(store: Store) -> list[Violation]:
    return [
        Violation(_ORPHAN_KINDS[table], task_id, f"{count} rows without a task row")
        for table, counts in store.orphans().items()
        for task_id, count in counts.items()
    ]


def _check_page(store: Store, ids: Sequence[str], slack: float, liveness: bool) -> list[Violation]:
    page = store.invariant_page(ids, grace=slack)
    tasks, audit_rows, step_rows = page.tasks, page.audits, page.steps
    trails: dict[str, list[_Audit]] = defaultdict(list)
    for r in audit_rows:
        trails[str(r.task_id)].append(
            _Audit(
                int(r.id),
                State(r.from_state) if r.from_state else None,
                State(r.to_state),
                int(r.attempt),
                str(r.actor),
                r.at,
            )
        )
    steps: dict[str, list[_Step]] = defaultdict(list)
    for r in step_rows:
        steps[str(r.task_id)].append(
            _Step(
                str(r.name),
                str(r.state),
                bool(r.idempotent),
                bool(r.checkable),
                int(r.attempt),
                r.started_at,
                r.finished_at,
            )
        )
    out: list[Violation] = []
    for row in tasks:
        task_id = str(row.id)
        state = State(row.state)
        out.extend(_check_shape(task_id, state, row, liveness))
        trail = _current_run(task_id, trails.get(task_id, []), out)
        out.extend(_check_trail(task_id, state, int(row.attempt), trail))
        out.extend(_check_steps(task_id, trail, steps.get(task_id, [])))
    return out


def _check_shape(task_id: str, state: State, row: Any, liveness: bool) -> Iterator[Violation]:
    if state is State.RUNNING and not row.token:
        yield Violation("running_without_token", task_id, "RUNNING with no fencing token")
    if state not in _FINISHED:
        for option in ("lease_ttl", "max_runtime"):
            value = getattr(row, option)
            if value is not None and not 0 < float(value) <= MAX_SECONDS:
                yield Violation(
                    "duration_out_of_range", task_id, f"{option} {float(value)!r} out of range"
                )
    if state is State.WAIT_MANUAL and not (row.reason or "").strip():
        yield Violation("manual_without_reason", task_id, "WAIT_MANUAL with an empty reason")
    if not liveness:
        return
    if row.dead_owner:
        owner = f"{row.nodename or 'unknown node'} (incarnation {row.owner})"
        yield Violation(
            "dead_owner", task_id, f"RUNNING attempt {row.attempt}, owner {owner} is gone"
        )
    for kind in (
        "unpublished",
        "republish_overdue",
        "held_overdue",
        "retry_overdue",
        "stuck_timeout",
        "follow_ups_overdue",
        "waiting_with_free_slot",
    ):
        if getattr(row, kind):
            yield Violation(kind, task_id, f"{state.value}: {KINDS[kind]}")
    if row.no_publisher:
        yield Violation(
            "no_publisher",
            task_id,
            f"{state.value} on broker {row.origin}: no live worker of an app on that broker; "
            "start one (its reaper publishes the row)",
        )


def _current_run(task_id: str, trail: list[_Audit], out: list[Violation]) -> list[_Audit]:
    """The audit rows of the task's current row. A task id submitted again after its run
    finished (SUCCEEDED or FAILED) got a fresh row, whose trail starts again at
    ``None -> PENDING``; an earlier run that ended anywhere else is an ``audit_gap``."""
    start = 0
    for i in range(1, len(trail)):
        if trail[i].frm is None:
            if trail[i - 1].to not in REOPENABLE:
                out.append(
                    Violation(
                        "audit_gap",
                        task_id,
                        f"audit row {trail[i].id} creates the row again but row "
                        f"{trail[i - 1].id} ended at {trail[i - 1].to.value}",
                    )
                )
            start = i
    return trail[start:]


def _check_trail(
    task_id: str, state: State, attempt: int, trail: Sequence[_Audit]
) -> Iterator[Violation]:
    if not trail:
        yield Violation("missing_audit", task_id, f"task is {state.value} but has no audit rows")
        return
    first = trail[0]
    if first.frm is not None or first.to is not State.PENDING:
        yield Violation(
            "bad_first_transition", task_id, f"trail begins with {_name(first.frm)} -> {first.to}"
        )
    claims = 0
    high = 0
    previous: _Audit | None = None
    for row in trail:
        if not is_legal(row.frm, row.to):
            yield Violation(
                "illegal_transition",
                task_id,
                f"audit row {row.id}: {_name(row.frm)} -> {row.to.value} by {row.actor}",
            )
        if previous is not None and row.frm is not previous.to:
            yield Violation(
                "audit_gap",
                task_id,
                f"audit row {row.id} starts at {_name(row.frm)} but row {previous.id} "
                f"ended at {previous.to.value}",
            )
        if row.attempt < high:
            yield Violation(
                "attempt_regression",
                task_id,
                f"audit row {row.id} has attempt {row.attempt} after attempt {high}",
            )
        if (row.frm, row.to) == (State.PENDING, State.RUNNING):
            claims += 1
            if row.attempt != claims:
                yield Violation(
                    "bad_claim",
                    task_id,
                    f"claim number {claims} (audit row {row.id}) has attempt {row.attempt}",
                )
        high = max(high, row.attempt)
        previous = row
    if trail[-1].to is not state:
        yield Violation(
            "state_mismatch",
            task_id,
            f"task is {state.value} but its last audit row says {trail[-1].to.value}",
        )
    if attempt != claims:
        yield Violation(
            "attempt_mismatch", task_id, f"task attempt {attempt} but {claims} claims audited"
        )


def _windows(trail: Sequence[_Audit]) -> dict[int, tuple[datetime, datetime | None, int]]:
    """attempt -> (claimed at, lease taken away at or None, index of the ending row)."""
    out: dict[int, tuple[datetime, datetime | None, int]] = {}
    for i, row in enumerate(trail):
        if (row.frm, row.to) != (State.PENDING, State.RUNNING):
            continue
        end: datetime | None = None
        end_index = len(trail)
        for j in range(i + 1, len(trail)):
            nxt = trail[j]
            # over max_runtime the owner keeps its token; it loses it on the next change
            if (nxt.frm, nxt.to) == (State.RUNNING, State.WAIT_MANUAL):
                continue
            end, end_index = nxt.at, j
            break
        out.setdefault(row.attempt, (row.at, end, end_index))
    return out


def _check_steps(
    task_id: str, trail: Sequence[_Audit], steps: Sequence[_Step]
) -> Iterator[Violation]:
    if not steps or not trail:
        return
    windows = _windows(trail)
    for step in steps:
        window = windows.get(step.attempt)
        if window is None:
            yield Violation(
                "step_unclaimed_attempt",
                task_id,
                f"step {step.name!r} ({step.state}) written by attempt {step.attempt}, "
                "which never claimed the task",
            )
            continue
        start, end, end_index = window
        written = step.started_at
        if step.state == STEP_DONE and step.finished_at:
            written = step.finished_at
        if written < start - _EPSILON or (end is not None and written > end + _EPSILON):
            yield Violation(
                "step_outside_lease",
                task_id,
                f"step {step.name!r} ({step.state}) written by attempt {step.attempt} at "
                f"{written.isoformat()}, outside its lease {start.isoformat()} .. "
                f"{end.isoformat() if end else 'now'}",
            )
        if step.state == STEP_STARTED and not step.idempotent and not step.checkable:
            yield from _check_unknown_outcome(task_id, trail, step, end_index)


def _check_unknown_outcome(
    task_id: str, trail: Sequence[_Audit], step: _Step, end_index: int
) -> Iterator[Violation]:
    """The step was in flight when attempt ``step.attempt`` lost its lease (its window
    ended in TIMEOUT): the policy must hand the task to a person, and no later claim
    may happen unless a person sent it back to PENDING first. (A window the task ended
    itself, e.g. ``self.retry()`` after the call raised, is the task's own decision.)"""
    if end_index >= len(trail) or (trail[end_index].frm, trail[end_index].to) != (
        State.RUNNING,
        State.TIMEOUT,
    ):
        return
    after_timeout = trail[end_index + 1] if end_index + 1 < len(trail) else None
    if after_timeout is not None and after_timeout.to is State.RETRY_WAIT:
        yield Violation(
            "rerun_after_unknown_outcome",
            task_id,
            f"step {step.name!r} was in flight when attempt {step.attempt} lost its lease, "
            f"yet the expiry chose RETRY_WAIT (audit row {after_timeout.id})",
        )
        return
    for row in trail[end_index + 1 :]:
        if row.to is State.PENDING and row.frm in RETRYABLE:
            return  # an operator retry (it also deletes such a step; kept here = raced)
        if (row.frm, row.to) == (State.PENDING, State.RUNNING) and row.attempt > step.attempt:
            yield Violation(
                "rerun_after_unknown_outcome",
                task_id,
                f"step {step.name!r} was in flight when attempt {step.attempt} lost its "
                f"lease, yet attempt {row.attempt} was claimed without an operator retry",
            )
            return


def _name(state: State | None) -> str:
    return "(new)" if state is None else state.value


def workers_on_other_stores(app: Any, *, timeout: float = 1.0) -> list[Violation]:
    """Ask every live worker on ``app``'s broker which store it uses (remote control,
    answered within ``timeout``); one ``worker_on_other_store`` violation per worker
    that runs one of ``app``'s leased tasks and whose incarnation is not in this
    process's store.

    Raises:
        OSError, kombu.exceptions.OperationalError: the broker cannot be reached.
    """
    from .worker.main.stores import leased_tasks, on_other_stores, worker_stores

    store = _store_of(app)
    answers = worker_stores(app, timeout)
    known = {w.id for w in store.workers()}
    return [
        Violation(
            "worker_on_other_store",
            None,
            f"worker {node} (host {a.get('host')}, pid {a.get('pid')}) uses the store "
            f"{a.get('store')}, not {store.url}",
        )
        for node, a in on_other_stores(answers, known, leased_tasks(app))
    ]


def summarize(violations: Sequence[Violation]) -> dict[str, int]:
    """Violations counted by kind (for reports)."""
    counts: dict[str, int] = defaultdict(int)
    for v in violations:
        counts[v.kind] += 1
    return dict(sorted(counts.items()))


__all__ = ["KINDS", "Violation", "check", "summarize", "workers_on_other_stores"]
