"""The reaper: compare-and-set sweeps over the lease tables, in bounded batches.

Safe to run concurrently and repeatedly: from beat (the ``celery_lease.reap`` task),
embedded in every worker's main process (behind a database lock), and from
``celery -A proj lease reap``.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Callable, Sequence
from typing import TypeVar

from celery import Celery, Task, shared_task

from ._broker import backlog_guard
from ._crashpoints import crash_point
from ._runtime import runtime
from .config import MAX_SECONDS
from .producer import follow_ups as _follow_ups
from .producer import publisher as _publisher
from .states import State
from .store import REPUBLISHED, Expiry, Publishable, Store

logger = logging.getLogger("celery_lease.reaper")

#: Batches per sweep and kind: one sweep stays bounded; the next continues.
MAX_BATCHES = 20

R = TypeVar("R")


@dataclasses.dataclass
class ReapReport:
    """What one sweep did, by action."""

    expired: int = 0
    retried: int = 0
    manual: int = 0
    overrun: int = 0
    due: int = 0
    republished: int = 0
    publish_failed: int = 0
    #: Finished rows deleted by retention (``lease_retention``).
    purged: int = 0
    #: SUCCEEDED rows whose recorded follow-ups the reaper published (their worker died
    #: between the outcome and the follow-ups, or the broker refused them).
    follow_ups: int = 0
    #: Published rows not re-published: the broker says their queue still holds messages.
    held: int = 0
    #: Rows held in the store until their ETA (``lease_hold_eta_after``) published
    #: because they are due.
    released: int = 0
    #: Rows waiting for a concurrency slot granted a free one and published (the
    #: backstop: the worker whose commit freed the slot does it at once).
    granted: int = 0
    #: Audit rows folded into the transition totals (not an action: not in ``total``).
    folded: int = 0
    #: RUNNING rows whose stored ``lease_ttl`` or ``max_runtime`` is out of range (an
    #: older version wrote it unchecked): swept with the value clamped, and reported.
    out_of_range: int = 0

    def add_expiries(self, expiries: Sequence[Expiry]) -> None:
        self.expired += len(expiries)
        self.retried += sum(1 for e in expiries if e.to_state is State.RETRY_WAIT)
        self.manual += sum(1 for e in expiries if e.to_state is State.WAIT_MANUAL)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @property
    def total(self) -> int:
        return (
            self.expired
            + self.overrun
            + self.due
            + self.released
            + self.granted
            + self.republished
            + self.follow_ups
            + self.purged
        )


class Reaper:
    """The sweeps of one app, run by one actor (for the audit trail)."""

    def __init__(self, app: Celery, actor: str | None = None, store: Store | None = None) -> None:
        self.app = app
        self.actor = actor or f"reaper:{socket.gethostname()}"
        self.store = store or runtime(app).store
        #: The broker failed or did not answer during this sweep: publish nothing more.
        self._broker_down = False

    def sweep(self) -> ReapReport:
        """One full pass: expired leases, overruns, due retries, lost or unpublished rows,
        follow-ups recorded and not published, the transition totals, retention."""
        report = ReapReport()
        self._broker_down = False
        batch = self.store.config.reaper_batch_size
        self.report_out_of_range(report)
        for _ in range(MAX_BATCHES):
            expiries = self.store.expire(
                actor=self.actor, reason="lease expired: owner's heartbeat older than the TTL"
            )
            report.add_expiries(expiries)
            if len(expiries) < batch:
                break
            crash_point("reaper_mid_sweep")
        for _ in range(MAX_BATCHES):
            moved = self.store.overrun(actor=self.actor)
            report.overrun += len(moved)
            if len(moved) < batch:
                break
        # expiry and overrun decisions above never wait on the broker; below, each
        # publish is bounded (see _broker), and once the broker failed or did not answer
        # this sweep asks it nothing more: the rows wait for the next sweep
        self.publish_due(report)
        self.publish_held(report)
        self.publish_granted(report)
        guard = backlog_guard(self.app, self.store.config.republish_after)

        def republish(rows: Sequence[Publishable]) -> tuple[int, int]:
            todo, held = guard.filter(self.store, rows)  # still queued: not lost
            report.held += held
            return self.publish(todo)

        report.republished += self._publish_batches(report, self.store.take_unpublished, republish)
        self.publish_follow_ups(report)
        self.store.add_counts({REPUBLISHED: report.republished})
        self.fold_transitions(report)  # before retention deletes audit rows (see _totals)
        self.purge_expired(report)
        if report.total:
            logger.info("reaper %s: %s", self.actor, report.as_dict())
        return report

    def report_out_of_range(self, report: ReapReport) -> None:
        """Count (and log) the RUNNING rows whose stored durations are out of range: the
        sweeps go on for every other row, and treat these with the value clamped."""
        bad = self.store.out_of_range(limit=MAX_BATCHES * 10)
        report.out_of_range = len(bad)
        if bad:
            logger.warning(
                "reaper %s: %d RUNNING row(s) with lease_ttl or max_runtime out of range "
                "(written unchecked by an older version?), swept as if %g s: %s",
                self.actor,
                len(bad),
                MAX_SECONDS,
                ", ".join(bad[:10]),
            )

    def purge_expired(self, report: ReapReport | None = None) -> int:
        """Retention: delete finished rows older than ``lease_retention``, in batches."""
        report = report if report is not None else ReapReport()
        cfg = self.store.config
        # tombstones of purged rows (retention or ``lease purge``) past their keep_until
        for _ in range(MAX_BATCHES):
            if self.store.purge_tombstones() < cfg.retention_batch_size:
                break
        # the lock rows of concurrency and rate-limit keys nothing uses any more
        for _ in range(MAX_BATCHES):
            if self.store.purge_idle_keys() < cfg.retention_batch_size:
                break
        if cfg.retention is None:
            return 0
        for _ in range(MAX_BATCHES):
            n = self.store.purge_expired(cfg.retention)
            report.purged += n
            if n < cfg.retention_batch_size:
                break
        return report.purged

    def fold_transitions(self, report: ReapReport | None = None) -> int:
        """Fold settled audit rows into the transition totals, in bounded batches."""
        report = report if report is not None else ReapReport()
        for _ in range(MAX_BATCHES):
            fold = self.store.fold_transitions()
            report.folded += fold.rows
            if not fold.more:
                break
        return report.folded

    def publish_due(self, report: ReapReport | None = None) -> int:
        """Move due RETRY_WAIT rows to PENDING and publish them."""
        report = self._phase(report)
        report.due += self._publish_batches(
            report, lambda: self.store.take_due_retries(actor=self.actor), self.publish
        )
        return report.due

    def publish_held(self, report: ReapReport | None = None) -> int:
        """Publish the rows held until their ETA (``lease_hold_eta_after``) that are due
        within one reaper interval, with their stored messages."""
        report = self._phase(report)
        report.released += self._publish_batches(report, self._take_held, self.publish)
        return report.released

    def publish_granted(self, report: ReapReport | None = None) -> int:
        """Grant the free concurrency slots of keys with rows waiting, least recently
        served keys first, and publish those rows (a grant its worker never made)."""
        report = self._phase(report)
        report.granted += self._publish_batches(report, self.store.take_waiting, self.publish)
        return report.granted

    def _take_held(self) -> list[Publishable]:
        rows = self.store.take_held()
        crash_point("reaper_took_held")
        return rows

    def publish_follow_ups(self, report: ReapReport | None = None) -> int:
        """Publish the follow-ups recorded with a success and not marked published
        after ``lease_publish_grace`` (chain, ``link`` callbacks, chord part-return)."""
        report = self._phase(report)
        report.follow_ups += self._publish_batches(
            report,
            self.store.take_follow_ups,
            # bounded like one publish: expiry in the next sweep never waits for a
            # batch of follow-ups going one by one to a broker that does not answer
            lambda rows: _follow_ups.replay(
                self.app, self.store, rows, budget=self.store.config.db_timeout
            ),
        )
        return report.follow_ups

    def _phase(self, report: ReapReport | None) -> ReapReport:
        """The sweep's report, or a new one for a phase run on its own (not within a
        sweep): then the broker is asked again, whatever an earlier phase found."""
        if report is not None:
            return report
        self._broker_down = False
        return ReapReport()

    def _publish_batches(
        self,
        report: ReapReport,
        take: Callable[[], Sequence[R]],
        publish: Callable[[Sequence[R]], tuple[int, int]],
    ) -> int:
        """Take and publish batches of rows until one is short, one fails, the broker
        failed or did not answer (in this sweep), or :data:`MAX_BATCHES`; the failures
        go to ``report``. Returns how many were published."""
        batch = self.store.config.reaper_batch_size
        sent = 0
        for _ in range(MAX_BATCHES):
            if self._broker_down:
                break
            rows = take()
            ok, failed = publish(rows)
            sent += ok
            report.publish_failed += failed
            if len(rows) < batch or failed:
                break
        return sent

    def publish(self, rows: Sequence[Publishable]) -> tuple[int, int]:
        """Publish PENDING rows' messages; rows left unpublished are retried after the grace."""
        # one try each: a broker that does not answer holds a sweep for one socket
        # timeout, and the next sweep tries again
        done = _publisher.publish_rows(self.app, self.store, rows, retry=False)
        self._broker_down = self._broker_down or done.broker_down
        return done.sent, done.failed


def reap(app: Celery, actor: str | None = None) -> ReapReport:
    """Run one full reaper sweep for ``app`` and return what it did."""
    return Reaper(app, actor).sweep()


# ``base``: the sweep is a plain task in every app, also in one whose ``task_cls`` is
# LeasedTask; and naming it keeps the app's ``Task`` (which, for
# ``task_cls="celery_lease:LeasedTask"``, imports this package) out of this import
@shared_task(name="celery_lease.reap", bind=True, ignore_result=True, base=Task)
def reap_task(self: Task[[], dict[str, int]]) -> dict[str, int]:
    """The beat entry: one sweep, run by whichever worker takes the message, for the
    app that runs it (``self.app``: the worker's own app, never a proxy of it)."""
    return reap(self.app, actor=f"beat:{socket.gethostname()}").as_dict()
