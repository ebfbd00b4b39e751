"""What the chaos soak checks and reports (see :mod:`tests.crash.chaos`).

:func:`verify` checks the soak's claim once the system was left alone: every submitted
task has a row in a settled state allowed for its kind (WAIT_MANUAL with a reason), none
is RUNNING, no idempotent effect was performed twice and no non-idempotent call was
made twice (the counting stub records the attempt of each), every audit trail is legal,
and ``celery_lease.check.check(store, liveness=False)`` finds nothing. :class:`Report`
holds what happened and prints the summary table.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from celery_lease import State, TaskRecord
from celery_lease.check import check

from ..helpers import Effect, check_audit
from .support import LeasedProject

if TYPE_CHECKING:
    from .chaos import Options

#: Environment variable holding the soak's seed (the test's and the script's default).
SEED_ENV = "CELERY_LEASE_SOAK_SEED"

#: Every kind of fault; a run draws those of its broker and store (:func:`fault_kinds`).
FAULT_KINDS = (
    "kill_child",
    "kill_worker",
    "freeze",
    "redis",
    "pg_terminate",
    "rabbitmq_purge",
    "rabbitmq_disconnect",
)
#: The broker's own faults: Redis losing its messages (restarted, or the project's keys
#: deleted); RabbitMQ losing the ready messages of the soak's vhost (its queues purged),
#: or closing every client connection of that vhost (workers and producers reconnect).
BROKER_FAULTS: dict[str, tuple[str, ...]] = {
    "redis": ("redis",),
    "amqp": ("rabbitmq_purge", "rabbitmq_disconnect"),
}
#: Faults that lose queued messages: the PENDING tasks they hit recover by being claimed
#: again (after the reaper published them again).
_MESSAGE_LOSSES = frozenset({"redis", "rabbitmq_purge"})


#: The store's own faults: every connection to PostgreSQL's database killed. A SQLite
#: store has no connections to kill (each process opens the file itself): none.
STORE_FAULTS: dict[str, tuple[str, ...]] = {
    "postgresql": ("pg_terminate",),
    "sqlite": (),
}


def fault_kinds(broker: str, store: str = "postgresql") -> tuple[str, ...]:
    """The fault kinds of a run on ``broker`` ("redis" or "amqp") and ``store``
    ("postgresql" or "sqlite"), in drawing order (a Redis and PostgreSQL run's are the
    five kinds its seeds were drawn with, in their order)."""
    if broker not in BROKER_FAULTS:
        raise ValueError(f"unknown broker {broker!r}: one of {sorted(BROKER_FAULTS)}")
    if store not in STORE_FAULTS:
        raise ValueError(f"unknown store {store!r}: one of {sorted(STORE_FAULTS)}")
    return ("kill_child", "kill_worker", "freeze", *BROKER_FAULTS[broker], *STORE_FAULTS[store])


#: States a task may rest in once the system is left alone.
SETTLED = frozenset({State.SUCCEEDED, State.FAILED, State.CANCELLED, State.WAIT_MANUAL})

#: kind -> states its tasks may end in (WAIT_MANUAL is checked apart, by its reason).
ALLOWED: dict[str, frozenset[State]] = {
    "idem": frozenset({State.SUCCEEDED}),
    "nonidem": frozenset({State.SUCCEEDED}),
    "retry": frozenset({State.SUCCEEDED}),
    "fail": frozenset({State.FAILED}),
    "exhaust": frozenset({State.FAILED}),
    "long": frozenset({State.SUCCEEDED}),
    # the cancel may land after the task finished
    "cancel": frozenset({State.CANCELLED, State.SUCCEEDED}),
    "dedup": frozenset({State.SUCCEEDED}),
    # the heads of chains (soak.retry), link= callbacks and chords (soak.idem)
    "chain": frozenset({State.SUCCEEDED}),
    "link": frozenset({State.SUCCEEDED}),
    "chord": frozenset({State.SUCCEEDED}),
    "limited": frozenset({State.SUCCEEDED}),
    "held": frozenset({State.SUCCEEDED}),
}

#: kind -> what a FAILED row's reason or error says when the task failed by its own logic
_OWN_FAILURE: dict[str, str] = {
    "fail": "fails by its own logic",
    "exhaust": "retries exhausted",
}
_OWN_FAILURE.update(dict.fromkeys(set(ALLOWED) - set(_OWN_FAILURE), "(never fails)"))

#: Idempotent step names per kind that a SUCCEEDED task performed exactly once.
_DONE_STEPS: dict[str, Callable[[tuple[Any, ...]], list[str]]] = {
    "idem": lambda args: [f"s{i}" for i in range(int(args[1]))],
    "nonidem": lambda args: ["load", "ship"],
    "retry": lambda args: [f"r{i}" for i in range(int(args[1]) + 1)],
    "long": lambda args: ["finish"],
    "dedup": lambda args: ["s0"],
    "chain": lambda args: [f"r{i}" for i in range(int(args[1]) + 1)],
    "link": lambda args: [f"s{i}" for i in range(int(args[1]))],
    "chord": lambda args: [f"s{i}" for i in range(int(args[1]))],
    "limited": lambda args: [f"s{i}" for i in range(int(args[1]))],
    "held": lambda args: [f"s{i}" for i in range(int(args[1]))],
}

# -- what happened ------------------------------------------------------------------------


@dataclasses.dataclass
class Fault:
    """A fault as injected: when (wall clock, UTC: the database runs on this host), what it
    hit, and the tasks it interrupted (their next attempt measures the recovery)."""

    kind: str
    at: datetime
    target: str
    affected: list[str]


@dataclasses.dataclass(frozen=True)
class FollowUp:
    """A task Celery publishes once its predecessors succeed: a chain's next step, a
    ``link=`` callback, a chord's callback (``soak.follow``, effect ``<name>:<key>``)."""

    kind: str
    key: str
    name: str
    task_id: str
    #: the tasks that must all SUCCEED before it runs
    after: tuple[str, ...]


