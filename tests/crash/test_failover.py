"""Crash matrix row 31: the PostgreSQL primary is lost and its replica promoted.

The store runs on a pair of clusters made for the test (:mod:`tests.crash.replicas`):
a primary and a streaming replica on this machine, on ports of their own, removed
afterwards. ``lease_database_url`` names both hosts in libpq's multi-host form with
``target_session_attrs=read-write``, so every connection goes to whichever of them
accepts writes: the primary, then, once it is promoted, the former replica. Nothing
in celery-lease is told of the failover.

* Synchronous replication (the replica named in ``synchronous_standby_names``,
  ``synchronous_commit`` on): two workers run tasks while a producer submits about 30
  a second and one task holds its lease at a gate; the primary's processes are all
  SIGKILLed at once and, once every caller has seen the outage
  past the store's own retries (each worker logged a failed heartbeat, the producer
  had a submission refused), the replica is promoted (``pg_ctl promote``, what a
  failover manager does). Every submission the producer saw acknowledged ends
  SUCCEEDED, each ran once (one attempt reached the body, one effect), with the audit
  trail of a run without a fault; the task at the gate keeps its lease and its step and
  outcome land on the new primary; each worker renews its heartbeat and runs tasks
  again, the producer submits again, all without a restart or an operator command.
  How long each took after the kill is printed (MEASURED), never asserted.

What asynchronous replication can lose, and what celery-lease does then, is measured by
``scripts/failover_window.py`` (its figures are on ``docs/reliability.md``, row 31).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_lease import State
from celery_lease.check import check

from ..helpers import WorkerProcess, wait_until
from .faults import subprocess_env
from .replicas import ReplicatedPostgres, missing
from .support import CLEAN_RUN, GIVEN_BACK, LeasedProject, LeaseEnv, pg_only, released, report
from .test_matrix_faults import db_now, wait_heartbeat

#: No lease may expire: the failover (a second or two) is far shorter. Nothing waits
#: for it.
LONG_TTL = 10.0
#: Submissions acknowledged, and tasks done, before the primary is killed.
BEFORE = 30
#: Submissions acknowledged after the promotion before the producer is stopped.
AFTER = 30
#: What a worker logs when its heartbeat could not be written.
HEARTBEAT_FAILED = "heartbeat failed"


# -- the store on the replicated pair ------------------------------------------------------


@pytest.fixture
def pair(harness: Any) -> ReplicatedPostgres:
    """A synchronous primary/replica pair, removed after every process the test started
    is gone (a harness finalizer: the harness stops workers first)."""
    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    made = ReplicatedPostgres(synchronous=True)
    harness.finalizers.append(made.remove)
    return made.create()


@pytest.fixture
def store_url(pair: ReplicatedPostgres) -> str:
    """This module's store: both hosts of the pair (overrides ``tests/conftest.py``)."""
    return pair.url()


@pytest.fixture
def store_schema() -> str:
    """A schema of the test's own on the pair (removed with the pair)."""
    return f"t_{uuid.uuid4().hex[:12]}"


# -- the producer ----------------------------------------------------------------------------


class Producer:
    """``tests.crash.producer`` in a process of its own, submitting ``t.work``."""

    def __init__(self, p: LeasedProject, directory: Path) -> None:
        self.out = directory / "produced.jsonl"
        self.stop_file = directory / "produced.stop"
        self.log = directory / "producer.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.crash.producer", p.project.module, "t.work",
                 str(self.out), str(self.stop_file)],
                cwd=p.project.directory,
                env=subprocess_env(p.project),
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip

    def lines(self) -> list[dict[str, Any]]:
        """Every line written so far (a line being written is left out)."""
        try:
            text = self.out.read_text()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]

    def acked(self) -> list[dict[str, Any]]:
        """Every submission acknowledged so far."""
        return [line for line in self.lines() if "id" in line]

    def refused_since(self, since: float) -> bool:
        """Whether a try was refused after ``since`` (``time.time()``)."""
        return any(line["at"] > since for line in self.lines() if "refused" in line)

    def wait_acked(self, count: int, timeout: float = 60.0) -> list[dict[str, Any]]:
        def enough() -> list[dict[str, Any]] | None:
            assert self.proc.poll() is None, f"the producer exited: {self.log.read_text()}"
            acked = self.acked()
            return acked if len(acked) >= count else None

        found: list[dict[str, Any]] = wait_until(
            enough, timeout=timeout, message=f"{count} submissions acknowledged"
        )
        return found

    def stop(self) -> list[dict[str, Any]]:
        self.stop_file.touch()
        assert self.proc.wait(60) == 0, self.log.read_text()
        return self.acked()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture
def producer_of(harness: Any, tmp_path: Path) -> Iterator[Any]:
    made: list[Producer] = []

    def start(p: LeasedProject) -> Producer:
        producer = Producer(p, tmp_path)
        made.append(producer)
        harness.finalizers.append(producer.kill)
        return producer

    yield start


