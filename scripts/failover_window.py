#!/usr/bin/env python
"""What an asynchronous replica loses in a failover, and what celery-lease then does.

    python scripts/failover_window.py

Crash matrix row 31 with asynchronous replication (see ``docs/reliability.md``). A
primary and a streaming replica are made on this machine (``tests/crash/replicas.py``;
removed at the end), the replica streaming through a TCP proxy. The store's URL names
both hosts with ``target_session_attrs=read-write``; one worker runs on it (Redis
broker, ``CELERY_LEASE_TEST_REDIS_URL``, flushed). Tasks are brought to known points
(gates), then the replication is cut: from then on the primary acknowledges commits
the replica will never have. In that window, on purpose:

* ``submit``: a task is submitted (acknowledged) and claimed, its body held;
* ``claim``: a task submitted and replicated before the cut is claimed, its body held;
* ``step``: a task claimed before the cut records a non-idempotent step, then is held;
* ``step+kill``: the same, and after the failover its pool process is SIGKILLed;
* ``outcome``: a task claimed before the cut ends SUCCEEDED.

Then the primary is SIGKILLed and the replica promoted; every gate is opened (and the
``step+kill`` child killed). The script waits until no task row changes any more
(every row final or parked, or ``--settle`` seconds), then prints per case what the
new primary holds, how many times the body started and its effect happened (the
counting stub), the audit trail, and what ``lease check`` (the invariant checker,
liveness included) reports. Exit status 0: the run completed (what it found is the
measurement, not a verdict).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from celery_lease import State
from celery_lease.check import check
from tests.crash.replicas import ReplicatedPostgres, missing
from tests.crash.standalone import Standalone
from tests.crash.support import transitions
from tests.helpers import wait_step, wait_until

SOURCE = '''
import os
import time

from celery_lease import LeasedTask
from tests.helpers import ExternalSystem

external = ExternalSystem.from_env()
GATES = os.environ["LEASE_TEST_GATES"]


def hold(gate):
    if gate:
        path = os.path.join(GATES, gate)
        while os.path.exists(path):
            time.sleep(0.02)


@app.task(base=LeasedTask, bind=True, shared=False, name="t.window")
def window(self, key, before=None, after=None):
    """Start (counted), gate, a non-idempotent step (its effect counted), gate."""
    external.call(f"start:{key}", payload=self.request.hostname)
    hold(before)
    self.step("effect", external.call, f"effect:{key}")
    hold(after)
    return key
'''

FINAL = {State.SUCCEEDED, State.FAILED, State.CANCELLED, State.WAIT_MANUAL}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settle", type=float, default=20.0, help="seconds to wait at most")
    parser.add_argument(
        "--ttl", type=float, default=30.0, help="lease_ttl (30: longer than the window)"
    )
    parser.add_argument(
        "--max-runtime", type=float, default=None, help="lease_max_runtime (default: none)"
    )
    args = parser.parse_args()
    reason = missing()
    if reason is not None:
        print(f"cannot run: {reason}")
        return 2
    with ReplicatedPostgres(synchronous=False, proxied=True) as pair:
        admin = f"postgresql://postgres@127.0.0.1:{pair.primary.port}/postgres"
        with Standalone(pg_admin_url=admin) as env:
            return run(pair, env, args.settle, args.ttl, args.max_runtime)


def run(
    pair: ReplicatedPostgres, env: Standalone, settle: float, ttl: float, max_runtime: float | None
) -> int:
    p = env.leased_project(
        SOURCE,
        database_url=pair.url(),
        ttl=ttl,
        max_runtime=max_runtime,
        heartbeat_interval=0.5,
        reaper_interval=0.5,
        publish_grace=1.0,
        republish_after=2.0,
    )
    gates = p.gates
    for name in ("step.a", "step.b", "kill.a", "kill.b", "outcome.a", "claim.a", "submit.a"):
        gates.hold(name)
    worker = p.worker("w1", concurrency=4)
    ids: dict[str, str] = {}
    # -- before the cut: replicated -------------------------------------------------------
    ids["step"] = p.submit("t.window", "step", "step.a", "step.b")
    ids["step+kill"] = p.submit("t.window", "kill", "kill.a", "kill.b")
    ids["outcome"] = p.submit("t.window", "outcome", "outcome.a")
    ids["claim"] = p.submit("t.window", "claim", "claim.a", queue="late")
    for key in ("step", "kill", "outcome"):
        p.wait_count(f"start:{key}", 1)
    p.wait_state(ids["claim"], State.PENDING)
    lsn = pair.primary.sql("SELECT pg_current_wal_lsn()::text")[0][0]
    wait_until(
        lambda: (
            pair.replica.sql(f"SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn") == [(True,)]
        ),
        timeout=30,
        interval=0.05,
        message="the replica caught up",
    )
    # -- the lost window ------------------------------------------------------------------
    pair.cut_replication()
    window = time.monotonic()
    gates.release("step.a")
    gates.release("kill.a")
    wait_step(p.store, ids["step"], "effect")
    wait_step(p.store, ids["step+kill"], "effect")
    gates.release("outcome.a")
    p.wait_state(ids["outcome"], State.SUCCEEDED)
    claimer = p.project.worker("w2", concurrency=1, extra_args=["-Q", "late"])
    p.workers.append(claimer)
    claimer.wait_ready(timeout=60, store=p.store)
    p.wait_count("start:claim", 1)
    ids["submit"] = p.submit("t.window", "submit", "submit.a")
    p.wait_count("start:submit", 1)
    lost = {case: p.get(task_id).state.value for case, task_id in ids.items()}
    print("acknowledged by the primary in the lost window:", lost, flush=True)
    # -- failover -------------------------------------------------------------------------
    killed = time.monotonic()
    print(f"MEASURED the lost window (replication cut -> primary killed): {killed - window:.2f} s")
    pair.primary.kill()
    pair.promote()
    print(f"MEASURED primary SIGKILLed -> replica promoted: {time.monotonic() - killed:.2f} s")
    seen = {case: p.store.get(task_id) for case, task_id in ids.items()}
    print(
        "on the new primary:",
        {c: (r.state.value, r.attempt) if r else None for c, r in seen.items()},
        flush=True,
    )
    # the step+kill child: the pool process that started it
    (start,) = p.external.effects("start:kill")
    for name in ("step.b", "outcome.a", "claim.a", "submit.a"):
        gates.release(name)
    os.kill(start.pid, 9)
    gates.release("kill.b")

    def settled() -> bool:
        rows = [p.store.get(t) for t in ids.values()]
        return all(r is None or r.state in FINAL for r in rows)

    began = time.monotonic()
    with contextlib.suppress(AssertionError):
        wait_until(settled, timeout=settle, interval=0.2, message="every row final")
    waited = time.monotonic() - began
    print(f"after the failover, waited {waited:.1f} s (at most {settle:g}) for final states\n")
    key_of = {"step": "step", "step+kill": "kill", "outcome": "outcome", "claim": "claim",
              "submit": "submit"}  # fmt: skip
    print(f"{'case':<10} {'row on the new primary':<34} {'starts':>6} {'effects':>7}  trail")
    for case, task_id in ids.items():
        rec = p.store.get(task_id)
        key = key_of[case]
        row = "missing" if rec is None else f"{rec.state.value} attempt {rec.attempt}"
        if rec is not None and rec.recoveries:
            row += f" rec. {rec.recoveries}"
        trail = " ".join(f"{b}" for _, b in transitions(p.store.history(task_id))) or "-"
        print(
            f"{case:<10} {row:<34} {p.external.count(f'start:{key}'):>6} "
            f"{p.external.count(f'effect:{key}'):>7}  {trail}"
        )
    print("\nlease check (safety and liveness):")
    for violation in check(p.store, liveness=True):
        print(f"  {violation}")
    for w in (worker, claimer):
        log = w.log_text()
        for needle in ("lease lost", "registers again", "not found", "unknown task", "no row"):
            if needle in log:
                print(f"  {w.nodename} log mentions {needle!r}: {log.count(needle)} times")
    return 0


if __name__ == "__main__":
    sys.exit(main())