@dataclasses.dataclass
class Report:
    """The outcome of one soak (:meth:`table` prints it)."""

    opts: Options
    kinds: dict[str, str] = dataclasses.field(default_factory=dict)
    args: dict[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)
    faults: list[Fault] = dataclasses.field(default_factory=list)
    restarts: int = 0
    #: Workers that exited on their own (not killed by the schedule), restarted as a
    #: supervisor would (Celery's "Could not start worker processes", say).
    died: int = 0
    records: dict[str, TaskRecord] = dataclasses.field(default_factory=dict)
    violations: list[str] = dataclasses.field(default_factory=list)
    duplicate_effects: int = 0
    nonidempotent_reruns: int = 0
    idempotent_replays: int = 0
    lost: list[str] = dataclasses.field(default_factory=list)
    followups: list[FollowUp] = dataclasses.field(default_factory=list)
    #: follow-ups whose predecessors succeeded but that never ran
    lost_followups: list[str] = dataclasses.field(default_factory=list)
    #: follow-ups that ran more than once, or although a predecessor did not succeed
    repeated_followups: list[str] = dataclasses.field(default_factory=list)
    #: limited tasks (``soak.limited``), and the most RUNNING at once in one group
    limited: int = 0
    limited_peak: int = 0
    #: tasks held in the store until their ETA (the "held" kind), and those that were
    #: published or started before it
    held: int = 0
    held_early: int = 0
    #: fault kind -> seconds from the fault to each affected task's next attempt
    recovery: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    #: fault kind -> affected tasks that needed no new attempt
    not_rerun: dict[str, int] = dataclasses.field(default_factory=dict)
    chaos_wall: float = 0.0
    settle_wall: float = 0.0
    log: list[str] = dataclasses.field(default_factory=list)
    #: where the evidence of the violations was written (:func:`keep_evidence`)
    evidence: str | None = None

    @property
    def ok(self) -> bool:
        return not self.violations

    def outcomes(self) -> Counter[str]:
        return Counter(r.state.value for r in self.records.values())

    def manual_reasons(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for r in self.records.values():
            if r.state is State.WAIT_MANUAL:
                reason = r.reason or "(no reason)"
                out[reason.split(":")[0].split(" (")[0][:60]] += 1
        return out

    def table(self) -> str:
        """The summary: tasks, faults by kind, outcomes, duplicates, losses, recovery."""
        o = self.opts
        if o.broker == "amqp":
            broker = "RabbitMQ broker on a vhost of its own (purged, connections closed)"
        else:
            broker = f"Redis {'restarted' if o.restart_redis else 'queues dropped'}"
        kinds = fault_kinds(o.broker, o.store)
        store = "SQLite" if o.store == "sqlite" else "PostgreSQL"
        lines = [
            f"chaos soak: seed {o.seed}, {o.workers} workers, {o.chaos_seconds:g} s of chaos, "
            f"{store} store, {broker}",
            "",
            "| measure | value |",
            "|---|---|",
            f"| tasks submitted | {len(self.kinds)} |",
            f"| worker restarts | {self.restarts} |",
            f"| workers that exited on their own (restarted) | {self.died} |",
        ]
        by_kind = Counter(f.kind for f in self.faults)
        for kind in kinds:
            lines.append(f"| faults: {kind} | {by_kind.get(kind, 0)} |")
        for state, n in sorted(self.outcomes().items()):
            lines.append(f"| outcome: {state} | {n} |")
        for reason, n in sorted(self.manual_reasons().items()):
            lines.append(f"| WAIT_MANUAL reason: {reason} | {n} |")
        lines += [
            f"| duplicate effects (must be 0) | {self.duplicate_effects} |",
            f"| non-idempotent re-runs (must be 0) | {self.nonidempotent_reruns} |",
            f"| lost tasks (must be 0) | {len(self.lost)} |",
            "| follow-ups (chain steps, link= callbacks, chord callbacks) "
            f"| {len(self.followups)} |",
            f"| lost follow-ups (must be 0) | {len(self.lost_followups)} |",
            f"| repeated follow-ups (must be 0) | {len(self.repeated_followups)} |",
            f"| limited tasks (one at a time per group) | {self.limited} |",
            f"| most RUNNING at once in one group (must be at most {LIMIT}) | "
            f"{self.limited_peak} |",
            f"| held tasks (countdown past lease_hold_eta_after) | {self.held} |",
            f"| held tasks run or published early (must be 0) | {self.held_early} |",
            f"| idempotent calls answered from their key | {self.idempotent_replays} |",
            f"| chaos wall time | {self.chaos_wall:.1f} s |",
            f"| end of schedule -> every task settled | {self.settle_wall:.1f} s |",
            f"| violations (must be 0) | {len(self.violations)} |",
            "",
            "recovery: fault -> affected task's next attempt started after its lease expired "
            "for a reason that fault causes, or its lost message was re-published (seconds; "
            "credited to the latest fault that hit the task before it)",
            "",
            "| fault | injected | tasks hit | recovered after it | no recovery of its own "
            "| p50 | p90 | p99 | max |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for kind in kinds:
            values = sorted(self.recovery.get(kind, []))
            hit = sum(len(f.affected) for f in self.faults if f.kind == kind)
            cells = [_fmt(_quantile(values, q)) for q in (0.5, 0.9, 0.99)]
            cells.append(_fmt(values[-1] if values else None))
            lines.append(
                f"| {kind} | {by_kind.get(kind, 0)} | {hit} | {len(values)} | "
                f"{self.not_rerun.get(kind, 0)} | " + " | ".join(cells) + " |"
            )
        return "\n".join(lines)

    def failure_message(self) -> str:
        shown = self.violations[:40]
        more = len(self.violations) - len(shown)
        return (
            f"chaos soak seed {self.opts.seed} failed (reproduce with {SEED_ENV}="
            f"{self.opts.seed}): {len(self.violations)} violations\n"
            + (f"evidence kept in {self.evidence}\n" if self.evidence else "")
            + "\n".join(f"  - {v}" for v in shown)
            + (f"\n  ... {more} more" if more else "")
            + "\n\n"
            + self.table()
            + "\n\nevents:\n"
            + "\n".join(self.log[-200:])
        )


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    rank = (len(values) - 1) * q
    low = int(rank)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (rank - low)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


# -- verification ----------------------------------------------------------------------------


def verify(project: LeasedProject, report: Report) -> None:
    """Check every invariant of the soak; violations go to ``report.violations``."""
    store = project.store
    records = {r.id: r for r in store.list_tasks(limit=100_000)}
    report.records = {t: records[t] for t in report.kinds if t in records}
    v = report.violations
    running = [r.id for r in records.values() if r.state is State.RUNNING]
    if running:
        v.append(f"{len(running)} tasks still RUNNING: {running[:8]}")
    for task_id, kind in report.kinds.items():
        rec = records.get(task_id)
        if rec is None:
            report.lost.append(task_id)
            v.append(f"lost: {kind} task {task_id} has no row")
            continue
        if rec.state not in SETTLED:
            report.lost.append(task_id)
            v.append(f"{kind} task {task_id} ({rec.name}) is {rec.state.value}")
            continue
        if rec.state is State.WAIT_MANUAL:
            reason = (rec.reason or "").strip()
            if not reason:
                v.append(f"{kind} task {task_id} is WAIT_MANUAL without a reason")
            elif "outcome of step" in reason and kind != "nonidem":
                v.append(f"{kind} task {task_id}: unexpected unknown outcome: {reason}")
        elif rec.state not in ALLOWED[kind] or (
            rec.state is State.FAILED and _OWN_FAILURE[kind] not in f"{rec.reason} {rec.error}"
        ):
            v.append(
                f"{kind} task {task_id} ({rec.name}) ended {rec.state.value}: "
                f"{rec.reason!r} {rec.error!r}"
            )
    _verify_effects(project, report, records)
    _verify_followups(project, report, records)
    _verify_limits(project, report)
    _verify_held(project, report, records)
    try:
        check_audit(store, list(records))
    except AssertionError as error:
        v.append(f"audit: {error}")
    found = check(store, liveness=False)
    v.extend(f"check: {violation}" for violation in found)
    _recovery(project, report)


#: The concurrency limit of ``soak.limited`` per group (see :data:`chaos.SOURCE`).
LIMIT = 1


def _verify_limits(project: LeasedProject, report: Report) -> None:
    """The limited tasks' RUNNING spans in the audit trail (database time): never more
    than the limit at once per group, whatever was killed or frozen meanwhile."""
    spans: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for task_id, kind in report.kinds.items():
        if kind != "limited":
            continue
        report.limited += 1
        group = str(report.args[task_id][3])
        began = None
        for r in project.store.history(task_id):
            if r.to_state is State.RUNNING:
                began = r.at.timestamp()
            elif r.from_state is State.RUNNING and began is not None:
                # an end at the same instant as a start closes first
                spans[group] += [(began, 1), (r.at.timestamp(), -1)]
                began = None
    for group, events in sorted(spans.items()):
        running = most = 0
        for _, step in sorted(events):
            running += step
            most = max(most, running)
        report.limited_peak = max(report.limited_peak, most)
        if most > LIMIT:
            report.violations.append(
                f"concurrency limit of soak.limited[group={group}] exceeded: {most} RUNNING "
                f"at once, the limit is {LIMIT}"
            )


def _verify_held(project: LeasedProject, report: Report, records: dict[str, TaskRecord]) -> None:
    """A held task is not started before its ETA, nor published more than one reaper
    interval before it (database time): the store kept it until due, whatever was
    killed meanwhile."""
    for task_id, kind in report.kinds.items():
        rec = records.get(task_id)
        if kind != "held" or rec is None:
            continue
        report.held += 1
        # the ETA Celery put in the message (the row's own is cleared by a retry)
        header = json.loads(rec.message or "{}").get("headers", {}).get("eta")
        if header is None:
            report.violations.append(f"held task {task_id} has no ETA in its stored message")
            continue
        eta = datetime.fromisoformat(header)
        early = []
        starts = [r.at for r in project.store.history(task_id) if r.to_state is State.RUNNING]
        if starts and min(starts) < eta:
            early.append(f"started at {min(starts).isoformat()}")
        # a reaper publishes a held row up to one reaper interval before its ETA (the
        # worker waits out the rest); a row published again after a fault shows only
        # its last publication, so only a row started once shows its first
        ahead = timedelta(seconds=project.store.config.reaper_interval)
        published = rec.published_at
        if len(starts) <= 1 and published is not None and published < eta - ahead:
            early.append(f"published at {published.isoformat()}")
        if early:
            report.held_early += 1
            report.violations.append(f"held task {task_id} due at {header}: " + ", ".join(early))


def _verify_effects(project: LeasedProject, report: Report, records: dict[str, TaskRecord]) -> None:
    """Idempotent effects at most once (exactly once for a SUCCEEDED task's steps);
    the non-idempotent call at most once (never re-run after an unknown outcome)."""
    v = report.violations
    effects: dict[str, list[Effect]] = defaultdict(list)
    for effect in project.external.effects():
        effects[effect.name].append(effect)
    report.idempotent_replays = project.external.calls() - sum(len(e) for e in effects.values())
    for name, found in sorted(effects.items()):
        if name.startswith("start:"):
            continue
        if name.startswith("charge:"):
            if len(found) > 1:
                report.nonidempotent_reruns += len(found) - 1
                attempts = [e.payload for e in found]
                v.append(
                    f"{name}: non-idempotent call made {len(found)} times (attempts {attempts})"
                )
        elif len(found) > 1:
            report.duplicate_effects += len(found) - 1
            v.append(f"{name}: idempotent effect performed {len(found)} times")
    for task_id, kind in report.kinds.items():
        rec = records.get(task_id)
        if rec is None or rec.state is not State.SUCCEEDED or kind not in _DONE_STEPS:
            continue
        key = str(report.args[task_id][0])
        for step in _DONE_STEPS[kind](report.args[task_id]):
            if len(effects.get(f"{step}:{key}", [])) != 1:
                v.append(f"{kind} task {task_id} SUCCEEDED without its {step!r} effect")
        if kind == "nonidem" and len(effects.get(f"charge:{key}", [])) != 1:
            v.append(f"nonidem task {task_id} SUCCEEDED without exactly one charge")


def _ready(followup: FollowUp, records: dict[str, TaskRecord]) -> bool:
    """Whether every predecessor of ``followup`` SUCCEEDED (Celery then publishes it)."""
    return all(
        (rec := records.get(t)) is not None and rec.state is State.SUCCEEDED for t in followup.after
    )


def unsettled_followups(report: Report, records: dict[str, TaskRecord]) -> list[str]:
    """Follow-ups due (their predecessors SUCCEEDED) whose row is missing or not settled."""
    out = []
    for f in report.followups:
        rec = records.get(f.task_id)
        if _ready(f, records) and (rec is None or rec.state not in SETTLED):
            out.append(
                f"{f.kind} follow-up {f.name} of {f.key} ({rec.state.value if rec else 'no row'})"
            )
    return out


def _verify_followups(
    project: LeasedProject, report: Report, records: dict[str, TaskRecord]
) -> None:
    """Each follow-up whose predecessors all SUCCEEDED ran once (its row SUCCEEDED with
    one effect, or WAIT_MANUAL with a reason: handed to a person, not lost); one whose
    predecessors did not all succeed never ran; none ran twice."""
    v = report.violations
    for f in report.followups:
        what = f"{f.kind} follow-up {f.name} of {f.key} ({f.task_id})"
        effects = len(project.external.effects(f"{f.name}:{f.key}"))
        rec = records.get(f.task_id)
        if effects > 1:
            report.repeated_followups.append(f.task_id)
            v.append(f"{what}: ran {effects} times")
        if not _ready(f, records):
            if effects:
                report.repeated_followups.append(f.task_id)
                v.append(f"{what}: ran although a predecessor did not succeed")
            continue
        if rec is not None and rec.state is State.WAIT_MANUAL and (rec.reason or "").strip():
            continue
        if rec is None or rec.state is not State.SUCCEEDED or effects == 0:
            report.lost_followups.append(f.task_id)
            state = rec.state.value if rec is not None else "no row"
            v.append(
                f"{what}: lost ({state}, {effects} effects) although its predecessors succeeded"
            )


#: fault kind -> words of the expiry reasons (RUNNING -> TIMEOUT) that fault can cause
_EXPIRY_CAUSES: dict[str, tuple[str, ...]] = {
    "kill_child": ("pool child lost",),
    "kill_worker": ("restarted", "heartbeat older than the TTL"),
    "freeze": ("heartbeat older than the TTL", "self-fenced"),
    "pg_terminate": ("store unavailable", "self-fenced"),
    # a lost broker connection clears the worker's reservations: what it claimed ahead
    # for them is given back
    "rabbitmq_disconnect": ("no longer holds its delivery",),
}


def _recovery(project: LeasedProject, report: Report) -> None:
    """Seconds from each fault to each affected task's recovery: its next attempt
    (claim) after a lease expiry (RUNNING -> TIMEOUT) that followed the fault, for a
    reason that fault can cause (a task the driver saw on a worker may have been hit
    by a concurrent fault it did not see). A next attempt without an expiry in between
    is the task's own retry, not a recovery; a ``redis`` or ``rabbitmq_purge`` fault hits
    PENDING tasks, whose next claim (after a re-publish) is their recovery.

    A recovery is credited to the latest fault that hit the task before it: a task hit
    by a ``pg_terminate`` and then by a ``kill_child`` owes its re-run to the kill."""
    trails: dict[str, tuple[list[datetime], list[tuple[datetime, str]]]] = {}
    hits: dict[str, list[datetime]] = defaultdict(list)
    for fault in report.faults:
        for task_id in fault.affected:
            hits[task_id].append(fault.at)
    for fault in report.faults:
        for task_id in fault.affected:
            if task_id not in trails:
                trail = project.store.history(task_id)
                trails[task_id] = (
                    [
                        _utc(r.at)
                        for r in trail
                        if (r.from_state, r.to_state) == (State.PENDING, State.RUNNING)
                    ],
                    [(_utc(r.at), r.reason or "") for r in trail if r.to_state is State.TIMEOUT],
                )
            claims, expiries = trails[task_id]
            claim = next((at for at in claims if at > fault.at), None)
            expiry = next((e for e in expiries if e[0] > fault.at), None)
            if fault.kind in _MESSAGE_LOSSES:
                recovered = claim is not None
            else:
                causes = _EXPIRY_CAUSES[fault.kind]
                recovered = (
                    claim is not None
                    and expiry is not None
                    and expiry[0] < claim
                    and any(cause in expiry[1] for cause in causes)
                )
            if (
                claim is not None
                and recovered
                and not any(fault.at < hit < claim for hit in hits[task_id])
            ):
                report.recovery.setdefault(fault.kind, []).append(
                    (claim - fault.at).total_seconds()
                )
            else:
                report.not_rerun[fault.kind] = report.not_rerun.get(fault.kind, 0) + 1


def _utc(at: datetime) -> datetime:
    return at if at.tzinfo is not None else at.replace(tzinfo=timezone.utc)


# -- evidence -------------------------------------------------------------------------------


def involved(report: Report) -> list[str]:
    """The tasks a violation names, with the predecessors of its follow-ups."""
    text = "\n".join(report.violations)
    ids = {t for t in report.kinds if t in text}
    for f in report.followups:
        if f.task_id in text or f.key in text:
            ids.update((f.task_id, *f.after))
    return sorted(ids)


def keep_evidence(project: LeasedProject, report: Report, redis_url: str, directory: Path) -> Path:
    """Write what a violation needs to be understood, before anything is dropped: the
    rows of the tasks involved (with their stored messages and ``follow_ups_at``), their
    audit trails and steps, and the result backend's keys of them and of their chords
    (``celery-task-meta-<id>``, the group's ``.j``/``.t``/``.s``/``.d``/``.c`` keys)."""

    import redis

    from celery_lease.producer.message import decode

    store = project.store
    client = redis.Redis.from_url(redis_url, socket_connect_timeout=5)
    tasks: dict[str, Any] = {}
    keys: dict[str, Any] = {}
    try:
        for task_id in involved(report):
            record = store.get(task_id)
            entry: dict[str, Any] = {"kind": report.kinds.get(task_id)}
            if record is not None:
                entry["row"] = record.as_dict()
                entry["audit"] = [dataclasses.asdict(t) for t in store.history(task_id)]
                entry["steps"] = [dataclasses.asdict(s) for s in store.steps(task_id)]
            patterns = [f"*{task_id}*"]
            if record is not None and record.message:
                headers, _ = decode(project.module.app, record.message)
                if headers.get("group"):
                    patterns.append(f"*{headers['group']}*")
            for pattern in patterns:
                for key in client.scan_iter(match=pattern, count=1000):
                    keys[key.decode()] = _redis_value(client, key)
            tasks[task_id] = entry
    finally:
        client.close()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"soak-{report.opts.seed}-evidence.json"
    evidence = {
        "seed": report.opts.seed,
        "violations": report.violations,
        "tasks": tasks,
        "redis_keys": keys,
    }
    path.write_text(json.dumps(evidence, indent=2, default=str))
    report.evidence = str(path)
    return path


def _redis_value(client: Any, key: bytes) -> Any:
    kind = client.type(key).decode()
    if kind == "string":
        return client.get(key)
    if kind == "list":
        return client.lrange(key, 0, -1)
    if kind == "zset":
        return client.zrange(key, 0, -1, withscores=True)
    if kind == "set":
        return sorted(client.smembers(key))
    if kind == "hash":
        return client.hgetall(key)
    return kind
