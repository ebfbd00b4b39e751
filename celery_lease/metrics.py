"""Prometheus metrics for the lease tables (``pip install 'celery-lease[prometheus]'``).

Every figure is read from the database at scrape time, so any process can serve
them (``celery -A proj lease metrics --port 9808``) and every worker's work counts:

==============================================  =========  ==================================
``celery_lease_up``                             gauge      1 if the lease database answered
``celery_lease_tasks{state}``                   gauge      tasks per state
``celery_lease_expired_unreaped``               gauge      RUNNING tasks whose lease expired
                                                           but no reaper moved yet (zombies)
``celery_lease_oldest_pending_age_seconds``     gauge      age of the oldest PENDING task
``celery_lease_recoveries_total``               counter    lease expiries (RUNNING -> TIMEOUT)
``celery_lease_transitions_total{from_state,    counter    audit rows by transition
to_state}``
``celery_lease_worker_heartbeat_age_seconds     gauge      seconds since each live (not
{worker,hostname}``                                        stopped) incarnation's heartbeat
``celery_lease_worker_alive{worker}``           gauge      1 while its heartbeat is within TTL
``celery_lease_worker_running_tasks{worker}``   gauge      RUNNING tasks it owns
``celery_lease_purged_total``                   counter    finished rows deleted by retention
``celery_lease_republished_total``              counter    messages re-published by the reaper
``celery_lease_duplicates_dropped_total``       counter    duplicate deliveries dropped at claim
``celery_lease_task_runtime_seconds{task,       gauge      run-time percentiles over the
quantile}``                                                window (SUCCEEDED and FAILED runs)
``celery_lease_task_max_runtime_seconds{task}`` gauge      the task's ``max_runtime``
``celery_lease_task_lease_ttl_seconds{task}``   gauge      the task's ``lease_ttl``
``celery_lease_task_finished{task,state}``      gauge      tasks finished within the window
``celery_lease_task_failure_ratio{task}``       gauge      FAILED / finished within the window
``celery_lease_task_cancel_ratio{task}``        gauge      CANCELLED / finished within it
``celery_lease_task_pending{task}``             gauge      PENDING tasks (the backlog)
``celery_lease_task_oldest_pending_age_seconds  gauge      age of its oldest PENDING task
{task}``
``celery_lease_counts_estimated``               gauge      1 if a finished state's count is
                                                           PostgreSQL's estimate
``celery_lease_transitions_fold_lag``           gauge      audit ids the reaper has not folded
                                                           into the transition totals yet
``celery_lease_transitions_uncounted``          gauge      audit ids above this scrape's tail
                                                           (counters behind by at most this)
``celery_lease_concurrency_slots_in_use        gauge      a limited task's slots in use per
{task,key}``                                               concurrency key (``""``: global)
``celery_lease_concurrency_limit{task,key}``    gauge      its limit, as its last claim gave it
``celery_lease_concurrency_waiting{task,key}``  gauge      rows waiting for a slot of the key
``celery_lease_concurrency_oldest_waiting_age_  gauge      age of the key's oldest waiting row
seconds{task,key}``
``celery_lease_beat_slots_missed_total{entry}`` counter    beat slots missed while no beat ran
                                                           (not run: catch-up policy, window)
``celery_lease_beat_slots_skipped_total{entry}`` counter   beat slots skipped by the overlap
                                                           policy (previous run unfinished)
==============================================  =========  ==================================

The window of the per-task figures is ``window`` seconds (default 300; ``lease metrics
--window``). Counts of SUCCEEDED, FAILED and CANCELLED rows beyond 100,000 each are
PostgreSQL's planner estimates, so a scrape stays cheap however large the table is.

The transition counters are read from the transition totals the reaper keeps (settled
audit rows folded in bounded batches, see ``celery_lease.store._totals``) plus the
audit rows above their watermark, at most 200,000 of them (``metrics_tail_rows``) by
primary-key range: a scrape reads a handful of rows and a bounded tail whatever the
size of the audit table, a fresh metrics process serves the same totals as an old one,
and deleting audit rows (retention, ``lease purge``) never lowers a counter. When the
reaper is behind, ``celery_lease_transitions_fold_lag`` says by how many audit ids
and ``celery_lease_transitions_uncounted`` how many this scrape left out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from celery import Celery

from ._runtime import runtime
from .exceptions import CeleryLeaseError, MissingDependencyError
from .health import TaskHealth, state_counts, task_health
from .states import State
from .store import SlotUsage, Store, Totals

logger = logging.getLogger("celery_lease.metrics")

_Pair = tuple[str, str]

#: Counters kept in the ``counters`` table (they count events that leave no row).
_COUNTERS = {
    "purged": "Finished rows deleted by retention (lease_retention)",
    "republished": "Messages the reaper published again (lost, or never marked published)",
    "duplicates_dropped": "Deliveries dropped at claim without running (duplicates, stale)",
}

#: Seconds of history the per-task figures cover by default.
WINDOW = 300.0


def _task_families(core: Any, health: list[TaskHealth]) -> Iterator[Any]:
    runtime_ = core.GaugeMetricFamily(
        "celery_lease_task_runtime_seconds",
        "Run-time percentiles of SUCCEEDED and FAILED runs within the window",
        labels=["task", "quantile"],
    )
    max_runtime = core.GaugeMetricFamily(
        "celery_lease_task_max_runtime_seconds",
        "max_runtime of the task's most recent run (absent: no limit)",
        labels=["task"],
    )
    ttl = core.GaugeMetricFamily(
        "celery_lease_task_lease_ttl_seconds",
        "lease_ttl of the task's most recent run",
        labels=["task"],
    )
    finished = core.GaugeMetricFamily(
        "celery_lease_task_finished",
        "Tasks that finished within the window, by final state",
        labels=["task", "state"],
    )
    failure = core.GaugeMetricFamily(
        "celery_lease_task_failure_ratio",
        "FAILED / finished within the window",
        labels=["task"],
    )
    cancel = core.GaugeMetricFamily(
        "celery_lease_task_cancel_ratio",
        "CANCELLED / finished within the window",
        labels=["task"],
    )
    pending = core.GaugeMetricFamily(
        "celery_lease_task_pending", "PENDING tasks (the backlog)", labels=["task"]
    )
    oldest = core.GaugeMetricFamily(
        "celery_lease_task_oldest_pending_age_seconds",
        "Seconds since the task's oldest PENDING row was submitted",
        labels=["task"],
    )
    for h in health:
        for q, v in (("0.5", h.run_p50), ("0.95", h.run_p95), ("0.99", h.run_p99)):
            if v is not None:
                runtime_.add_metric([h.name, q], v)
        if h.max_runtime is not None:
            max_runtime.add_metric([h.name], h.max_runtime)
        if h.lease_ttl is not None:
            ttl.add_metric([h.name], h.lease_ttl)
        if h.finished:
            for state, n in (
                (State.SUCCEEDED, h.succeeded),
                (State.FAILED, h.failed),
                (State.CANCELLED, h.cancelled),
            ):
                finished.add_metric([h.name, state.value], n)
            failure.add_metric([h.name], h.failure_rate or 0.0)
            cancel.add_metric([h.name], h.cancel_rate or 0.0)
        pending.add_metric([h.name], h.pending)
        oldest.add_metric([h.name], h.oldest_pending_age or 0.0)
    yield from (runtime_, max_runtime, ttl, finished, failure, cancel, pending, oldest)


def _slot_families(core: Any, usage: list[SlotUsage]) -> Iterator[Any]:
    """Per limited task and key: slots in use, limit, rows waiting, oldest waiting age."""
    labels = ["task", "key"]
    in_use = core.GaugeMetricFamily(
        "celery_lease_concurrency_slots_in_use",
        "Slots of a limited task in use per concurrency key (RUNNING, or granted)",
        labels=labels,
    )
    limit = core.GaugeMetricFamily(
        "celery_lease_concurrency_limit",
        "The concurrency limit per key, as the task's last claim gave it",
        labels=labels,
    )
    waiting = core.GaugeMetricFamily(
        "celery_lease_concurrency_waiting",
        "PENDING rows waiting for a concurrency slot of the key",
        labels=labels,
    )
    oldest = core.GaugeMetricFamily(
        "celery_lease_concurrency_oldest_waiting_age_seconds",
        "Seconds since the key's oldest waiting row was submitted",
        labels=labels,
    )
    for u in usage:
        in_use.add_metric([u.name, u.key], u.running + u.granted)
        limit.add_metric([u.name, u.key], u.limit)
        waiting.add_metric([u.name, u.key], u.waiting)
        oldest.add_metric([u.name, u.key], u.oldest_waiting_age or 0.0)
    yield from (in_use, limit, waiting, oldest)


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as error:
        raise MissingDependencyError("prometheus-client", "prometheus") from error
    return prometheus_client


class TransitionTotals:
    """Monotonic transition counts: the reaper's folded totals plus a bounded tail of
    the audit rows above their watermark (at most ``tail`` ids; default the config's
    ``metrics_tail_rows``)."""

    def __init__(self, tail: int | None = None) -> None:
        self.tail = tail

    def snapshot(self, store: Store) -> Totals:
        """The store's transition totals with this tail (lag and what it left out too)."""
        return store.transition_totals(tail=self.tail)

    def read(self, store: Store) -> dict[_Pair, int]:
        """Totals by (from_state, to_state); a row's creation counts as from ``"none"``."""
        return labelled(self.snapshot(store))


