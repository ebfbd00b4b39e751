"""Health figures per task name: what an operator alerts on.

For each task name, over a window of recent history: how many finished and how
(failure and cancel rates), run-time percentiles next to the limits the rows carry
(``max_runtime``, ``lease_ttl``), and the backlog (PENDING rows and the age of the
oldest). Read by ``admin(app).stats()``, ``celery lease stats`` and the Prometheus
collector; every figure comes from a bounded index range (see ``store._totals``).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from .states import State
from .store import Store

#: Run durations read per call at most (the most recent ones).
DURATION_SAMPLE = 10_000
#: Finished rows per state counted exactly; past that, estimated (see :func:`state_counts`).
COUNT_CAP = 100_000


def state_counts(store: Store, cap: int = COUNT_CAP) -> tuple[dict[State, int], bool]:
    """Rows per state (every state, zero included) and whether any is an estimate.

    Live states are counted exactly; SUCCEEDED, FAILED and CANCELLED exactly up to
    ``cap`` rows each, then from PostgreSQL's planner statistics, so that the cost of
    the figure does not grow with the table."""
    counts: dict[State, int] = dict.fromkeys(State, 0)
    counts.update(store.live_counts())
    finished, estimated = store.finished_total(cap)
    counts.update(finished)
    return counts, estimated


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) of ``values`` by linear interpolation (``None`` if empty)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclasses.dataclass(frozen=True)
class TaskHealth:
    """The health of one task name over the window (see :func:`task_health`)."""

    name: str
    #: Tasks that reached SUCCEEDED, FAILED or CANCELLED within the window.
    finished: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    #: FAILED / finished and CANCELLED / finished (``None``: none finished).
    failure_rate: float | None = None
    cancel_rate: float | None = None
    #: Runs the percentiles are computed from (SUCCEEDED and FAILED, most recent first).
    runs: int = 0
    run_p50: float | None = None
    run_p95: float | None = None
    run_p99: float | None = None
    run_max: float | None = None
    #: The limits of the most recent run's row (``None``: no max_runtime).
    max_runtime: float | None = None
    lease_ttl: float | None = None
    #: PENDING rows now, and seconds since the oldest of them was submitted.
    pending: int = 0
    oldest_pending_age: float | None = None

    @property
    def p99_of_max_runtime(self) -> float | None:
        """``run_p99 / max_runtime``: near 1, runs are about to be sent to a person."""
        if self.run_p99 is None or not self.max_runtime:
            return None
        return self.run_p99 / self.max_runtime

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["p99_of_max_runtime"] = self.p99_of_max_runtime
        return out


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What one read of the window gives: per task name, and over all names."""

    tasks: list[TaskHealth]
    #: Tasks finished within the window, per final state (all names).
    finished: dict[State, int]
    #: The sampled run durations (all names, most recent first).
    durations: list[float]


def snapshot(store: Store, window: float, sample: int = DURATION_SAMPLE) -> Snapshot:
    """Read the window once: finished counts by name and state, the most recent
    ``sample`` run durations, the backlog by name."""
    counts: dict[str, dict[State, int]] = defaultdict(lambda: defaultdict(int))
    totals: dict[State, int] = dict.fromkeys((State.SUCCEEDED, State.FAILED, State.CANCELLED), 0)
    for f in store.finished_by_name(window):
        counts[f.name][f.state] += f.count
        totals[f.state] += f.count
    durations: dict[str, list[float]] = defaultdict(list)
    limits: dict[str, tuple[float | None, float]] = {}
    every: list[float] = []
    for r in store.recent_runtimes(window, sample):
        durations[r.name].append(r.seconds)
        every.append(r.seconds)
        limits.setdefault(r.name, (r.max_runtime, r.lease_ttl))  # most recent first
    backlog = {b.name: b for b in store.backlog()}
    out = []
    for name in sorted({*counts, *durations, *backlog}):
        by_state = counts.get(name, {})
        total = sum(by_state.values())
        runs = durations.get(name, [])
        max_runtime, ttl = limits.get(name, (None, None))
        pending = backlog.get(name)
        out.append(
            TaskHealth(
                name=name,
                finished=total,
                succeeded=by_state.get(State.SUCCEEDED, 0),
                failed=by_state.get(State.FAILED, 0),
                cancelled=by_state.get(State.CANCELLED, 0),
                failure_rate=by_state.get(State.FAILED, 0) / total if total else None,
                cancel_rate=by_state.get(State.CANCELLED, 0) / total if total else None,
                runs=len(runs),
                run_p50=percentile(runs, 0.5),
                run_p95=percentile(runs, 0.95),
                run_p99=percentile(runs, 0.99),
                run_max=max(runs) if runs else None,
                max_runtime=max_runtime,
                lease_ttl=ttl,
                pending=pending.pending if pending else 0,
                oldest_pending_age=pending.oldest_age if pending else None,
            )
        )
    return Snapshot(out, totals, every)


def task_health(store: Store, window: float, sample: int = DURATION_SAMPLE) -> list[TaskHealth]:
    """Health of every task name with a run in the window or a PENDING row, by name."""
    return snapshot(store, window, sample).tasks


__all__ = [
    "COUNT_CAP",
    "DURATION_SAMPLE",
    "Snapshot",
    "TaskHealth",
    "percentile",
    "snapshot",
    "state_counts",
    "task_health",
]
