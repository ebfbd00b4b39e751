"""Beat failover: beats SIGKILLed and started again at random, each slot run once.

Three ``celery beat`` processes (``LeaseScheduler``, PostgreSQL store, Redis broker)
share one entry of a leased task every second, with a worker (prefork 2) running it.
For the length of the run (``--minutes``, default 10) one beat, chosen at random, is
SIGKILLed (its whole process group) or, if it is down, started again, every 1 to 4
seconds (random). The task counts its own runs in Redis (slot -> runs), so the figures
come from what ran, not from what was sent:

- slots run twice (target 0);
- slots missed while at least one beat was up (target 0): a slot is *covered* when a
  beat was up from the slot to 1 s after it, "up" meaning from 2 s after its
  ``beat: Starting...`` line to its kill;
- for context: the slots when no beat was up, how many of them the catch-up policy
  (``lease_catchup="latest"``, the default) ran when a beat came back, and the entry's
  ``missed`` counter in the store.

    python benchmarks/bench_beat_failover.py [--minutes M | --seconds S] [--beats N]
        [--seed N]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import signal
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

from _common import (
    PG_URL,
    REDIS_URL,
    Context,
    Project,
    delete_queue,
    describe_machine_text,
    lease_config,
    make_context,
    new_queue,
    pg_schema,
    redis_client,
    table,
)

from celery_lease.beat import slot_key
from celery_lease.testing import wait_until
from celery_lease.testing._procs import BeatProcess

ENTRY = "every-second"
TASK = "bench.slot"
#: A beat counts as up this long after its start line (its scheduler set up, its first
#: tick done) ...
WARM_UP = 2.0
#: ... and covers a slot when it stayed up this long after the slot (time to decide it).
DECIDE = 1.0

SOURCE = '''
import redis as _redis

from celery_lease import LeasedTask
from celery_lease._runtime import runtime

_counts = _redis.Redis.from_url(os.environ["BENCH_COUNT_URL"])
_KEY = os.environ["BENCH_COUNT_KEY"]


@app.task(base=LeasedTask, bind=True, name="bench.slot", shared=False)
def slot(self):
    """One run of a slot: counted under the slot's dedup key, by the task itself."""
    record = runtime(app).store.get(self.request.id)
    _counts.hincrby(_KEY, record.dedup_key, 1)


