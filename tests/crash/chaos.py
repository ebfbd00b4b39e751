"""The seeded chaos soak, shared by ``tests/crash/test_soak.py`` (short, in CI) and
``scripts/soak.py`` (long, with a summary table).

N real ``celery worker`` processes (prefork and threads pools mixed) on a PostgreSQL
store (or one SQLite file: ``Options.store``) and a Redis broker (or RabbitMQ on a
vhost of the run's own, with a Redis result backend: ``Options.broker``) run a mixed
workload (:data:`SOURCE`: idempotent steps, a
non-idempotent step, retries, tasks failing by their own logic, long tasks with a
progress cursor, cancellations, dedup submissions raced by several producer processes,
and heads with follow-ups: a retrying head followed by a chain of two steps, ``link=``
callbacks and chords of three heads with their callback; chords only when Redis is not
really restarted, since the result backend's chord counters live in it) while a
schedule drawn from one seed injects faults:

- ``kill_child``: SIGKILL of the prefork pool child running a task (an idle child when
  no prefork worker runs one);
- ``kill_worker``: SIGKILL of a whole worker (process group), restarted after a while
  under the same node name;
- ``freeze``: SIGSTOP of a whole worker, SIGCONT after a while (shorter or longer
  than the TTL);
- ``redis`` (Redis broker): the broker loses its queued messages: a real
  ``SHUTDOWN NOSAVE`` and restart when this run may restart services
  (``restart_redis``), else the project's queues and unacked messages are deleted from
  its own Redis database (its exchange bindings are kept: clients that never saw a
  reconnect would not declare them again);
- ``rabbitmq_purge`` (RabbitMQ broker): the broker loses its queued messages: every
  queue of the run's vhost holding ready messages is purged (messages delivered and not
  acknowledged yet are not queued: a purge keeps them);
- ``rabbitmq_disconnect`` (RabbitMQ broker): the broker closes every client connection
  of the run's vhost (``rabbitmqctl close_all_connections``): workers, the driver and
  the producers reconnect, the workers' unacknowledged deliveries go back to the queue.
  The shared RabbitMQ node itself is never restarted;
- ``pg_terminate`` (PostgreSQL store): every connection to the store's database is
  killed. A SQLite store (``Options.store``: one file shared by every process on the
  host, the embedded default) has no server whose connections a fault could kill: its
  runs draw every other fault.

When the schedule ends, frozen workers are resumed, dead ones restarted, and the
system is left alone. :meth:`Soak.run` then waits (bounded) until every task is
SUCCEEDED, FAILED, CANCELLED or WAIT_MANUAL, and :func:`verify` checks the claim:
nothing lost, nothing RUNNING, each final state allowed for its kind of task, no
idempotent effect performed twice, no non-idempotent call repeated, no follow-up lost
(its predecessors SUCCEEDED, it never ran) or repeated (ran twice, or without its
predecessors), every audit trail legal, and
``celery_lease.check.check(store, liveness=False) == []``.

The schedule and the workload are drawn from ``random.Random(seed)`` before anything
runs; which task a fault hits depends on timing, so a seed reproduces the schedule, not
every interleaving. Every failure message names the seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import multiprocessing
import os
import random
import signal
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from celery import chain, chord

from celery_lease import State, TaskRecord, admin
from celery_lease.exceptions import IllegalTransition, StoreError

from ..helpers import WorkerProcess
from .chaos_checks import (
    SEED_ENV,
    SETTLED,
    Fault,
    FollowUp,
    Report,
    fault_kinds,
    keep_evidence,
    unsettled_followups,
    verify,
)
from .faults import (
    pg_terminate,
    rabbitmq_close_connections,
    rabbitmq_purge_queues,
    redis_restart_losing_data,
)
from .support import LeasedProject

__all__ = ["DEFAULT_SEED", "SEED_ENV", "SOURCE", "TIMINGS", "Options", "Soak", "seed_from_env"]

#: The seed when ``CELERY_LEASE_SOAK_SEED`` is not set (CI's).
DEFAULT_SEED = 20261129

#: Lease timings of the soak's store and workers (LeaseConfig fields).
TIMINGS: dict[str, Any] = {
    "ttl": 2.0,
    "heartbeat_interval": 0.25,
    "reaper_interval": 0.25,
    "publish_grace": 0.5,
    "republish_after": 2.0,
    # a countdown longer than this is held in the store until due (the "held" kind)
    "hold_eta_after": 1.0,
}

#: kind -> relative weight in the schedule (after each kind of the run's broker once)
_FAULT_WEIGHTS: dict[str, int] = {
    "kill_child": 4,
    "kill_worker": 2,
    "freeze": 2,
    "redis": 1,
    "rabbitmq_purge": 1,
    "rabbitmq_disconnect": 1,
    "pg_terminate": 2,
}


#: The generated project's tasks (after the harness's ``app = Celery(...)`` preamble).
SOURCE = '''
import os
import time

from celery_lease import LeasedTask, admin
from tests.helpers import ExternalSystem

# chords need a result backend: Redis, the broker's database when the broker is Redis
# (its result keys survive the soak's "queues dropped" fault, as a separate backend
# would), else the one the project's settings name (RabbitMQ broker)
app.conf.result_backend = app.conf.result_backend or app.conf.broker_url
external = ExternalSystem.from_env()


class Flaky(Exception):
    pass


def begin(key):
    """Count the attempt: the effect's pid is the process running it (for child kills)."""
    external.call(f"start:{key}")


