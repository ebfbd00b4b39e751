"""Recovery latency: from a fault to the next attempt starting, side by side with plain
Celery + Redis (``acks_late``, ``task_reject_on_worker_lost``, visibility_timeout
default and lowered).

Faults: a pool child SIGKILLed; the whole worker SIGKILLed then restarted under the
same node name; the whole worker lost for good while another worker is up; the worker
frozen (SIGSTOP) while another is up. Every attempt start is pushed to a Redis list
(wall clock; every process is on this machine), so the latency is
``next start - fault``. A plain-Celery case whose redelivery can only come from the
visibility timeout is watched for a bounded window and reported as
">= visibility_timeout" when nothing came.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    BROKERS,
    PG_URL,
    REDIS_URL,
    Context,
    Project,
    Section,
    Worker,
    clear_redis_unacked,
    delete_queue,
    lease_config,
    loadavg,
    median,
    new_queue,
    pg_schema,
    pyplot,
    redis_client,
    save_plot,
    standalone,
    table,
    truncate_store,
    wait_for,
)

SOURCE = """
import redis

_r = redis.Redis.from_url(os.environ["BENCH_REDIS_URL"])

if os.environ.get("BENCH_LEASED"):
    from celery_lease import LeasedTask

    _options = {"base": LeasedTask}
else:
    _options = {"acks_late": True, "reject_on_worker_lost": True}


@app.task(bind=True, name="bench.long", shared=False, **_options)
def long(self, key, seconds):
    _r.rpush(key, f"{time.time()} {os.getpid()} {self.request.hostname}")
    time.sleep(seconds)