# -- the test --------------------------------------------------------------------------------


def _done_after(p: LeasedProject, since: float) -> dict[str, float]:
    """Node -> when it first completed a task body after ``since`` (``time.time()``)."""
    first: dict[str, float] = {}
    for effect in p.external.effects():
        if effect.name.startswith("done:") and effect.at > since and effect.payload:
            first.setdefault(effect.payload, effect.at)
    return first


@pytest.mark.skipif(missing() is not None, reason=str(missing()))
@pg_only()
def test_row31_primary_killed_replica_promoted_synchronous(
    lease_env: LeaseEnv, pair: ReplicatedPostgres, producer_of: Any
) -> None:
    p = lease_env.project(ttl=LONG_TTL)
    workers: list[WorkerProcess] = [p.worker("w1", concurrency=2), p.worker("w2", concurrency=2)]
    incarnations = [p.incarnation(w) for w in workers]
    gate = p.gates.hold("gate")
    with released(p.gates, gate):
        held = p.submit("t.stepped", "held", gate)
        p.wait_count("start:held", 1)
        producer = producer_of(p)
        producer.wait_acked(BEFORE)
        wait_until(
            lambda: sum(1 for e in p.external.effects() if e.name.startswith("done:p")) >= BEFORE,
            timeout=60,
            message=f"{BEFORE} tasks done before the failover",
        )

        failed_beats = [w.log_text().count(HEARTBEAT_FAILED) for w in workers]
        killed_at = time.time()
        pair.primary.kill()
        # a failover manager takes seconds to promote: promote once the outage has been
        # seen by every caller, past the store's own retries (a failed heartbeat in each
        # worker, a refused submission in the producer)
        for worker, before in zip(workers, failed_beats, strict=True):
            wait_until(
                lambda w=worker, n=before: w.log_text().count(HEARTBEAT_FAILED) > n,
                timeout=60,
                message=f"{worker.nodename} logged a failed heartbeat",
            )
        wait_until(
            lambda: producer.refused_since(killed_at),
            timeout=60,
            message="the producer had a submission refused",
        )
        report("row 31: kill -> the outage seen by every caller", time.time() - killed_at)
        pair.promote()
        promoted_at = time.time()
        report("row 31: kill -> replica promoted", promoted_at - killed_at)
        since = db_now(p)
        report("row 31: promotion -> the new primary answers the test", time.time() - promoted_at)
        for worker, inc in zip(workers, incarnations, strict=True):
            wait_heartbeat(p, inc, since)
            renewed = time.time() - promoted_at
            report(f"row 31: promotion -> {worker.nodename} renewed its heartbeat", renewed)
        before = sum(1 for a in producer.acked() if a["acked"] <= promoted_at)
        acked = producer.wait_acked(before + AFTER)
        first = min(a["acked"] for a in acked if a["acked"] > promoted_at)
        report(
            "row 31: promotion -> the producer's first acknowledged submission", first - promoted_at
        )
        nodes = {w.nodename for w in workers}
        ran = wait_until(
            lambda: (found := _done_after(p, promoted_at)).keys() >= nodes and found,
            timeout=60,
            message="each worker completed a task after the promotion",
        )
        for node, at in sorted(ran.items()):
            report(f"row 31: promotion -> {node} completed a task", at - promoted_at)
    acked = producer.stop()

    # the task that held its lease across the failover: step and outcome on the new primary
    rec = p.wait_state(held, State.SUCCEEDED, timeout=60)
    assert rec.attempt == 1 and rec.recoveries == 0, rec
    assert p.trail(held) == CLEAN_RUN
    assert p.external.count("start:held") == 1 and p.external.count("done:held") == 1

    # every acknowledged submission ran once, as without the failover
    retried = [a for a in acked if a["failed"]]
    for a in acked:
        rec = p.wait_state(a["id"], State.SUCCEEDED, timeout=60)
        trail = p.trail(a["id"])
        assert trail in (CLEAN_RUN, GIVEN_BACK), (a, trail)
        assert rec.recoveries == 0, rec
        assert rec.result is not None and rec.result["key"] == a["key"]
        assert p.external.count(f"start:{a['key']}") == 1, a
        assert p.external.calls(f"done:{a['key']}") == 1, a
    print(
        f"MEASURED row 31: {len(acked)} submissions acknowledged, {len(retried)} of them "
        f"retried by the producer ({sum(len(a['failed']) for a in retried)} refused tries: "
        f"{sorted({n for a in retried for n in a['failed']})}), "
        f"{sum(1 for a in acked if p.trail(a['id']) == GIVEN_BACK)} claims given back"
    )
    # the same processes, the same incarnations: no restart, no operator step
    for worker, inc in zip(workers, incarnations, strict=True):
        assert worker.is_alive() and p.incarnation(worker) == inc
        assert "treating its leases as lost" not in worker.log_text()
    assert check(p.store, liveness=False) == []