def effect(task, key, name):
    """An idempotent effect: the stub performs it once per idempotency key."""
    return external.call(f"{name}:{key}", key=task.idempotency_key(name))


def charge(task, key, pause):
    """A non-idempotent effect (no key), then a pause in which a crash leaves its
    outcome unknown. The payload names the attempt that made the call."""
    attempt = admin(task.app).get(task.request.id).attempt
    effect_id = external.call(f"charge:{key}", payload=attempt)
    time.sleep(pause)
    return effect_id


@app.task(base=LeasedTask, bind=True, name="soak.idem")
def idem(self, key, steps, pause):
    return idempotent_steps(self, key, steps, pause)


def idempotent_steps(task, key, steps, pause):
    """``steps`` idempotent steps, a pause after each."""
    begin(key)
    out = []
    for i in range(steps):
        out.append(task.step(f"s{i}", effect, task, key, f"s{i}", idempotent=True))
        time.sleep(pause)
    return out


@app.task(base=LeasedTask, bind=True, name="soak.nonidem")
def nonidem(self, key, pause):
    begin(key)
    self.step("load", effect, self, key, "load", idempotent=True)
    time.sleep(pause)
    paid = self.step("charge", charge, self, key, pause)
    time.sleep(pause)
    self.step("ship", effect, self, key, "ship", idempotent=True)
    return paid


@app.task(base=LeasedTask, bind=True, name="soak.retry", max_retries=5)
def retry(self, key, fails):
    begin(key)
    n = self.request.retries
    self.step(f"r{n}", effect, self, key, f"r{n}", idempotent=True)
    if n < fails:
        raise self.retry(countdown=0.2, exc=Flaky(f"{key}: try {n}"))
    return n


@app.task(base=LeasedTask, bind=True, name="soak.fail")
def fail(self, key):
    begin(key)
    self.step("s0", effect, self, key, "s0", idempotent=True)
    raise ValueError(f"{key} fails by its own logic")


@app.task(base=LeasedTask, bind=True, name="soak.exhaust", max_retries=1)
def exhaust(self, key):
    begin(key)
    raise self.retry(countdown=0.2, exc=Flaky(f"{key} always fails"))


@app.task(base=LeasedTask, bind=True, name="soak.long")
def long(self, key, ticks):
    """A long task: 0.1 s ticks, a cancel check at each, the progress cursor every 5."""
    begin(key)
    for i in range(self.load_progress(0), ticks):
        time.sleep(0.1)
        if i % 5 == 4:
            self.save_progress(i + 1)
        else:
            self.check_cancelled()
    self.step("finish", effect, self, key, "finish", idempotent=True)
    return ticks


@app.task(base=LeasedTask, bind=True, name="soak.dedup")
def dedup(self, key):
    begin(key)
    return self.step("s0", effect, self, key, "s0", idempotent=True)


@app.task(
    base=LeasedTask, bind=True, name="soak.limited", concurrency_limit=1, concurrency_key="group"
)
def limited(self, key, steps, pause, group):
    """``idem``, one RUNNING at a time per group, across the workers."""
    return idempotent_steps(self, key, steps, pause)


@app.task(base=LeasedTask, bind=True, name="soak.follow")
def follow(self, previous, key, name):
    """A chain step, ``link=`` callback or chord callback: one idempotent effect, keyed by
    this task's id, so a second follow-up task (a repeat) is a second effect."""
    begin(f"{key}.{name}")
    return self.step(name, effect, self, key, name, idempotent=True)