"""


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    leased: bool
    settings: dict[str, Any]
    #: plain Celery + Redis: redelivery only after this many seconds (None: leased)
    visibility_timeout: float | None = None


def configs(ctx: Context, schema: str) -> list[Config]:
    lease = {"lease_database_url": PG_URL, "lease_schema": schema}
    tuned = {
        **lease,
        "lease_ttl": 3.0,
        "lease_heartbeat_interval": 0.5,
        "lease_reaper_interval": 0.5,
    }
    plain = {"worker_prefetch_multiplier": 1}
    lowered = ctx.scale(10.0, 2.0)
    out = [
        Config("celery-lease, tuned (ttl 3 s, heartbeat 0.5 s, reaper 0.5 s)", True, tuned),
        Config(
            f"plain Celery + Redis, visibility_timeout {lowered:g} s",
            False,
            {
                **plain,
                # kombu scans for expired messages every interval x throttle seconds
                # (10 x 10 by default): both at 1 give the lowered timeout its best case
                "broker_transport_options": {
                    "visibility_timeout": lowered,
                    "unacked_restore_interval": 1,
                    "unacked_restore_throttle": 1,
                },
            },
            lowered,
        ),
    ]
    if not ctx.quick:
        out.insert(
            0, Config("celery-lease, defaults (ttl 30 s, heartbeat 5 s, reaper 5 s)", True, lease)
        )
        out.append(
            Config(
                "plain Celery + Redis, visibility_timeout 3600 s (default)",
                False,
                plain,
                3600.0,
            )
        )
    return out


@dataclasses.dataclass
class Outcome:
    config: str
    scenario: str
    latency: float | None  # seconds from the fault to the next start; None: none in window
    window: float
    from_ready: float | None = None
    #: child loss: seconds from the fault until the pool noticed it (billiard's part)
    noticed: float | None = None


class Bench:
    def __init__(self, ctx: Context, schema: str) -> None:
        self.ctx = ctx
        self.schema = schema
        self.redis = redis_client()
        self.projects: dict[str, tuple[Project, Any]] = {}
        self._store: Any = None

    def store(self) -> Any:
        from celery_lease.store import Store

        if self._store is None:
            self._store = Store(lease_config(PG_URL, self.schema))
            self._store.migrate()
        return self._store

    def project(self, cfg: Config) -> tuple[Project, Any]:
        if cfg.name not in self.projects:
            settings = {
                "broker_connection_retry_on_startup": True,
                "task_ignore_result": True,
                **cfg.settings,
            }
            env = {"BENCH_REDIS_URL": REDIS_URL}
            if cfg.leased:
                env["BENCH_LEASED"] = "1"
                self.store()
            project = Project.write(
                self.ctx, broker_url=BROKERS["redis"], settings=settings, source=SOURCE, env=env
            )
            self.projects[cfg.name] = (project, project.load())
        return self.projects[cfg.name]

    def close(self) -> None:
        from celery_lease._runtime import runtime

        for _, module in self.projects.values():
            runtime(module.app).reset()
            module.app.close()
        if self._store is not None:
            self._store.dispose()
        self.redis.close()

    # -- helpers ------------------------------------------------------------------------------

    def starts(self, key: str) -> list[tuple[float, int, str]]:
        out = []
        for raw in self.redis.lrange(key, 0, -1):
            at, pid, host = raw.decode().split(" ", 2)
            out.append((float(at), int(pid), host))
        return out

    def wait_start(self, key: str, count: int, timeout: float) -> tuple[float, int, str] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.starts(key)
            if len(got) >= count:
                return got[count - 1]
            time.sleep(0.02)
        return None

    def scenario(self, cfg: Config, name: str) -> Outcome:
        project, module = self.project(cfg)
        if cfg.leased:
            truncate_store(self.store())
        queue = new_queue("recovery")
        key = f"bench:starts:{uuid.uuid4().hex[:8]}"
        workers: list[Worker] = []
        vt = cfg.visibility_timeout
        if cfg.leased:
            ttl = float(cfg.settings.get("lease_ttl", 30.0))
            reaper = float(cfg.settings.get("lease_reaper_interval", 5.0))
            window = ttl + reaper + 30.0
        else:
            assert vt is not None
            window = vt + 20.0 if vt < 100 else self.ctx.scale(40.0, 5.0)

        def start(node: str) -> Worker:
            w = project.worker(
                queue, pool="prefork", concurrency=2, nodename=f"{node}@bench", loglevel="INFO"
            ).start()
            workers.append(w)
            w.wait_ready(90)
            return w

        try:
            a = start("rec-a")
            module.app.tasks["bench.long"].apply_async((key, 600), queue=queue)
            first = self.wait_start(key, 1, 60)
            if first is None:
                raise RuntimeError(f"{cfg.name}: the task never started")
            from_ready = None
            if name == "pool child SIGKILL":
                fault = time.time()
                os.kill(first[1], signal.SIGKILL)
                second = self.wait_start(key, 2, window)
                return Outcome(
                    cfg.name,
                    name,
                    None if second is None else second[0] - fault,
                    window,
                    noticed=_noticed(a, fault),
                )
            elif name == "worker SIGKILL, then restarted":
                fault = time.time()
                a.kill()
                start("rec-a")  # same node name, as a supervisor restarts it
                ready = time.time()
                second = self.wait_start(key, 2, window)
                from_ready = None if second is None else second[0] - ready
                return Outcome(
                    cfg.name,
                    name,
                    None if second is None else second[0] - fault,
                    window,
                    from_ready,
                )
            elif name == "worker lost for good (another worker up)":
                start("rec-b")
                fault = time.time()
                a.kill()
            elif name == "worker frozen (SIGSTOP, another worker up)":
                start("rec-b")
                fault = time.time()
                a.signal_group(signal.SIGSTOP)
            else:
                raise ValueError(name)
            second = self.wait_start(key, 2, window)
            return Outcome(cfg.name, name, None if second is None else second[0] - fault, window)
        finally:
            for w in workers:
                w.kill()
            delete_queue(BROKERS["redis"], queue)
            clear_redis_unacked(BROKERS["redis"])
            self.redis.delete(key)


_EXITED = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}): ERROR/MainProcess\] "
    r"Process .* exited with 'signal 9",
    re.MULTILINE,
)


def _noticed(worker: Worker, fault: float) -> float | None:
    """Seconds from the fault to the worker's "Process ... exited" log line."""
    try:
        wait_for(lambda: _EXITED.search(worker.log_text()), 15, "exit noticed")
    except TimeoutError:
        return None
    for line in worker.log_text().splitlines():
        m = _EXITED.match(line)
        if m:
            at = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))
            return at + int(m.group(2)) / 1000 - fault
    return None


SCENARIOS = (
    "pool child SIGKILL",
    "worker SIGKILL, then restarted",
    "worker lost for good (another worker up)",
    "worker frozen (SIGSTOP, another worker up)",
)


def run(ctx: Context) -> Section:
    """Recovery latency."""
    section = Section("recovery", "5. Recovery latency")
    started = time.time()
    outcomes: list[Outcome] = []
    with pg_schema("recovery") as schema:
        bench = Bench(ctx, schema)
        try:
            for cfg in configs(ctx, schema):
                for scenario in SCENARIOS:
                    slow = scenario.startswith(("worker lost", "worker frozen"))
                    reps = ctx.scale(2 if slow else 3, 1)
                    if (
                        not cfg.leased
                        and (cfg.visibility_timeout or 0) > 100
                        and scenario != SCENARIOS[0]
                    ):
                        reps = 1  # nothing comes before the visibility timeout: one window
                    for r in range(reps):
                        ctx.log(f"recovery: {cfg.name}: {scenario} ({r + 1}/{reps})")
                        out = bench.scenario(cfg, scenario)
                        ctx.log(
                            "  next attempt after "
                            + ("none" if out.latency is None else f"{out.latency:.2f} s")
                            + (
                                ""
                                if out.from_ready is None
                                else f" ({out.from_ready:.2f} s after ready)"
                            )
                        )
                        outcomes.append(out)
        finally:
            bench.close()
    report(ctx, section, outcomes)
    section.seconds = time.time() - started
    return section