app.conf.beat_schedule = {"every-second": {"task": "bench.slot", "schedule": 1.0}}
'''


@dataclasses.dataclass
class Beat:
    """One beat process and the times (this host's clock) it was up."""

    proc: BeatProcess
    started_at: float | None = None
    ready_at: float | None = None
    up: list[tuple[float, float]] = dataclasses.field(default_factory=list)

    def start(self) -> None:
        self.proc.start()
        self.started_at, self.ready_at = time.time(), None

    def poll(self) -> None:
        """Note the start line once it is logged."""
        if (
            self.ready_at is None
            and self.proc.is_alive()
            and BeatProcess.READY.search(self.proc.log_text(since_start=True))
        ):
            self.ready_at = time.time()

    def kill(self) -> None:
        self.poll()
        self.proc.signal_group(signal.SIGKILL)
        if self.proc.proc is not None:
            self.proc.proc.wait(10)
        if self.ready_at is not None:
            self.up.append((self.ready_at, time.time()))
        self.started_at = self.ready_at = None

    def close(self, at: float) -> None:
        self.poll()
        if self.proc.is_alive() and self.ready_at is not None:
            self.up.append((self.ready_at, at))
        self.proc.stop(timeout=10)


@dataclasses.dataclass
class Figures:
    seconds: float
    beats: int
    kills: int
    starts: int
    slots: int
    ran_once: int
    ran_twice: int
    covered: int
    missed_covered: int
    uncovered: int
    uncovered_ran: int
    written_not_run: int
    store_missed: int
    no_beat_seconds: float


def covered(slot: float, beats: list[Beat]) -> bool:
    return any(a + WARM_UP <= slot and slot + DECIDE <= b for beat in beats for a, b in beat.up)


def no_beat_seconds(beats: list[Beat], t0: float, t1: float) -> float:
    """Seconds of ``[t0, t1]`` with no beat up (by the same rule as :func:`covered`)."""
    spans = sorted((a + WARM_UP, b) for beat in beats for a, b in beat.up if b > a + WARM_UP)
    up, cursor = 0.0, t0
    for a, b in spans:
        a, b = max(a, cursor), min(b, t1)
        if b > a:
            up += b - a
            cursor = b
    return (t1 - t0) - up


def run(ctx: Context, seconds: float, n_beats: int, seed: int) -> Figures:
    rng = random.Random(seed)
    queue = new_queue("beatfo")
    count_key = f"bench:beatfo:{uuid.uuid4().hex[:8]}"
    counts = redis_client()
    with pg_schema("beatfo") as schema:
        config = lease_config(PG_URL, schema)
        from celery_lease.store import Store

        store = Store(config)
        store.migrate()
        project = Project.write(
            ctx,
            broker_url=REDIS_URL,
            settings={
                "lease_database_url": PG_URL,
                "lease_schema": schema,
                "task_default_queue": queue,
                "beat_scheduler": "celery_lease.beat:LeaseScheduler",
            },
            source=SOURCE,
            env={"BENCH_COUNT_URL": REDIS_URL, "BENCH_COUNT_KEY": count_key},
        )
        worker = project.worker(queue, pool="prefork", concurrency=2, loglevel="INFO")
        beats = [
            Beat(
                BeatProcess(
                    project.module,
                    cwd=project.directory,
                    env=project.process_env(),
                    log_path=project.directory / f"beat{i}.log",
                    nodename=f"beat{i}",
                )
            )
            for i in range(n_beats)
        ]
        kills = starts = 0
        try:
            worker.start()
            worker.wait_ready_line(timeout=60)
            for beat in beats:
                beat.start()
            for beat in beats:
                beat.proc.wait_ready_line(timeout=60)
                beat.poll()
            t0 = time.time()
            t1 = t0 + seconds
            ctx.log(f"beat failover: {n_beats} beats, {seconds:g} s, seed {seed}")
            next_action = t0 + rng.uniform(1, 4)
            last_log = t0
            while time.time() < t1:
                for beat in beats:
                    beat.poll()
                now = time.time()
                if now >= next_action:
                    beat = rng.choice(beats)
                    if beat.proc.is_alive():
                        beat.kill()
                        kills += 1
                    else:
                        beat.start()
                        starts += 1
                    next_action = now + rng.uniform(1, 4)
                if now - last_log >= 60:
                    up = sum(b.proc.is_alive() for b in beats)
                    ctx.log(f"{now - t0:.0f} s: {kills} kills, {starts} starts, {up} up")
                    last_log = now
                time.sleep(0.1)
            t_end = time.time()
            for beat in beats:
                beat.close(t_end)

            # every slot written has run (the reaper publishes the rows of beats killed
            # between a slot's commit and its publish)
            def settled() -> bool:
                rows = store.list_tasks(name=TASK, limit=1_000_000)
                return all(r.state.value == "SUCCEEDED" for r in rows)

            wait_until(settled, timeout=120, message="every slot's task finished")
            worker.stop()
        finally:
            for beat in beats:
                beat.proc.terminate_now()
            worker.terminate_now()
            delete_queue(REDIS_URL, queue)

        runs = {k.decode(): int(v) for k, v in counts.hgetall(count_key).items()}
        counts.delete(count_key)
        written = {r.dedup_key for r in store.list_tasks(name=TASK, limit=1_000_000)}
        (row,) = [r for r in store.schedules() if r.name == ENTRY]
        store.dispose()

    # the slots of the run: every whole second from the first one covered by the first
    # beats to the end
    first, last = math.ceil(t0 + WARM_UP), math.floor(t_end) - 1
    slots = range(first, last + 1)
    f = Figures(
        seconds=t_end - t0,
        beats=n_beats,
        kills=kills,
        starts=starts,
        slots=len(slots),
        ran_once=0,
        ran_twice=0,
        covered=0,
        missed_covered=0,
        uncovered=0,
        uncovered_ran=0,
        written_not_run=0,
        store_missed=row.missed,
        no_beat_seconds=no_beat_seconds(beats, first, last),
    )
    for s in slots:
        key = slot_key(ENTRY, datetime.fromtimestamp(s, timezone.utc))
        n = runs.get(key, 0)
        f.ran_once += n == 1
        f.ran_twice += n > 1
        f.written_not_run += n == 0 and key in written
        if covered(s, beats):
            f.covered += 1
            f.missed_covered += n == 0
        else:
            f.uncovered += 1
            f.uncovered_ran += n > 0
    # a slot run twice anywhere (outside the window too) counts
    f.ran_twice = max(f.ran_twice, sum(1 for n in runs.values() if n > 1))
    return f


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the run")
    parser.add_argument("--seconds", type=float, default=None, help="length, in seconds")
    parser.add_argument("--beats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=20261203)
    args = parser.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else args.minutes * 60
    ctx = make_context(seconds < 120, Path(tempfile.mkdtemp(prefix="bench-beatfo-")), plots=False)
    print(describe_machine_text(), flush=True)
    started = datetime.now(timezone.utc)
    f = run(ctx, seconds, args.beats, args.seed)
    print(
        f"\nbeat failover: {f.beats} beats, an entry every second, {f.seconds / 60:.1f} min "
        f"from {started:%Y-%m-%d %H:%M} UTC, seed {args.seed}; a beat SIGKILLed or started "
        f"again every 1-4 s at random ({f.kills} kills, {f.starts} starts); "
        f"{f.no_beat_seconds:.0f} s with no beat up\n",
        flush=True,
    )
    headers = [
        "slots",
        "ran once",
        "ran twice",
        "covered by a beat",
        "missed while a beat was up",
        "while no beat was up",
        "of which ran (catch-up)",
        "written, never run",
        "entry's missed counter",
    ]
    rows = [
        (
            f.slots,
            f.ran_once,
            f.ran_twice,
            f.covered,
            f.missed_covered,
            f.uncovered,
            f.uncovered_ran,
            f.written_not_run,
            f.store_missed,
        )
    ]
    print("\n".join(table(headers, rows)), flush=True)
    print(
        f"\ntargets: ran twice {f.ran_twice} (target 0), missed while a beat was up "
        f"{f.missed_covered} (target 0)",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