def labelled(totals: Totals) -> dict[_Pair, int]:
    """``totals.counts`` keyed by label values (a creation is from ``"none"``)."""
    return {(frm or "none", to): n for (frm, to), n in totals.counts.items()}


class LeaseCollector:
    """A ``prometheus_client`` collector reading the lease tables of ``app`` at each scrape."""

    def __init__(
        self,
        app: Celery,
        store: Store | None = None,
        window: float = WINDOW,
        *,
        tail: int | None = None,
    ) -> None:
        self.prom = _prometheus()
        self.app = app
        self._store = store
        self.totals = TransitionTotals(tail)
        self.window = window

    @property
    def store(self) -> Store:
        return self._store if self._store is not None else runtime(self.app).store

    def describe(self) -> list[Any]:
        # nothing to describe up front: registering must not query the database
        return []

    def collect(self) -> Iterator[Any]:
        core = self.prom.metrics_core
        started = time.monotonic()
        up = core.GaugeMetricFamily(
            "celery_lease_up", "1 if the lease database answered this scrape, else 0"
        )
        try:
            families = list(self._families(core))
        except CeleryLeaseError as error:
            logger.warning("celery-lease metrics: lease database not read: %s", error)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families
        took = core.GaugeMetricFamily(
            "celery_lease_scrape_duration_seconds", "Seconds the lease queries of a scrape took"
        )
        took.add_metric([], time.monotonic() - started)
        yield took

    def _families(self, core: Any) -> Iterator[Any]:
        store = self.store
        counts, estimated = state_counts(store)
        tasks = core.GaugeMetricFamily(
            "celery_lease_tasks", "Leased tasks per state", labels=["state"]
        )
        for state in State:
            tasks.add_metric([state.value], counts.get(state, 0))
        yield tasks
        guess = core.GaugeMetricFamily(
            "celery_lease_counts_estimated",
            "1 if a finished state's count in celery_lease_tasks is PostgreSQL's estimate",
        )
        guess.add_metric([], 1 if estimated else 0)
        yield guess
        yield from _task_families(core, task_health(store, self.window))
        yield from _slot_families(core, store.slot_usage())

        expired = core.GaugeMetricFamily(
            "celery_lease_expired_unreaped",
            "RUNNING tasks whose lease expired but which no reaper has moved yet (zombies)",
        )
        expired.add_metric([], store.expired_unreaped())
        yield expired

        oldest = core.GaugeMetricFamily(
            "celery_lease_oldest_pending_age_seconds",
            "Seconds since the oldest PENDING task was submitted (0: none pending)",
        )
        oldest.add_metric([], store.oldest_pending_age() or 0.0)
        yield oldest

        seen = self.totals.snapshot(store)
        totals = labelled(seen)
        transitions = core.CounterMetricFamily(
            "celery_lease_transitions",
            "State changes recorded in the audit trail",
            labels=["from_state", "to_state"],
        )
        for (frm, to), n in sorted(totals.items()):
            transitions.add_metric([frm, to], n)
        yield transitions
        recoveries = core.CounterMetricFamily(
            "celery_lease_recoveries", "Lease expiries (RUNNING -> TIMEOUT transitions)"
        )
        recoveries.add_metric([], totals.get((State.RUNNING.value, State.TIMEOUT.value), 0))
        yield recoveries
        lag = core.GaugeMetricFamily(
            "celery_lease_transitions_fold_lag",
            "Audit ids above the transition totals' watermark: what the reaper has yet to fold",
        )
        lag.add_metric([], seen.lag)
        yield lag
        uncounted = core.GaugeMetricFamily(
            "celery_lease_transitions_uncounted",
            "Audit ids above what this scrape counted (the transition counters are behind "
            "by at most this many; 0 unless the reaper is far behind)",
        )
        uncounted.add_metric([], seen.uncounted)
        yield uncounted

        counts_total = store.counters()
        for name, help_text in _COUNTERS.items():
            family = core.CounterMetricFamily(f"celery_lease_{name}", help_text)
            family.add_metric([], counts_total.get(name, 0))
            yield family

        now = store.now()
        age = core.GaugeMetricFamily(
            "celery_lease_worker_heartbeat_age_seconds",
            "Seconds since each running (not stopped) worker incarnation renewed its heartbeat",
            labels=["worker", "hostname"],
        )
        alive = core.GaugeMetricFamily(
            "celery_lease_worker_alive",
            "1 while a worker's heartbeat is younger than lease_ttl, else 0",
            labels=["worker"],
        )
        running = core.GaugeMetricFamily(
            "celery_lease_worker_running_tasks",
            "RUNNING tasks owned by each worker",
            labels=["worker"],
        )
        for w in store.workers():
            if w.stopped_at is not None:
                continue
            age.add_metric(
                [w.nodename, w.hostname], max(0.0, (now - w.heartbeat_at).total_seconds())
            )
            alive.add_metric([w.nodename], 1 if w.alive else 0)
            running.add_metric([w.nodename], w.running)
        yield age
        yield alive
        yield running

        missed = core.CounterMetricFamily(
            "celery_lease_beat_slots_missed",
            "Beat slots of leased entries missed while no beat ran and not run (catch-up "
            "policy lease_catchup, window lease_catchup_window)",
            labels=["entry"],
        )
        skipped = core.CounterMetricFamily(
            "celery_lease_beat_slots_skipped",
            "Beat slots of leased entries skipped by the overlap policy (lease_overlap)",
            labels=["entry"],
        )
        for entry, n_missed, n_skipped in store.schedule_counts():
            missed.add_metric([entry], n_missed)
            skipped.add_metric([entry], n_skipped)
        yield missed
        yield skipped


def registry(
    app: Celery, store: Store | None = None, window: float = WINDOW, *, tail: int | None = None
) -> Any:
    """A ``prometheus_client.CollectorRegistry`` holding only the lease collector."""
    prom = _prometheus()
    reg = prom.CollectorRegistry(auto_describe=False)
    reg.register(LeaseCollector(app, store, window, tail=tail))
    return reg


def serve(
    app: Celery,
    port: int,
    addr: str = "0.0.0.0",
    store: Store | None = None,
    window: float = WINDOW,
    *,
    tail: int | None = None,
) -> Any:
    """Serve ``/metrics`` on ``addr:port`` from a background thread; returns the server
    (``server.shutdown()`` stops it; ``server.server_address`` says where it listens)."""
    prom = _prometheus()
    reg = registry(app, store, window, tail=tail)
    server, _thread = prom.start_http_server(port, addr=addr, registry=reg)
    return server


__all__ = ["WINDOW", "LeaseCollector", "TransitionTotals", "registry", "serve"]
