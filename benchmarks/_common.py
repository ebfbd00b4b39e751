"""Plumbing shared by the benchmarks: services, machine description, stores, statistics.

Every benchmark module exposes ``run(ctx: Context) -> Section``; ``run_all.py`` calls
them in turn and writes ``docs/benchmarks.md``. Figures are medians of repeated runs,
and every ratio is measured side by side in the same run (the machine is shared).

Services (override with environment variables):

- ``CELERY_LEASE_BENCH_PG_URL``: PostgreSQL server database (a schema of its own is
  created per benchmark and dropped afterwards). Default ``postgresql://postgres@127.0.0.1:5432/test``.
- ``CELERY_LEASE_BENCH_REDIS_URL``: Redis, default db 8 (only keys prefixed ``bench``
  and the benchmark's own queues are touched, never the whole database).
- ``CELERY_LEASE_BENCH_AMQP_URL``: RabbitMQ (queues named ``bench-*``, deleted afterwards).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from celery_lease.testing import WorkerProcess, wait_until

T = TypeVar("T")

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent

PG_URL = os.environ.get("CELERY_LEASE_BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("CELERY_LEASE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/8")
AMQP_URL = os.environ.get("CELERY_LEASE_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")

BROKERS = {"redis": REDIS_URL, "rabbitmq": AMQP_URL}


# -- results ------------------------------------------------------------------------------


@dataclasses.dataclass
class Section:
    """One benchmark's part of ``docs/benchmarks.md``."""

    key: str
    title: str
    lines: list[str] = dataclasses.field(default_factory=list)
    images: list[Path] = dataclasses.field(default_factory=list)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def markdown(self, img_prefix: str = "img/") -> str:
        out = [f"## {self.title}", ""]
        out += self.lines
        for image in self.images:
            out += ["", f"![{image.stem}]({img_prefix}{image.name})"]
        return "\n".join(out).rstrip() + "\n"


@dataclasses.dataclass
class Context:
    """What a benchmark needs: its scale, where to write, how to report progress."""

    quick: bool
    out_dir: Path
    img_dir: Path
    work_dir: Path
    plots: bool = True

    def scale(self, full: T, quick: T) -> T:
        return quick if self.quick else full

    def log(self, message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} load {loadavg()}] {message}", flush=True)


def make_context(quick: bool, out_dir: Path, plots: bool = True) -> Context:
    img = out_dir / "img"
    img.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="celery-lease-bench-"))
    return Context(quick=quick, out_dir=out_dir, img_dir=img, work_dir=work, plots=plots)


def standalone(
    run: Callable[[Context], Section],
    argv: Sequence[str] | None = None,
    parts: dict[str, Callable[[Context], Section]] | None = None,
) -> int:
    """``python benchmarks/bench_x.py [--quick] [--out DIR] [--only PART]``: run one
    benchmark (or one of its ``parts``), print it."""
    import argparse

    parser = argparse.ArgumentParser(description=run.__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny N: a smoke run")
    parser.add_argument("--out", type=Path, default=None, help="where plots go (default: tmp)")
    if parts:
        parser.add_argument(
            "--only",
            choices=sorted(parts),
            default=None,
            help="run only this part: "
            + "; ".join(f"{k}: {(v.__doc__ or '').strip()}" for k, v in sorted(parts.items())),
        )
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="celery-lease-bench-out-"))
    ctx = make_context(args.quick, out)
    print(describe_machine_text(), flush=True)
    chosen = parts[args.only] if parts and args.only else run
    try:
        section = chosen(ctx)
    finally:
        shutil.rmtree(ctx.work_dir, ignore_errors=True)
    print(section.markdown(), flush=True)
    return 0


# -- machine ------------------------------------------------------------------------------


def loadavg() -> str:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "?"
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def _mem_total() -> str:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    return "?"


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return "?"


def _service_versions() -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        import psycopg

        with psycopg.connect(libpq_url(PG_URL), connect_timeout=5) as conn:
            row = conn.execute("SHOW server_version").fetchone()
            out["PostgreSQL"] = str(row[0]) if row else "?"
    except Exception as exc:
        out["PostgreSQL"] = f"unreachable ({type(exc).__name__})"
    try:
        import redis

        client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=5)
        out["Redis"] = str(client.info("server").get("redis_version", "?"))
        client.close()
    except Exception as exc:
        out["Redis"] = f"unreachable ({type(exc).__name__})"
    try:
        from kombu import Connection

        with Connection(AMQP_URL, connect_timeout=5) as conn:
            conn.ensure_connection(max_retries=1)
            props = conn.connection.server_properties
            raw = props.get("version", "?")
            out["RabbitMQ"] = raw.decode() if isinstance(raw, bytes) else str(raw)
    except Exception as exc:
        out["RabbitMQ"] = f"unreachable ({type(exc).__name__})"
    return out