'''

#: kind -> (task name, relative weight in the workload)
KINDS: dict[str, tuple[str, int]] = {
    "idem": ("soak.idem", 30),
    "nonidem": ("soak.nonidem", 20),
    "retry": ("soak.retry", 12),
    "fail": ("soak.fail", 4),
    "exhaust": ("soak.exhaust", 4),
    "long": ("soak.long", 15),
    "cancel": ("soak.long", 10),
    # heads with follow-ups (soak.follow): a retrying head (as "retry") and two chain
    # steps; an idempotent head (as "idem") and a link= callback; a chord of three
    # idempotent heads and its callback
    "chain": ("soak.retry", 8),
    "link": ("soak.idem", 6),
    "chord": ("soak.idem", 5),
    # one at a time per group (two groups): deliveries wait for the slot
    "limited": ("soak.limited", 12),
    # as "idem", submitted with a countdown longer than ``hold_eta_after``: held in the
    # store, not the broker, until due, then published by a reaper
    "held": ("soak.idem", 8),
}
#: Kinds whose heads have follow-ups (see :meth:`Soak.submit_linked`).
LINKED = ("chain", "link", "chord")
#: Heads of one chord.
CHORD_SIZE = 3

# -- the plan ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Options:
    """One soak run."""

    seed: int
    #: "redis", or "amqp": RabbitMQ on a vhost of the run's own (the project's broker
    #: URL), the result backend still Redis
    broker: str = "redis"
    #: "postgresql", or "sqlite": one SQLite file shared by every process (no
    #: ``pg_terminate`` then); the project's store must be the same
    store: str = "postgresql"
    chaos_seconds: float = 25.0
    tasks: int = 60
    workers: int = 3
    producers: int = 3
    #: bound on the time from the end of the schedule until every task has settled
    settle_timeout: float = 120.0
    #: really restart Redis (only when this run may restart shared services; a Redis
    #: broker's fault)
    restart_redis: bool = False
    #: the store's database URL, for ``pg_terminate`` (PostgreSQL)
    database_url: str = ""
    #: where the evidence of a violation is written ("": a new temporary directory)
    evidence_dir: str = ""


@dataclasses.dataclass(frozen=True)
class Planned:
    """One submission of the workload, ``at`` seconds into the schedule."""

    at: float
    kind: str
    key: str
    args: tuple[Any, ...]
    #: cancel it this many seconds after submitting it
    cancel_after: float | None = None
    #: submitted with this countdown (seconds)
    countdown: float | None = None


@dataclasses.dataclass(frozen=True)
class Event:
    """One fault of the schedule, ``at`` seconds into it."""

    at: float
    kind: str
    #: in [0, 1): which target among the candidates (sorted) it hits
    pick: float
    #: freeze: seconds frozen; kill_worker: seconds until the restart
    duration: float


@dataclasses.dataclass(frozen=True)
class Plan:
    workload: list[Planned]
    faults: list[Event]
    #: dedup rounds: (at, keys) raced by every producer process
    dedup: list[tuple[float, list[str]]]


def make_plan(opts: Options) -> Plan:
    """Draw the workload and the fault schedule from the seed (pure: no I/O)."""
    kinds_of_faults = fault_kinds(opts.broker, opts.store)
    weights_of_faults = [_FAULT_WEIGHTS[k] for k in kinds_of_faults]
    rng = random.Random(opts.seed)
    window = opts.chaos_seconds * 0.8
    # a real Redis restart also loses the result backend's chord counters (they live in
    # Redis too): a chord then never completes, whatever the lease does
    kinds = [k for k in KINDS if not (k == "chord" and opts.restart_redis)]
    weights = [KINDS[k][1] for k in kinds]
    dedup_keys = max(3, opts.tasks // 10)
    workload = []
    for i in range(opts.tasks - dedup_keys):
        kind = rng.choices(kinds, weights)[0]
        key = f"{kind}{i}"
        at = rng.uniform(0.0, window)
        args: tuple[Any, ...]
        cancel_after = countdown = None
        if kind in ("idem", "link", "chord", "held"):
            args = (key, rng.randint(2, 4), round(rng.uniform(0.05, 0.4), 2))
        elif kind == "limited":
            args = (key, rng.randint(2, 4), round(rng.uniform(0.1, 0.5), 2), f"g{i % 2}")
        elif kind == "chain":
            args = (key, rng.randint(1, 2))
        elif kind == "nonidem":
            args = (key, round(rng.uniform(0.1, 0.6), 2))
        elif kind == "retry":
            args = (key, rng.randint(1, 3))
        elif kind in ("long", "cancel"):
            args = (key, rng.randint(15, 50))
            if kind == "cancel":
                cancel_after = round(rng.uniform(0.2, 4.0), 2)
        else:
            args = (key,)
        if kind == "held":
            countdown = round(rng.uniform(1.5, 6.0), 2)
        workload.append(Planned(round(at, 2), kind, key, args, cancel_after, countdown))
    workload.sort(key=lambda p: p.at)
    rounds = max(1, dedup_keys // 3)
    dedup = []
    for r in range(rounds):
        keys = [f"dedup{r}-{j}" for j in range(r, dedup_keys, rounds)]
        dedup.append((round(rng.uniform(0.0, window), 2), keys))
    faults = []
    at = rng.uniform(1.0, 2.0)
    # every kind at least once (in a drawn order), then drawn by weight
    first = rng.sample(kinds_of_faults, len(kinds_of_faults))
    while at < opts.chaos_seconds:
        kind = first.pop() if first else rng.choices(kinds_of_faults, weights_of_faults)[0]
        if kind == "freeze":
            duration = rng.uniform(0.5, 2 * float(TIMINGS["ttl"]) + 1.5)
        elif kind == "kill_worker":
            duration = rng.choice([0.0, rng.uniform(0.5, 5.0)])
        else:
            duration = 0.0
        faults.append(Event(round(at, 2), kind, rng.random(), round(duration, 2)))
        at += rng.uniform(0.4, 2.0)
    return Plan(workload, faults, sorted(dedup))


# -- dedup producers (spawned processes) -----------------------------------------------------


def produce(
    module_path: str,
    module_name: str,
    env: dict[str, str],
    keys: list[str],
    barrier: Any,
    results: Any,
) -> None:
    """Spawned producer: import the project, wait for its siblings, then submit
    ``soak.dedup(key)`` with ``dedup_key=key`` for each key (retrying a submission the
    database did not answer); report ``[(key, id), ...]``."""
    import importlib.util
    import sys

    from celery_lease._runtime import runtime

    os.environ.update(env)
    spec = importlib.util.spec_from_file_location(module_name, module_path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
        task = module.app.tasks["soak.dedup"]
        runtime(module.app).store.ping()
        barrier.wait(60)

        def send(key: str) -> Callable[[], str]:
            return lambda: str(task.apply_async((key,), dedup_key=key).id)

        results.put([(key, _submit(send(key))) for key in keys])
    except BaseException as exc:
        results.put(("error", repr(exc)))
        raise
    finally:
        runtime(module.app).reset()
        module.app.close()


def _submit(send: Callable[[], str], tries: int = 10) -> str:
    """``send()``, again while the database does not answer (the row and its dedup key
    make a repeated submission safe)."""
    for attempt in itertools.count(1):
        try:
            return send()
        except StoreError:
            if attempt >= tries:
                raise
            time.sleep(0.2 * attempt)
    raise AssertionError("unreachable")


# -- the run --------------------------------------------------------------------------------


class SoakError(Exception):
    """The soak itself broke (not an invariant): the message names the seed."""


#: (pool, concurrency) of worker i, in turn
_POOLS = (("prefork", 2), ("threads", 3), ("prefork", 2), ("threads", 2))


class Soak:
    """One soak on ``project`` (a :class:`LeasedProject` built with :data:`SOURCE` and
    :data:`TIMINGS`, on the store ``opts.store`` names). ``redis_url`` is its Redis
    database: the broker (``opts.broker == "redis"``), else the result backend, RabbitMQ
    being the broker (the project's broker URL, on a vhost of the run's own)."""

    def __init__(
        self,
        project: LeasedProject,
        opts: Options,
        redis_url: str,
        echo: Callable[[str], None] | None = None,
    ) -> None:
        self.p = project
        self.opts = opts
        self.redis_url = redis_url
        self.echo = echo
        self.plan = make_plan(opts)
        self.report = Report(opts)
        self.workers: list[WorkerProcess] = []
        # node -> the timer that resumes it: a thread, so that a driver blocked on the
        # counting stub (whose lock a frozen worker may hold) cannot delay the thaw
        self.frozen: dict[str, threading.Timer] = {}
        self._frozen_lock = threading.Lock()
        self.restart_at: dict[str, float] = {}  # node -> restart at (schedule seconds)
        self.t0 = 0.0
        self._barriers: list[Any] = []  # alive until the producers are done with them
        self.admin = admin(project.module.app)

    # -- logging ----------------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.t0

    def log(self, message: str) -> None:
        line = f"[{self.now():7.2f}] {message}"
        self.report.log.append(line)
        if self.echo is not None:
            self.echo(line)

    # -- workers ----------------------------------------------------------------------

    def start_workers(self) -> None:
        for i in range(self.opts.workers):
            pool, concurrency = _POOLS[i % len(_POOLS)]
            self.workers.append(
                self.p.worker(f"soak{i}", pool=pool, concurrency=concurrency, ready=False)
            )
        for w in self.workers:
            w.wait_ready(timeout=90, store=self.p.store)

    def node(self, name: str) -> WorkerProcess:
        (w,) = [w for w in self.workers if w.nodename == name]
        return w

    def running(self) -> list[TaskRecord]:
        return self.p.store.list_tasks(state=State.RUNNING, limit=10_000)

    def owned_by(self, worker: WorkerProcess) -> list[str]:
        return sorted(r.id for r in self.running() if r.owner_node == worker.nodename)

    # -- the run ----------------------------------------------------------------------

    def run(self) -> Report:
        """Start the workers, play the plan, let the system settle, verify."""
        self.start_workers()
        ctx = multiprocessing.get_context("spawn")
        producers: list[Any] = []
        results = ctx.Queue()
        self.t0 = time.monotonic()
        self.log(
            f"seed {self.opts.seed}: {len(self.plan.workload)} submissions, "
            f"{len(self.plan.dedup)} dedup rounds x {self.opts.producers} producers, "
            f"{len(self.plan.faults)} faults over {self.opts.chaos_seconds:g} s"
        )
        queue: list[tuple[float, int, str, Any]] = []
        for i, planned in enumerate(self.plan.workload):
            queue.append((planned.at, i, "submit", planned))
        for i, (at, keys) in enumerate(self.plan.dedup):
            queue.append((at, i, "dedup", keys))
        for i, event in enumerate(self.plan.faults):
            queue.append((event.at, i, "fault", event))
        queue.sort(key=lambda item: (item[0], item[2], item[1]))
        try:
            self._play(ctx, queue, producers, results)
        except Exception as error:
            raise SoakError(
                f"chaos soak seed {self.opts.seed} crashed (reproduce with {SEED_ENV}="
                f"{self.opts.seed}): {error!r}\n\nevents:\n" + "\n".join(self.report.log[-100:])
            ) from error
        finally:
            with self._frozen_lock:
                for timer in self.frozen.values():
                    timer.cancel()  # teardown resumes and kills every worker
            for proc in producers:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
        verify(self.p, self.report)
        if not self.report.ok:
            directory = self.opts.evidence_dir or tempfile.mkdtemp(prefix="celery-lease-soak-")
            path = keep_evidence(self.p, self.report, self.redis_url, Path(directory))
            self.log(f"violations: evidence (rows, audit, messages, chord keys) kept in {path}")
        return self.report

    def _play(
        self,
        ctx: Any,
        queue: list[tuple[float, int, str, Any]],
        producers: list[Any],
        results: Any,
    ) -> None:
        """Play the plan, then leave the system alone until every task settled."""
        cancels: list[tuple[float, str]] = []
        while queue or cancels or self.now() < self.opts.chaos_seconds:
            now = self.now()
            self.housekeeping(now)
            for at, task_id in [c for c in cancels if c[0] <= now]:
                cancels.remove((at, task_id))
                self.cancel(task_id)
            while queue and queue[0][0] <= now:
                _, _, what, item = queue.pop(0)
                if what == "submit":
                    task_id = self.submit(item)
                    if item.cancel_after is not None:
                        cancels.append((now + item.cancel_after, task_id))
                elif what == "dedup":
                    producers += self.race(ctx, item, results)
                else:
                    self.inject(item)
            # the last cancels still land: they are workload, not faults
            if now >= self.opts.chaos_seconds and not queue and not cancels:
                break
            time.sleep(0.02)
        self.report.chaos_wall = self.now()
        settle = time.monotonic()
        self.log("schedule over: resuming frozen workers, restarting dead ones")
        self.leave_alone()
        self.collect(producers, results)
        self.settle(deadline=settle + self.opts.settle_timeout)
        self.report.settle_wall = time.monotonic() - settle

    def housekeeping(self, now: float) -> None:
        for name, at in list(self.restart_at.items()):
            if at <= now:
                del self.restart_at[name]
                self.restart(self.node(name))
        # a worker that exited on its own (not one the schedule killed, waiting for its
        # restart) is started again at once, as a supervisor (systemd, Kubernetes) would
        for worker in self.workers:
            if worker.nodename not in self.restart_at and not worker.is_alive():
                self.report.died += 1
                self.log(f"{worker.nodename} exited on its own (code {worker.returncode})")
                self.restart(worker)

    def thaw(self, worker: WorkerProcess) -> None:
        with self._frozen_lock:
            if self.frozen.pop(worker.nodename, None) is None:
                return  # killed (or resumed) meanwhile
            worker.kill_group(signal.SIGCONT)
        self.log(f"SIGCONT {worker.nodename}")

    def restart(self, worker: WorkerProcess) -> None:
        worker.restart()
        self.report.restarts += 1
        self.log(f"restarted {worker.nodename} (pid {worker.pid})")

    def submit(self, planned: Planned) -> str:
        if planned.kind in LINKED:
            return self.submit_linked(planned)
        name = KINDS[planned.kind][0]
        task = self.p.module.app.tasks[name]
        task_id = str(uuid.uuid4())
        got = _submit(
            lambda: str(
                task.apply_async(
                    planned.args, task_id=task_id, dedup_key=task_id, countdown=planned.countdown
                ).id
            )
        )
        self.report.kinds[got] = planned.kind
        self.report.args[got] = planned.args
        return got

    def submit_linked(self, planned: Planned) -> str:
        """A head with follow-ups; every id is chosen here, so a submission repeated after
        a database error makes the same tasks (dedup by id), and each follow-up is
        known before it runs. Returns the (first) head's id."""
        app = self.p.module.app
        head, follow = app.tasks[KINDS[planned.kind][0]], app.tasks["soak.follow"]
        key = planned.args[0]
        ids = [str(uuid.uuid4()) for _ in range(CHORD_SIZE + 2)]
        report = self.report
        if planned.kind == "chain":

            def send() -> str:
                sig = chain(
                    head.s(*planned.args).set(task_id=ids[0]),
                    follow.s(key, "c1").set(task_id=ids[1]),
                    follow.s(key, "c2").set(task_id=ids[2]),
                )
                sig.apply_async(dedup_key=ids[0])
                return ids[0]

            followups = [
                FollowUp("chain", key, "c1", ids[1], (ids[0],)),
                FollowUp("chain", key, "c2", ids[2], (ids[1],)),
            ]
            heads = {ids[0]: planned.args}
        elif planned.kind == "link":

            def send() -> str:
                callback = follow.s(key, "l1").set(task_id=ids[1])
                head.apply_async(planned.args, task_id=ids[0], dedup_key=ids[0], link=callback)
                return ids[0]

            followups = [FollowUp("link", key, "l1", ids[1], (ids[0],))]
            heads = {ids[0]: planned.args}
        else:
            members = ids[:CHORD_SIZE]
            heads = {tid: (f"{key}h{i}", *planned.args[1:]) for i, tid in enumerate(members)}

            def send() -> str:
                header = [head.s(*args).set(task_id=tid) for tid, args in heads.items()]
                chord(header, follow.s(key, "join").set(task_id=ids[-1])).apply_async()
                return members[0]

            followups = [FollowUp("chord", key, "join", ids[-1], tuple(members))]
        got = _submit(send)
        for tid, args in heads.items():
            report.kinds[tid] = planned.kind
            report.args[tid] = args
        report.followups += followups
        return got

    def cancel(self, task_id: str) -> None:
        try:
            found = _call(lambda: self.admin.cancel(task_id, reason="soak: cancel requested"))
        except IllegalTransition as error:  # it finished first
            self.log(f"cancel {task_id}: {error}")
            return
        self.log(f"cancel {task_id} (was {found.value})")

    def race(self, ctx: Any, keys: list[str], results: Any) -> list[Any]:
        """Start the producers of one dedup round (they submit once all are ready)."""
        barrier = ctx.Barrier(self.opts.producers)
        self._barriers.append(barrier)
        env = self.p.project.process_env()
        procs = []
        for _ in range(self.opts.producers):
            proc = ctx.Process(
                target=produce,
                args=(str(self.p.project.path), self.p.project.module, env, keys, barrier, results),
            )
            proc.start()
            procs.append(proc)
        self.log(f"dedup round: {len(keys)} keys x {self.opts.producers} producers")
        return procs

    def collect(self, producers: list[Any], results: Any) -> None:
        import queue as stdlib_queue

        ids: dict[str, set[str]] = defaultdict(set)
        answers: list[Any] = []
        deadline = time.monotonic() + 120
        while len(answers) < len(producers) and time.monotonic() < deadline:
            try:
                answers.append(results.get(timeout=1.0))
            except stdlib_queue.Empty:
                if not any(proc.is_alive() for proc in producers) and results.empty():
                    break
        if len(answers) < len(producers):
            codes = [proc.exitcode for proc in producers]
            self.report.violations.append(
                f"{len(producers) - len(answers)} dedup producers never answered (exit {codes})"
            )
        for got in answers:
            if isinstance(got, tuple):
                self.report.violations.append(f"a dedup producer failed: {got[1]}")
                continue
            for key, task_id in got:
                ids[key].add(task_id)
        for key, found in sorted(ids.items()):
            if len(found) != 1:
                self.report.violations.append(f"dedup key {key}: {len(found)} tasks {found}")
            for task_id in found:
                self.report.kinds[task_id] = "dedup"
                self.report.args[task_id] = (key,)

    # -- faults -----------------------------------------------------------------------

    def pick(self, items: Sequence[Any], pick: float) -> Any:
        return items[int(pick * len(items)) % len(items)]

    def alive(self) -> list[WorkerProcess]:
        return [w for w in self.workers if w.is_alive()]

    def fault(self, kind: str, target: str, affected: Iterable[str]) -> None:
        hit = sorted(affected)
        self.report.faults.append(Fault(kind, datetime.now(timezone.utc), target, hit))
        self.log(f"{kind} {target}: {len(hit)} tasks hit {hit[:4]}{'...' if len(hit) > 4 else ''}")

    def inject(self, event: Event) -> None:
        import psycopg
        import redis
        from kombu.exceptions import OperationalError as BrokerError

        try:
            getattr(self, f"_{event.kind}")(event)
        except (
            StoreError,
            psycopg.OperationalError,
            redis.ConnectionError,
            BrokerError,
            ConnectionError,
        ) as error:
            # the driver's own reads meet killed connections, and a busy shared server may
            # refuse one ("too many clients"): a fault not injected is not a violation
            self.log(f"{event.kind}: not injected, a service did not answer ({error})")

    def _kill_child(self, event: Event) -> None:
        """SIGKILL the pool child running a task (a prefork worker's)."""
        prefork = {w.nodename: w for w in self.alive() if w.pool == "prefork"}
        candidates: list[tuple[str, int, WorkerProcess]] = []
        for rec in self.running():
            worker = prefork.get(rec.owner_node or "")
            if worker is None or worker.nodename in self.frozen:
                continue
            key = self.key_of(rec.id)
            starts = self.p.external.effects(f"start:{key}") if key else []
            if starts and starts[-1].pid in worker.children():
                candidates.append((rec.id, starts[-1].pid, worker))
        if candidates:
            task_id, pid, worker = self.pick(sorted(candidates, key=lambda c: c[0]), event.pick)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self.fault("kill_child", f"{worker.nodename} child {pid}", [task_id])
            return
        idle = [w for w in prefork.values() if w.nodename not in self.frozen and w.children()]
        if idle:
            worker = self.pick(idle, event.pick)
            pid = self.pick(worker.children(), event.pick)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self.fault("kill_child", f"{worker.nodename} idle child {pid}", [])

    def _kill_worker(self, event: Event) -> None:
        """SIGKILL a whole worker; restart it after ``event.duration`` seconds."""
        alive = self.alive()
        if not alive:
            return
        worker = self.pick(alive, event.pick)
        affected = self.owned_by(worker)
        worker.kill_group(signal.SIGKILL)
        with self._frozen_lock:
            timer = self.frozen.pop(worker.nodename, None)
        if timer is not None:
            timer.cancel()
        self.fault("kill_worker", worker.nodename, affected)
        with contextlib.suppress(AssertionError):
            worker.wait_group_gone(timeout=10)
        self.restart_at[worker.nodename] = self.now() + event.duration

    def _freeze(self, event: Event) -> None:
        """SIGSTOP a whole worker for ``event.duration`` seconds."""
        candidates = [w for w in self.alive() if w.nodename not in self.frozen]
        if not candidates:
            return
        worker = self.pick(candidates, event.pick)
        affected = self.owned_by(worker)
        timer = threading.Timer(event.duration, self.thaw, (worker,))
        timer.daemon = True
        with self._frozen_lock:
            worker.kill_group(signal.SIGSTOP)
            self.frozen[worker.nodename] = timer
        timer.start()
        self.fault("freeze", f"{worker.nodename} for {event.duration:.1f} s", affected)

    def _redis(self, event: Event) -> None:
        """The broker loses every queued message."""
        waiting = sorted(r.id for r in self.p.store.list_tasks(state=State.PENDING, limit=10_000))
        if self.opts.restart_redis:
            redis_restart_losing_data()
            self.fault("redis", "SHUTDOWN NOSAVE + restart", waiting)
        else:
            dropped = drop_queued_messages(self.redis_url)
            self.fault("redis", f"{dropped} keys of queued/unacked messages deleted", waiting)

    def _rabbitmq_purge(self, event: Event) -> None:
        """The broker loses the messages queued in the run's vhost."""
        waiting = sorted(r.id for r in self.p.store.list_tasks(state=State.PENDING, limit=10_000))
        purged, queues = rabbitmq_purge_queues(self.p.project.broker_url)
        self.fault("rabbitmq_purge", f"{purged} messages purged from {queues} queues", waiting)

    def _rabbitmq_disconnect(self, event: Event) -> None:
        """The broker closes every client connection of the run's vhost."""
        running = sorted(r.id for r in self.running())
        closed = rabbitmq_close_connections(
            self.p.project.broker_url, f"soak seed {self.opts.seed}: fault injected"
        )
        self.fault("rabbitmq_disconnect", f"{closed} connections closed", running)

    def _pg_terminate(self, event: Event) -> None:
        """Kill every connection to the store's database."""
        running = sorted(r.id for r in self.running())
        killed = pg_terminate(self.opts.database_url)
        self.fault("pg_terminate", f"{killed} connections", running)

    def key_of(self, task_id: str) -> str | None:
        args = self.report.args.get(task_id)
        return str(args[0]) if args else None

    # -- the end ----------------------------------------------------------------------

    def leave_alone(self) -> None:
        with self._frozen_lock:
            frozen, self.frozen = self.frozen, {}
        for name, timer in frozen.items():
            timer.cancel()
            self.node(name).kill_group(signal.SIGCONT)
            self.log(f"SIGCONT {name}")
        self.restart_at.clear()
        for w in self.workers:
            if not w.is_alive():
                self.restart(w)
        for w in self.workers:
            w.wait_ready(timeout=90, store=self.p.store)

    def settle(self, deadline: float) -> None:
        """Wait (until ``deadline``) until every submitted task rests in a settled state."""
        waiting: list[str] = []
        while time.monotonic() < deadline:
            try:
                records = {r.id: r for r in self.p.store.list_tasks(limit=100_000)}
            except StoreError:
                time.sleep(0.5)
                continue
            waiting = [
                f"{t} ({records[t].state.value if t in records else 'no row'})"
                for t in self.report.kinds
                if t not in records or records[t].state not in SETTLED
            ]
            waiting += unsettled_followups(self.report, records)
            if not waiting:
                self.log("every task settled")
                return
            time.sleep(0.25)
        self.report.violations.append(
            f"not settled {self.opts.settle_timeout:g} s after the schedule ended: "
            f"{len(waiting)} tasks, e.g. {waiting[:8]}"
        )


def _call(fn: Callable[[], Any], tries: int = 5) -> Any:
    for attempt in itertools.count(1):
        try:
            return fn()
        except StoreError:
            if attempt >= tries:
                raise
            time.sleep(0.2 * attempt)
    raise AssertionError("unreachable")


#: Keys of the project's Redis database that are not the broker's messages: kombu's
#: exchange bindings and the result backend's results and chord counters.
_KEPT_KEYS = (b"_kombu.binding.", b"celery-task-meta-", b"celery-taskset-meta-")


def drop_queued_messages(redis_url: str) -> int:
    """Delete every key of the project's Redis database except kombu's exchange bindings
    and the result backend's keys: the queued and unacked messages are lost, routing
    still works, results and chord counters are kept (as a separate backend would)."""
    import redis

    client = redis.Redis.from_url(redis_url, socket_connect_timeout=5)
    try:
        found = [k if isinstance(k, bytes) else k.encode() for k in client.keys("*")]
        keys = [k for k in found if not k.startswith(_KEPT_KEYS)]
        return int(client.delete(*keys)) if keys else 0
    finally:
        client.close()


def seed_from_env() -> int:
    """The soak's seed: ``CELERY_LEASE_SOAK_SEED``, else :data:`DEFAULT_SEED`."""
    raw = os.environ.get(SEED_ENV, "").strip()
    return int(raw) if raw else DEFAULT_SEED