def _cell(values: list[float | None], window: float, vt: float | None) -> str:
    early = [v for v in values if v is not None and v < 0]
    got = [v for v in values if v is not None and v >= 0]
    if early and not got:
        return "redelivered before the fault: the running task was started twice"
    if not got:
        bound = f">= visibility_timeout ({vt:g} s)" if vt else "none"
        return f"{bound}: no redelivery within {window:g} s"
    text = f"{median(got):.2f} s"
    if len(got) > 1:
        text += f" ({min(got):.2f}-{max(got):.2f})"
    if len(got) < len(values):
        text += f", {len(values) - len(got)} run(s) without"
    return text


def _spread(values: list[float]) -> str:
    text = f"{median(values):.2f} s"
    if len(values) > 1:
        text += f" ({min(values):.2f}-{max(values):.2f})"
    return text


def report(ctx: Context, section: Section, outcomes: list[Outcome]) -> None:
    section.data = {"outcomes": [dataclasses.asdict(o) for o in outcomes]}
    names = list(dict.fromkeys(o.config for o in outcomes))
    rows = []
    for scenario in SCENARIOS:
        row: list[str] = [scenario]
        for name in names:
            sel = [o for o in outcomes if o.config == name and o.scenario == scenario]
            vt = None
            if "visibility_timeout" in name:
                vt = float(name.split("visibility_timeout ")[1].split(" ")[0])
            cell = _cell([o.latency for o in sel], sel[0].window if sel else 0, vt)
            ready = [o.from_ready for o in sel if o.from_ready is not None]
            if ready:
                cell += f"; {median(ready):.2f} s after the new worker was ready"
            noticed = [o.noticed for o in sel if o.noticed is not None]
            if noticed:
                cell += f"; pool noticed the exit after {_spread(noticed)}"
                after = [
                    o.latency - o.noticed
                    for o in sel
                    if o.latency is not None and o.noticed is not None
                ]
                if after:
                    cell += f", next attempt {_spread(after)} after that"
            row.append(cell)
        rows.append(row)
    section.add(
        "Time from the fault to the next attempt's first line (median, min-max of the "
        "runs), Redis broker, prefork 2 workers, PostgreSQL store. Plain Celery runs with "
        "`task_acks_late=True`, `task_reject_on_worker_lost=True`, prefetch 1.",
        "",
        *table(["fault", *names], rows),
        "",
        "A pool child's death is noticed by Celery's prefork pool (billiard), not by "
        "celery-lease: at once through the process sentinel, or at the pool's next "
        "`maintain_pool` tick (every 5 s) when the sentinel does not fire, which is where "
        "the ~5 s maxima come from, for plain Celery as well. The part after the pool "
        "noticed is celery-lease's fast path (expire at once, re-publish).",
        "",
        "Targets with celery-lease defaults: child loss < 2 s, restart < 3 s after the new "
        "worker is ready, node loss <= `lease_ttl` + `lease_reaper_interval` (35 s). A "
        "frozen worker is a lost node for the reaper (its heartbeat stops); when it "
        "resumes, its attempt is fenced (crash matrix row 11). With plain Celery + Redis the "
        "redelivery after a lost or frozen worker only comes from the visibility timeout, "
        "which also redelivers any task that merely runs longer than it (so a lowered "
        "timeout runs long tasks twice).",
        "",
        f"Load average at the end: {loadavg()}.",
    )
    plt = pyplot(ctx)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / max(len(names), 1)
    for j, name in enumerate(names):
        vals = []
        for scenario in SCENARIOS:
            got = [o.latency for o in outcomes if o.config == name and o.scenario == scenario]
            ok = [v for v in got if v is not None]
            vals.append(median(ok) if ok else 0.0)
        ax.bar([i + j * width for i in range(len(SCENARIOS))], vals, width, label=name)
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(SCENARIOS))])
    ax.set_xticklabels([s.split(" (")[0] for s in SCENARIOS], fontsize=8)
    ax.set_ylabel("seconds to the next attempt (0: none in the window)")
    ax.set_yscale("symlog")
    ax.legend(fontsize=7)
    save_plot(ctx, section, fig, "recovery")


if __name__ == "__main__":
    raise SystemExit(standalone(run))