def describe_machine() -> dict[str, str]:
    """The machine and software the figures were measured on."""
    info = {
        "CPU": f"{_cpu_model()} ({os.cpu_count()} cores)",
        "memory": _mem_total(),
        "OS": f"{platform.system()} {platform.release()}",
        "Python": platform.python_version(),
        "celery": _version("celery"),
        "kombu": _version("kombu"),
        "SQLAlchemy": _version("sqlalchemy"),
        "psycopg": _version("psycopg"),
        "SQLite": __import__("sqlite3").sqlite_version,
    }
    info.update(_service_versions())
    info["load average (1, 5, 15 min)"] = loadavg()
    return info


def describe_machine_text() -> str:
    return "machine: " + "; ".join(f"{k}: {v}" for k, v in describe_machine().items())


# -- statistics and tables ----------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (``pct`` in 0..100)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(pct / 100 * len(ordered) + 0.5) - 1))
    return float(ordered[rank])


def fmt(value: float | int | str | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return f"{value:,}"
    if value != value:  # NaN
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A markdown table."""
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        out.append("| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in row) + " |")
    return out


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))


# -- plots (matplotlib is optional: `pip install celery-lease[bench]`) --------------------


def pyplot(ctx: Context) -> Any:
    """matplotlib.pyplot with a file backend, or ``None`` if unavailable or disabled."""
    if not ctx.plots:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_plot(ctx: Context, section: Section, fig: Any, name: str) -> None:
    path = ctx.img_dir / f"bench-{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    section.images.append(path)
    import matplotlib.pyplot as plt

    plt.close(fig)


# -- PostgreSQL schemas and stores ----------------------------------------------------------


def libpq_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def pg_execute(*statements: str, url: str = PG_URL) -> None:
    import psycopg

    with psycopg.connect(libpq_url(url), autocommit=True, connect_timeout=5) as conn:
        for statement in statements:
            conn.execute(statement.encode())


def new_schema_name(tag: str) -> str:
    return f"bench_{tag}_{os.getpid()}_{uuid.uuid4().hex[:6]}"


@contextlib.contextmanager
def pg_schema(tag: str) -> Iterator[str]:
    """A PostgreSQL schema for one benchmark, dropped (with its tables) afterwards."""
    name = new_schema_name(tag)
    try:
        yield name
    finally:
        pg_execute("SET lock_timeout = '30s'", f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def store_url(kind: str, ctx: Context, tag: str) -> str:
    if kind == "postgresql":
        return PG_URL
    return f"sqlite:///{ctx.work_dir / f'{tag}.sqlite3'}"


def noop_row(task_id: str) -> Any:
    """A no-op task's row as a producer writes it (for benchmarks of the store alone)."""
    from celery_lease.store import NewTask

    return NewTask(
        id=task_id,
        name="bench.noop",
        args="[0]",
        kwargs="{}",
        options="{}",
        lease_ttl=30.0,
        max_recoveries=5,
    )


def lease_config(url: str, schema: str | None, **overrides: Any) -> Any:
    from celery_lease.config import LeaseConfig

    return LeaseConfig(database_url=url, schema=schema, **overrides)


def truncate_store(store: Any) -> None:
    """Empty every lease table (between rounds: each round starts from the same size)."""
    from sqlalchemy import delete, text

    t = store.t
    tables = [t.tasks, t.transitions, t.steps, t.workers, t.locks]
    with store.engine.begin() as conn:
        if store.is_pg:
            names = ", ".join(
                f'"{tb.schema}"."{tb.name}"' if tb.schema else f'"{tb.name}"' for tb in tables
            )
            conn.execute(text(f"TRUNCATE {names}"))
        else:
            for tb in tables:
                conn.execute(delete(tb))


# -- brokers ------------------------------------------------------------------------------


def new_queue(tag: str) -> str:
    return f"bench-{tag}-{uuid.uuid4().hex[:8]}"


def delete_queue(broker_url: str, queue: str) -> None:
    """Remove a benchmark queue and whatever it still holds."""
    if broker_url.startswith("redis"):
        import redis

        client = redis.Redis.from_url(broker_url)
        try:
            keys = [queue, *client.keys(f"{queue}\x06*"), *client.keys(f"_kombu.binding.{queue}")]
            client.delete(*[k for k in keys if k])
        finally:
            client.close()
        return
    from kombu import Connection

    with Connection(broker_url, connect_timeout=5) as conn, contextlib.suppress(Exception):
        channel: Any = conn.default_channel
        channel.queue_delete(queue)


def redis_client() -> Any:
    import redis

    return redis.Redis.from_url(REDIS_URL, socket_connect_timeout=5)


def clear_redis_unacked(broker_url: str) -> None:
    """Drop kombu's bookkeeping of unacknowledged messages in the benchmark db (left by
    killed workers); only ever called on the benchmark's own Redis database."""
    if not broker_url.startswith("redis"):
        return
    client = redis_client()
    try:
        client.delete("unacked", "unacked_index", "unacked_mutex")
    finally:
        client.close()


# -- generated projects and worker processes ----------------------------------------------

PROJECT_HEADER = '''\
"""Generated by celery-lease's benchmarks (safe to delete)."""
import os
import struct
import threading
import time

from celery import Celery, signals

app = Celery("benchproj", broker={broker_url!r}, set_as_current=True)
app.conf.update({settings!r})

_DONE_DIR = os.environ.get("BENCH_DONE_DIR")
_fd = None
_fd_pid = 0
_fd_lock = threading.Lock()


def bench_mark_done():
    """Append this moment (8 bytes) to a file per process: cheap, and equal for every
    variant, so completion counts and rates cost no broker or database round trip."""
    global _fd, _fd_pid
    if not _DONE_DIR:
        return
    pid = os.getpid()
    if _fd is None or _fd_pid != pid:
        with _fd_lock:
            if _fd is None or _fd_pid != pid:
                _fd = os.open(
                    os.path.join(_DONE_DIR, f"{{pid}}.bin"),
                    os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                    0o644,
                )
                _fd_pid = pid
    os.write(_fd, struct.pack("d", time.time()))


@signals.task_postrun.connect
def _bench_postrun(**kwargs):
    bench_mark_done()

'''


@dataclasses.dataclass
class Project:
    """A generated Celery project module and the worker processes started from it."""

    directory: Path
    module: str
    broker_url: str
    env: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def write(
        cls,
        ctx: Context,
        *,
        broker_url: str,
        settings: Mapping[str, Any],
        source: str,
        env: Mapping[str, str] | None = None,
    ) -> Project:
        module = f"benchproj_{uuid.uuid4().hex[:8]}"
        directory = ctx.work_dir / module
        directory.mkdir(parents=True)
        text = PROJECT_HEADER.format(broker_url=broker_url, settings=dict(settings))
        (directory / f"{module}.py").write_text(text + textwrap.dedent(source))
        return cls(directory, module, broker_url, dict(env or {}))

    def process_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        path = [str(self.directory), str(REPO_ROOT)]
        if env.get("PYTHONPATH"):
            path.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(path)
        env["PYTHONUNBUFFERED"] = "1"
        env["C_FORCE_ROOT"] = "1"
        env.pop("PYTEST_CURRENT_TEST", None)
        env.update(self.env)
        env.update(extra or {})
        return env

    def load(self) -> Any:
        """Import the module in this process (for producing)."""
        import importlib

        if str(self.directory) not in sys.path:
            sys.path.insert(0, str(self.directory))
        saved = dict(os.environ)
        os.environ.update(self.env)
        try:
            return importlib.import_module(self.module)
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def worker(
        self,
        queue: str,
        *,
        pool: str,
        concurrency: int,
        nodename: str = "bench@%h",
        env: Mapping[str, str] | None = None,
        loglevel: str = "WARNING",
        extra_args: Sequence[str] = (),
    ) -> Worker:
        return Worker(
            self.module,
            cwd=self.directory,
            env=self.process_env(env),
            log_path=self.directory / f"worker-{uuid.uuid4().hex[:6]}.log",
            pool=pool,
            concurrency=concurrency,
            nodename=nodename,
            queues=[queue],
            loglevel=loglevel,
            extra_args=extra_args,
        )


class Worker(WorkerProcess):
    """One ``celery worker`` subprocess in its own process group (the testing kit's
    :class:`celery_lease.testing.WorkerProcess`, run with the project's environment)."""

    def __init__(self, app: str, **options: Any) -> None:
        super().__init__(app, **options)
        self.started_at = 0.0

    def process_env(self) -> dict[str, str]:
        return dict(self.env)  # Project.process_env built all of it

    def start(self) -> Worker:
        self.started_at = time.time()
        super().start()
        return self

    def log_text(self, since_start: bool = True) -> str:
        return super().log_text(since_start)

    def alive(self) -> bool:
        return self.is_alive()

    def check_alive(self) -> bool:
        """``False`` while the worker runs (so it can lead a polling ``or``); raises with
        the log tail once it has exited."""
        if not self.alive():
            tail = "\n".join(self.log_text().splitlines()[-30:])
            raise RuntimeError(f"worker exited early ({self.app}):\n{tail}")
        return False

    def wait_ready(self, timeout: float = 60.0) -> float:
        """Wait for the ``ready.`` line (needs loglevel INFO); returns the time it appeared."""
        wait_for(
            lambda: self.check_alive() or bool(self.READY.search(self.log_text())),
            timeout,
            "worker ready",
        )
        return time.time()

    def stop(self, timeout: float = 15.0) -> int | None:
        """Warm shutdown, then SIGKILL of the whole group (never anyone else's process)."""
        if self.proc is None:
            return None
        return super().stop(timeout)

    def kill(self) -> None:
        self.terminate_now()


def wait_for(
    predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.02
) -> Any:
    """The kit's :func:`~celery_lease.testing.wait_until`, raising ``TimeoutError``."""
    try:
        return wait_until(predicate, timeout=timeout, interval=interval, message=what)
    except AssertionError as error:
        raise TimeoutError(f"{what}: not reached within {timeout:g} s") from error


def flush_published(store: Any) -> None:
    """Record now the "published" marks a store holds back for a batch (what the
    background recorder would do a few milliseconds later)."""
    store._marks.flush()


def done_times(done_dir: Path) -> list[float]:
    """Every completion moment written by ``bench_mark_done`` under ``done_dir``."""
    import struct

    out: list[float] = []
    for path in done_dir.glob("*.bin"):
        raw = path.read_bytes()
        usable = len(raw) - len(raw) % 8
        out.extend(x[0] for x in struct.iter_unpack("d", raw[:usable]))
    return sorted(out)


def done_count(done_dir: Path) -> int:
    return sum(p.stat().st_size // 8 for p in done_dir.glob("*.bin"))


# -- CPU accounting -----------------------------------------------------------------------

#: application_name of the benchmark's PostgreSQL connections (to find their backends)
#: Unique to this benchmark run (its worker processes inherit it through the URL): on a
#: shared machine another run's backends would otherwise be counted as this one's.
PG_APP_NAME = f"celery-lease-bench-{os.getpid()}"


def with_app_name(url: str) -> str:
    """``url`` with ``application_name`` set, so the server's backends can be found."""
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}application_name={PG_APP_NAME}"


def proc_cpu(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (gone ones count 0)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            raw = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def proc_cpu_each(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds of each of these processes still alive."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        try:
            raw = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        out[pid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def proc_cpu_since(before: dict[int, float], born: Sequence[int] = ()) -> float:
    """CPU seconds used since a :func:`proc_cpu_each` reading by its processes still
    alive (one gone meanwhile, such as a closed connection's backend, takes its last
    moments with it rather than counting negative) and by ``born``, processes that
    started since (a connection opened meanwhile: all of its CPU is counted)."""
    now = proc_cpu_each(sorted({*before, *born}))
    return sum(seconds - before.get(pid, 0.0) for pid, seconds in now.items())


def pg_backends() -> list[int]:
    """Server pids of the benchmark's PostgreSQL connections (see :data:`PG_APP_NAME`)."""
    import psycopg

    with psycopg.connect(libpq_url(PG_URL), autocommit=True, connect_timeout=5) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (PG_APP_NAME,)
        ).fetchall()
    return [int(r[0]) for r in rows]


def pg_wal_position() -> int:
    """The server's current WAL position in bytes (``pg_current_wal_lsn()``): the
    difference of two readings, ``pg_wal_lsn_diff``, is the WAL written between them by
    every session of the server, the benchmark's and anyone else's."""
    import psycopg

    with psycopg.connect(libpq_url(PG_URL), autocommit=True, connect_timeout=5) as conn:
        row = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')").fetchone()
    return int(row[0]) if row else 0


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def broker_pids(broker_url: str) -> list[int]:
    """The broker's server processes on this machine, to read their CPU from ``/proc``:
    the ``redis-server`` that answers at ``broker_url`` (its ``INFO`` gives its pid), or
    the ``beam.smp`` that boots RabbitMQ (its Erlang VM: it serves every vhost and user of
    the server, not only the benchmark; the short-lived VMs of ``rabbitmqctl`` are left
    out). Empty if the server is not a process here (another host, another pid
    namespace): its CPU is then not measured."""
    if broker_url.startswith("redis"):
        import redis

        client = redis.Redis.from_url(broker_url, socket_connect_timeout=5)
        try:
            pid = int(client.info("server").get("process_id", 0))
        finally:
            client.close()
        return [pid] if pid and _comm(pid).startswith("redis-server") else []
    found = []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or _comm(int(entry)) != "beam.smp":
                continue
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                if b"rabbit" in argv and b"boot" in argv:  # ``-s rabbit boot``
                    found.append(int(entry))
    return sorted(found)
