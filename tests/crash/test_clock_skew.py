"""Crash-point matrix row 19: a worker whose clock is minutes off behaves the same.

One worker runs with its wall clock 300 s ahead (``clock_skew.c``, an LD_PRELOAD shim
built here with gcc: libfaketime hangs Python 3.11's timed waits, see the shim). Every
lease decision uses the database's clock, so: its heartbeats keep its leases alive (and
no longer), its embedded reaper expires nobody early, its retries are re-published after
their countdown, and when it dies another worker expires its lease after the TTL.

PostgreSQL only: on SQLite "database time" is the clock of whichever process runs the
statement, so a skewed process writes skewed timestamps (processes on one host share one
clock, which is why the embedded default is safe in practice).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest
from sqlalchemy import select

from celery_lease import State

from ..helpers import wait_until
from .support import CLEAN_RUN, LeasedProject, LeaseEnv, Stopwatch, released, report

SKEW = 300
SHIM_SOURCE = Path(__file__).with_name("clock_skew.c")


@pytest.fixture(scope="session")
def clock_skew_shim(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Path of the compiled LD_PRELOAD shim that skews CLOCK_REALTIME."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler to build the clock-skew shim (apt-get install gcc)")
    target = tmp_path_factory.mktemp("clock-skew") / "libclockskew.so"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", "-o", str(target), str(SHIM_SOURCE), "-ldl"],
        check=True,
        capture_output=True,
    )
    return str(target)


def reaper_holder(p: LeasedProject) -> str | None:
    locks = p.store.t.locks
    with p.store.engine.connect() as conn:
        return conn.execute(select(locks.c.holder).where(locks.c.name == p.reaper_lock)).scalar()


def heartbeat_of(p: LeasedProject, incarnation: str) -> float:
    (row,) = [w for w in p.store.workers() if w.id == incarnation]
    return row.heartbeat_at.timestamp()


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [pytest.param("redis", "postgresql", id="redis-postgresql", marks=pytest.mark.postgres)],
    indirect=True,
)
def test_worker_with_a_skewed_clock_behaves_the_same(
    lease_env: LeaseEnv, broker_url: str, clock_skew_shim: str
) -> None:
    # acks_late: a busy worker holds no second message, so each task lands where we say
    p = lease_env.project(broker_url=broker_url, settings={"task_acks_late": True})
    skewed_env = {"LD_PRELOAD": clock_skew_shim, "CLOCK_SKEW_SECONDS": str(SKEW)}
    skewed = p.worker("skewed", env=skewed_env)  # started first: holds the reaper lock
    skewed_id = p.incarnation(skewed)
    wait_until(lambda: reaper_holder(p) == skewed_id, message="the skewed worker reaps")
    ext = lease_env.external

    # the worker really lives 300 s ahead (its own log says so)
    db_now = p.store.now().timestamp()
    logged = skewed.wait_log(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+: INFO/MainProcess\] skewed")
    local = datetime.strptime(logged.group(1), "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc)
    assert local.timestamp() - db_now > SKEW - 60, (logged.group(0), db_now)

    # 1. retries on the skewed worker are published by that worker at once, and run
    #    after the countdown in database time: the claim checks the row's ETA, which is
    #    database time (a worker-clock ETA would be 300 s off)
    retried = p.submit("t.retry_then_ok", 2)  # self.retry(countdown=0.3) twice
    rec = p.wait_state(retried, State.SUCCEEDED, timeout=30)
    trail = p.store.history(retried)
    assert rec.attempt == 3 and all(r.actor.endswith("skewed@lease-test") for r in trail[1:])
    waits = [i for i, r in enumerate(trail) if r.to_state is State.RETRY_WAIT]
    assert len(waits) == 2
    for i in waits:
        began, due, claim = trail[i - 1], trail[i + 1], trail[i + 2]
        assert (began.from_state, began.to_state) == (State.PENDING, State.RUNNING), began
        assert (due.from_state, due.to_state) == (State.RETRY_WAIT, State.PENDING), due
        assert (claim.from_state, claim.to_state) == (State.PENDING, State.RUNNING), claim
        # the attempt called retry() after its claim: its retry runs no sooner than the
        # countdown after that claim, in database time
        assert (claim.at - began.at).total_seconds() >= 0.3 - 0.01, (began, claim)

    # 2. live leases on both workers, swept by the skewed reaper for 3 TTLs: none expires
    gate = p.gates.hold("gate")
    with released(p.gates, gate):
        # "s" is taken by the skewed worker before the normal one starts (two idle
        # workers take a message in whichever order the broker serves them)
        on_skewed = p.submit("t.work", "s", gate)
        p.wait_count("start:s", 1)
        normal = p.worker("normal")
        normal_id = p.incarnation(normal)
        on_normal = p.submit("t.work", "n", gate)
        p.wait_count("start:n", 1)
        assert [e.payload for e in ext.effects("start:s")] == [skewed.nodename]
        assert [e.payload for e in ext.effects("start:n")] == [normal.nodename]
        since = heartbeat_of(p, normal_id)
        wait_until(lambda: heartbeat_of(p, normal_id) - since > 3.0, timeout=30)
        assert reaper_holder(p) == skewed_id
        for task_id in (on_skewed, on_normal):
            rec = p.get(task_id)
            assert rec.state is State.RUNNING and rec.attempt == 1 and rec.recoveries == 0
        # the skewed worker's heartbeat is database time too: not 300 s in the future
        assert heartbeat_of(p, skewed_id) - p.store.now().timestamp() < 5.0

        # 3. the skewed worker dies: the normal worker expires its lease after the TTL
        skewed.kill_group(signal.SIGKILL)
        clock = Stopwatch()
        skewed.wait_group_gone()
        p.gates.release(gate)
        rec = p.wait_state(on_normal, State.SUCCEEDED)
        assert p.trail(on_normal) == CLEAN_RUN
        p.wait_count("start:s", 2, timeout=30)
        report("lost skewed node (TTL 1 s) -> re-run started", clock.lap())
    rec = p.wait_state(on_skewed, State.SUCCEEDED)
    assert rec.owner == normal_id and rec.attempt == 2
    expiry = next(r for r in p.store.history(on_skewed) if r.to_state is State.TIMEOUT)
    assert expiry.actor == "reaper:normal@lease-test"
    (dead,) = [w for w in p.store.workers() if w.id == skewed_id]
    gap = (expiry.at - dead.heartbeat_at).total_seconds()
    # not before the TTL, and with no trace of the 300 s skew
    assert 1.0 <= gap < SKEW / 2, f"expired {gap:.1f} s after the last heartbeat"
    assert ext.count("done:s") == 1 and ext.count("done:n") == 1
