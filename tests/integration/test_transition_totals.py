"""Issue 14, item 5: bounded transition counters.

The reaper folds settled audit rows into the transition totals in bounded id ranges;
a scrape reads the totals plus a bounded tail above the watermark. On both backends:
the totals equal the audit table's counts after folding, deleting audit rows (retention,
``lease purge``) never lowers them, concurrent folds and purges count every row once,
and a scrape over a large unfolded backlog counts a bounded tail and reports the lag.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import func, select

from celery_lease import State
from celery_lease.config import TUNING_ENV
from celery_lease.metrics import TransitionTotals, registry
from celery_lease.store import Fold, Store

from ..helpers import discard_unpublished, wait_until
from .test_cli_support import close_ops, make_ops
from .test_retention import aged, finished
from .test_store_contract import recover, running, submit

S = State
Pair = tuple[str | None, str]


def audit_counts(store: Store) -> dict[Pair, int]:
    """The audit table counted directly (what the totals must equal)."""
    tr = store.t.transitions
    with store.engine.connect() as conn:
        rows = conn.execute(
            select(tr.c.from_state, tr.c.to_state, func.count()).group_by(
                tr.c.from_state, tr.c.to_state
            )
        ).all()
    return {(frm, to): int(n) for frm, to, n in rows}


def folded(store: Store) -> dict[Pair, int]:
    """The folded totals alone (no tail)."""
    return store.transition_totals(tail=0).counts


def fold_all(store: Store, *, limit: int = 1000) -> list[Fold]:
    """Fold (settle 0) until nothing settled is left above the watermark."""
    folds = [store.fold_transitions(settle=0, limit=limit)]
    while folds[-1].more or folds[-1].held:
        folds.append(store.fold_transitions(settle=0, limit=limit))
    return folds


def history(store: Store) -> list[str]:
    """Tasks through most transitions: finished ones (returned, purgeable), a recovery,
    a cancel, a pending one."""
    done = [finished(store) for _ in range(3)] + [finished(store, S.FAILED)]
    task_id, _, owner = running(store)
    recover(store, task_id, owner)
    cancelled = submit(store)
    store.request_cancel(cancelled, actor="op", reason="not needed")
    submit(store)
    return [*done, cancelled]


def test_folded_totals_equal_the_audit_counts(store: Store) -> None:
    history(store)
    folds = fold_all(store, limit=4)

    assert len(folds) > 2  # bounded batches, not one pass over the table
    assert all(f.rows <= 4 for f in folds)
    assert folded(store) == audit_counts(store)
    totals = store.transition_totals()
    assert totals.counts == audit_counts(store)
    assert totals.upto == totals.top and totals.lag == 0 and totals.uncounted == 0
    assert sum(f.rows for f in folds) == sum(audit_counts(store).values())
    assert store.fold_transitions(settle=0).rows == 0  # nothing folded twice


def test_a_fold_takes_settled_rows_only_and_a_scrape_still_counts_fresh_ones(
    store: Store,
) -> None:
    history(store)
    fold = store.fold_transitions(settle=3600)

    assert (fold.rows, fold.upto, fold.more) == (0, 0, False)
    assert folded(store) == {}
    assert store.transition_totals().counts == audit_counts(store)  # the tail counts them


def test_a_purge_after_folding_keeps_the_totals(store: Store) -> None:
    done = history(store)
    fold_all(store)
    before = audit_counts(store)
    exporter = TransitionTotals()
    scraped = exporter.read(store)
    aged(store, done, 0.2)

    assert store.purge_expired(0.1, limit=2) == 2  # retention
    assert store.purge(older_than=0, states_=[S.SUCCEEDED, S.FAILED, S.CANCELLED]) == 3
    assert all(store.history(t) == [] for t in done)
    assert audit_counts(store) != before  # the audit rows are gone...
    assert folded(store) == before  # ...their counts are not
    assert exporter.read(store) == scraped
    assert TransitionTotals().read(store) == scraped  # a restarted exporter: the same


def test_a_purge_before_folding_counts_the_deleted_rows_once(store: Store) -> None:
    done = history(store)
    before = audit_counts(store)
    # part of the trail below the watermark, the rest (the finished tasks' tail) above
    assert store.fold_transitions(settle=0, limit=3).rows == 3
    aged(store, done, 0.2)

    assert store.purge_expired(0.1, limit=2) == 2  # retention
    assert store.purge(older_than=0, states_=[S.SUCCEEDED, S.FAILED, S.CANCELLED]) == 3
    assert store.transition_totals().counts == before
    fold_all(store, limit=2)
    assert folded(store) == before


def test_a_discarded_submission_is_still_counted_once(store: Store) -> None:
    task_id = submit(store)
    assert store.transition_totals().counts == {(None, "PENDING"): 1}
    discard_unpublished(store, task_id)
    assert store.get(task_id) is None
    fold_all(store)
    assert store.transition_totals().counts == {(None, "PENDING"): 1}


def test_an_audit_row_written_after_every_row_was_purged_is_counted(store: Store) -> None:
    # SQLite would give the next row the highest id left plus one, below the
    # watermark, were the audit ids not AUTOINCREMENT
    done = [finished(store) for _ in range(2)]
    fold_all(store)
    before = folded(store)
    aged(store, done, 0.2)
    assert store.purge_expired(0.1) == 2
    assert audit_counts(store) == {}

    new_id = submit(store)
    created = before[(None, "PENDING")] + 1
    assert store.transition_totals().counts[(None, "PENDING")] == created
    # a fold with settle 0 takes the rows older than the database's now: wait until its
    # clock has passed the new row's time (SQLite's clock ticks in milliseconds, and a
    # fold in the same millisecond rightly leaves the row for the next one)
    (row,) = store.history(new_id)
    wait_until(lambda: store.now() > row.at, message="the database clock passes the row")
    fold_all(store)
    assert folded(store)[(None, "PENDING")] == created


def test_concurrent_folds_and_purges_count_every_row_once(store: Store) -> None:
    done = [finished(store) for _ in range(30)]
    submit(store)  # a live row: its audit row stays
    expected = audit_counts(store)
    aged(store, done, 0.2)
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def folder() -> None:
        try:
            start.wait()
            while True:
                fold = store.fold_transitions(settle=0, limit=5)
                if not (fold.more or fold.held or fold.rows):
                    return
        except BaseException as exc:
            errors.append(exc)

    def purger() -> None:
        try:
            start.wait()
            while store.purge_expired(0.1, limit=3):
                pass
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=folder) for _ in range(3)]
    threads.append(threading.Thread(target=purger))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    assert not any(thread.is_alive() for thread in threads)
    assert all(store.get(t) is None for t in done)

    fold_all(store)
    assert folded(store) == expected
    assert store.counters()["purged"] == len(done)


@pytest.mark.postgres
@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
@pytest.mark.parametrize("lock", ["FOR UPDATE", "FOR SHARE"])
def test_a_fold_skips_while_another_reaper_holds_the_watermark(store: Store, lock: str) -> None:
    history(store)
    store.fold_transitions(settle=0, limit=1)  # the watermark row exists
    wm = store.t.transition_watermark
    other = store.engine.connect()  # another reaper, mid-fold or mid-purge
    try:
        with other.begin():
            other.execute(select(wm.c.upto).with_for_update(read=lock == "FOR SHARE"))
            fold = store.fold_transitions(settle=0)
            assert fold.held and fold.rows == 0 and not fold.more
    finally:
        other.close()
    assert store.fold_transitions(settle=0).rows > 0


def test_a_large_unfolded_backlog_is_read_as_a_bounded_tail_with_its_lag(
    store: Store,
) -> None:
    for _ in range(30):
        submit(store)
    app = Celery("totals-test", set_as_current=False)

    totals = store.transition_totals(tail=10)
    assert sum(totals.counts.values()) == 10  # ids contiguous here: one row per id
    assert totals.upto == 0 and totals.lag == totals.top >= 30
    assert totals.uncounted == totals.top - 10

    first = scrape(app, store, tail=10)
    assert first["celery_lease_transitions_total", ("none", "PENDING")] == 10
    assert first["celery_lease_transitions_fold_lag", ()] == totals.top
    assert first["celery_lease_transitions_uncounted", ()] == totals.top - 10

    fold_all(store, limit=7)
    second = scrape(app, store, tail=10)
    assert second["celery_lease_transitions_total", ("none", "PENDING")] == 30
    assert second["celery_lease_transitions_fold_lag", ()] == 0
    assert second["celery_lease_transitions_uncounted", ()] == 0


def scrape(app: Any, store: Store, *, tail: int) -> dict[tuple[str, tuple[str, ...]], float]:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(registry(app, store, tail=tail)).decode()
    out: dict[tuple[str, tuple[str, ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sample.labels.values()))] = sample.value
    return out


def test_the_reaper_folds_in_its_sweep_before_retention(
    celery_project: Callable[..., Any],
    make_store: Callable[..., Store],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the app's own store is built from its settings: the tuning reaches it through the
    # environment, as it reaches a worker's
    monkeypatch.setenv(TUNING_ENV, "totals_settle=0,totals_batch_size=3")
    store = make_store(retention=0.1)
    ops = make_ops(celery_project, store)
    try:
        done = [finished(store) for _ in range(2)]
        expected = audit_counts(store)
        aged(store, done, 0.2)

        report = ops.admin.reap()

        assert report.purged == 2
        assert report.folded == sum(expected.values())  # all of it, in batches of 3
        assert audit_counts(store) == {}
        assert folded(store) == expected
    finally:
        close_ops(ops)
