"""Fault injection for the crash suite: crash-point subprocesses, service restarts, a
TCP proxy that makes PostgreSQL unreachable, and the guard that keeps a test from
restarting services under someone else's feet.

Used by ``test_matrix_outbox.py`` (rows 1, 2), ``test_matrix_faults.py`` (rows 12-14)
and the chaos soak (``test_soak.py``, ``scripts/soak.py``).

Restarting Redis, RabbitMQ or PostgreSQL affects every process on the machine. A test
that does it takes the ``exclusive_services`` fixture: it skips (with the reason) when
another test session or worker that is not ours is running, unless
``CELERY_LEASE_TEST_EXCLUSIVE=1`` says the machine is ours; and every restart helper
brings the service back and waits until it answers, whatever happens.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from ..helpers import WorkerProject, wait_until

#: Environment variable naming the crash point a subprocess dies at.
CRASH_ENV = "CELERY_LEASE_CRASH_AT"
#: Exit status of a fired crash point (``celery_lease._crashpoints.EXIT_STATUS``).
CRASH_STATUS = 137
#: Until the crash-point call sites are in the package, point subprocesses at a patched
#: copy: ``CELERY_LEASE_TEST_PACKAGE_ROOT=/path/holding/celery_lease``.
PACKAGE_ROOT_ENV = "CELERY_LEASE_TEST_PACKAGE_ROOT"
#: Set to 1 to let tests restart shared services although other sessions are running.
EXCLUSIVE_ENV = "CELERY_LEASE_TEST_EXCLUSIVE"

REDIS_START = [
    "redis-server",
    "--daemonize",
    "yes",
    "--bind",
    "127.0.0.1",
    "-::1",
    "--port",
    "6379",
    "--save",
    "",
    "--appendonly",
    "no",
    "--dir",
    "/var/lib/redis",
    "--logfile",
    "/var/log/redis/ci.log",
]


# -- subprocesses that die at a named crash point ------------------------------------------

_PRODUCER = """
import importlib, json, sys
module = importlib.import_module(sys.argv[1])
task = module.app.tasks[sys.argv[2]]
options = json.loads(sys.argv[4])
task.apply_async(json.loads(sys.argv[3]), **options)
print("PRODUCER RETURNED", flush=True)
"""


def subprocess_env(
    project: WorkerProject, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The project's environment (as its workers get it), package override first."""
    env = project.process_env(extra)
    root = os.environ.get(PACKAGE_ROOT_ENV)
    if root:
        env["PYTHONPATH"] = os.pathsep.join([root, env["PYTHONPATH"]])
    return env


def run_producer(
    project: WorkerProject,
    task_name: str,
    args: Sequence[Any],
    *,
    crash_at: str | None,
    timeout: float = 60.0,
    **options: Any,
) -> subprocess.CompletedProcess[str]:
    """``apply_async`` one task in a fresh producer process that dies at ``crash_at``."""
    import json

    extra = {CRASH_ENV: crash_at} if crash_at else {}
    return subprocess.run(
        [
            sys.executable,
            "-c",
            _PRODUCER,
            project.module,
            task_name,
            json.dumps(list(args)),
            json.dumps(options),
        ],
        cwd=project.directory,
        env=subprocess_env(project, extra),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def run_reaper(
    project: WorkerProject, *, crash_at: str | None, timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """One ``celery -A <module> lease reap`` in its own process, dying at ``crash_at``."""
    extra = {CRASH_ENV: crash_at} if crash_at else {}
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", project.module, "lease", "reap"],
        cwd=project.directory,
        env=subprocess_env(project, extra),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@contextlib.contextmanager
def reaper_loop(project: WorkerProject, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``celery -A <module> lease reap --loop --json`` in its own process group (a
    standalone reaper, as the docs offer one; one JSON report a line per sweep in
    ``log``), SIGKILLed with its group at the end."""
    argv = ["-m", "celery", "-A", project.module, "lease", "reap", "--loop", "--json"]
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, *argv],
            cwd=project.directory,
            env=subprocess_env(project),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def assert_crashed(proc: subprocess.CompletedProcess[str], point: str) -> None:
    """The subprocess died at crash point ``point`` (not earlier, not never)."""
    assert proc.returncode == CRASH_STATUS, (
        f"crash point {point!r} did not fire (exit {proc.returncode}); is the crash-point "
        f"patch applied (or {PACKAGE_ROOT_ENV} set)?\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
    )
    assert "PRODUCER RETURNED" not in proc.stdout


# -- who else is on this machine ---------------------------------------------------------


def _ppid(pid: int) -> int | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(raw[raw.rindex(")") + 2 :].split()[1])


def _lineage(pid: int) -> set[int]:
    out: set[int] = set()
    while pid and pid not in out:
        out.add(pid)
        parent = _ppid(pid)
        if parent is None:
            break
        pid = parent
    return out


def foreign_sessions() -> list[str]:
    """Test sessions, Celery workers and benchmark or demo drivers on this machine that
    are neither ours nor our ancestors (an engineer's pytest, a demo, their workers)."""
    me = os.getpid()
    ancestors = _lineage(me)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid in ancestors:
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv if a]
        if not words or not any("python" in w or w.endswith("celery") for w in words[:1]):
            continue
        line = " ".join(words)
        # test sessions, workers, and the scripts that drive them (benchmarks, demos)
        if not any(mark in line for mark in ("pytest", "celery", "benchmarks/", "scripts/")):
            continue
        if me in _lineage(pid):
            continue  # our own workers and subprocesses
        found.append(f"{pid} {line[:160]}")
    return found


@pytest.fixture
def exclusive_services() -> None:
    """Skip unless this session may restart Redis, RabbitMQ and PostgreSQL."""
    if os.environ.get(EXCLUSIVE_ENV) == "1":
        return
    others = foreign_sessions()
    if others:
        pytest.skip(
            "restarts shared services, but other test sessions or workers are running "
            f"(set {EXCLUSIVE_ENV}=1 to override): " + "; ".join(others[:3])
        )


# -- service control -----------------------------------------------------------------------


def _run(argv: Sequence[str], timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)


def redis_up(port: int = 6379) -> bool:
    out = _run(["redis-cli", "-h", "127.0.0.1", "-p", str(port), "ping"], timeout=10)
    return out.stdout.strip() == "PONG"


def redis_start() -> None:
    """Start Redis as CI does (no-op if it answers) and wait until it does."""
    if not redis_up():
        _run(REDIS_START, timeout=30)
    wait_until(redis_up, timeout=30, interval=0.1, message="Redis did not come back")


def restarts_redis_of(redis_url: str) -> bool:
    """Whether :func:`redis_restart_losing_data` restarts the Redis ``redis_url`` names
    (the shared one on 127.0.0.1:6379): a session on a Redis of its own (another port)
    must never restart the shared server, whose restart would not even touch its data."""
    from urllib.parse import urlsplit

    parts = urlsplit(redis_url)
    return parts.hostname in ("127.0.0.1", "localhost") and (parts.port or 6379) == 6379


def redis_restart_losing_data() -> None:
    """``SHUTDOWN NOSAVE`` then start again: every key (every queue) is gone."""
    try:
        _run(["redis-cli", "-h", "127.0.0.1", "-p", "6379", "shutdown", "nosave"], timeout=30)
        wait_until(lambda: not redis_up(), timeout=30, interval=0.1, message="Redis still up")
    finally:
        redis_start()


def rabbitmq_up() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=2):
            pass
    except OSError:
        return False
    return _run(["rabbitmq-diagnostics", "-q", "check_running"], timeout=60).returncode == 0


def rabbitmq_restart_app() -> None:
    """``rabbitmqctl stop_app`` then ``start_app``: connections drop, non-durable queues
    (and their messages) are gone, durable queues keep their persistent messages."""
    try:
        _run(["rabbitmqctl", "stop_app"], timeout=120)
    finally:
        started = _run(["rabbitmqctl", "start_app"], timeout=180)
        if started.returncode != 0:  # the node itself went away: start it as CI does
            _run(["rabbitmq-server", "-detached"], timeout=60)
        wait_until(rabbitmq_up, timeout=180, interval=0.5, message="RabbitMQ did not come back")


# -- RabbitMQ faults scoped to one virtual host (the shared node is never restarted) ----------


def vhost_of(amqp_url: str) -> str:
    """The virtual host of an AMQP URL (``amqp://user:pw@host:port/vhost``; "/" if none)."""
    from urllib.parse import unquote, urlsplit

    return unquote(urlsplit(amqp_url).path[1:]) or "/"


def with_vhost(amqp_url: str, vhost: str) -> str:
    """``amqp_url`` on another virtual host."""
    from urllib.parse import quote

    return amqp_url.rsplit("/", 1)[0] + "/" + quote(vhost, safe="")


def _own_vhost(amqp_url: str) -> str:
    vhost = vhost_of(amqp_url)
    if vhost == "/":
        # the default vhost is shared by every session on the machine
        raise ValueError(f"{amqp_url}: a fault needs a virtual host of its own, not '/'")
    return vhost


def _rabbitmqctl(*argv: str, timeout: float = 60.0) -> str:
    """Run ``rabbitmqctl -q ARGV``; its output, or :class:`ConnectionError` (the node did
    not answer, the command failed)."""
    try:
        proc = _run(["rabbitmqctl", "-q", *argv], timeout=timeout)
    except (OSError, subprocess.SubprocessError) as error:
        raise ConnectionError(f"rabbitmqctl {' '.join(argv)}: {error}") from error
    if proc.returncode != 0:
        raise ConnectionError(
            f"rabbitmqctl {' '.join(argv)} exited {proc.returncode}: "
            f"{(proc.stderr or proc.stdout).strip()}"
        )
    return proc.stdout


def rabbitmq_add_vhost(amqp_url: str) -> None:
    """Create the virtual host of ``amqp_url`` and grant its user everything on it (as
    ``tests/conftest.py`` does for the test sessions); one that exists is kept."""
    from urllib.parse import unquote, urlsplit

    vhost = _own_vhost(amqp_url)
    user = unquote(urlsplit(amqp_url).username or "guest")
    for argv in (["add_vhost", vhost], ["set_permissions", "-p", vhost, user, ".*", ".*", ".*"]):
        try:
            _rabbitmqctl(*argv)
        except ConnectionError as error:
            if "already_exists" not in str(error):
                raise


def rabbitmq_delete_vhost(amqp_url: str) -> None:
    """Delete the virtual host of ``amqp_url`` (its queues, messages and connections)."""
    _rabbitmqctl("delete_vhost", _own_vhost(amqp_url))


def rabbitmq_purge_queues(amqp_url: str) -> tuple[int, int]:
    """The broker loses the messages queued in the virtual host of ``amqp_url`` (its own):
    every queue of it holding ready messages is purged (``queue.purge``); messages
    delivered and not acknowledged yet are not queued, so they are kept, as a purge
    keeps them. Returns (messages purged, queues purged)."""
    from amqp.exceptions import NotFound
    from kombu import Connection

    vhost = _own_vhost(amqp_url)
    listed = _rabbitmqctl(
        "list_queues", "-p", vhost, "--no-table-headers", "name", "messages_ready"
    )
    names = []
    for line in listed.splitlines():
        name, _, ready = line.rpartition("\t")
        if name and ready.strip().isdigit() and int(ready) > 0:
            names.append(name)
    purged = queues = 0
    if not names:
        return 0, 0
    with Connection(amqp_url, connect_timeout=5) as conn:
        try:
            channel = conn.channel()
            for name in names:
                try:
                    purged += int(channel.queue_purge(name) or 0)
                    queues += 1
                except NotFound:  # an auto-delete queue (a reply queue) went away meanwhile
                    channel = conn.channel()
        except (*conn.connection_errors, *conn.channel_errors) as error:
            raise ConnectionError(f"purging {vhost}: {error!r}") from error
    return purged, queues


def rabbitmq_close_connections(amqp_url: str, reason: str = "fault injected") -> int:
    """The broker closes every client connection of the virtual host of ``amqp_url`` (its
    own; the clients see ``CONNECTION_FORCED`` and must reconnect). Returns how many."""
    out = _rabbitmqctl("close_all_connections", "-p", _own_vhost(amqp_url), reason)
    for line in out.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "Closed" and words[1].isdigit():
            return int(words[1])
    return 0


def pg_cluster() -> str:
    versions = sorted(os.listdir("/etc/postgresql"))
    return versions[-1]


def pg_up() -> bool:
    return _run(["pg_isready", "-h", "127.0.0.1", "-p", "5432", "-q"], timeout=10).returncode == 0


def pg_restart() -> None:
    """Restart the PostgreSQL cluster (every connection drops) and wait until it answers."""
    try:
        _run(
            ["pg_ctlcluster", "--skip-systemctl-redirect", pg_cluster(), "main", "restart"],
            timeout=180,
        )
    finally:
        if not pg_up():
            _run(
                ["pg_ctlcluster", "--skip-systemctl-redirect", pg_cluster(), "main", "start"],
                timeout=180,
            )
        wait_until(pg_up, timeout=120, interval=0.2, message="PostgreSQL did not come back")


def pg_terminate(url: str, *, exclude_pid: int | None = None) -> int:
    """Terminate every other backend connected to the database of ``url``; returns how many.

    Scoped to that one database (a test session's own), never the whole server.
    """
    import psycopg
    from sqlalchemy.engine import make_url

    libpq = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(libpq, autocommit=True, connect_timeout=5) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND backend_type = 'client backend'"
        ).fetchall()
    return sum(1 for (ok,) in rows if ok)


def pg_sessions_from(url: str, ports: set[int]) -> int:
    """Server sessions of the database of ``url`` whose client is one of the local
    ``ports`` (a proxy's upstream connections): 0 once the server has read, run and
    closed everything that was sent through them."""
    import psycopg
    from sqlalchemy.engine import make_url

    if not ports:
        return 0
    libpq = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(libpq, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND client_port = ANY(%s)",
            (sorted(ports),),
        ).fetchone()
    return int(row[0]) if row else 0


# -- a TCP proxy in front of PostgreSQL or Redis -------------------------------------------


class TcpProxy:
    """A loopback TCP proxy to ``target``: workers pointed at it lose the database (or
    the broker) when the test says so, while everyone else keeps a direct connection.

    ``cut()`` closes every proxied connection and refuses new ones (a dead host or a
    firewall answering RST); ``restore()`` accepts again on the same port.
    ``blackhole()`` keeps accepting and keeps every connection open but forwards
    nothing either way (a server, NAT or load balancer that stopped answering: the
    client's writes succeed, no answer ever comes); ``resume()`` forwards again, what
    was held back included.
    """

    def __init__(self, target: tuple[str, int] = ("127.0.0.1", 5432)) -> None:
        self.target = target
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = int(probe.getsockname()[1])
        probe.close()
        self.cuts = 0
        #: Local ports of every connection made to ``target`` (to find its server side).
        self.upstream_ports: set[int] = set()
        self._flowing = threading.Event()
        self._flowing.set()
        #: Cleared by :meth:`hold_answers`: the server's side is not read.
        self._answering = threading.Event()
        self._answering.set()

    def url(self, database_url: str) -> str:
        """``database_url`` rewritten to go through this proxy."""
        from sqlalchemy.engine import make_url

        return (
            make_url(database_url)
            .set(host="127.0.0.1", port=self.port)
            .render_as_string(hide_password=False)
        )

    def broker_url(self, broker_url: str) -> str:
        """``broker_url`` (``redis://host:port/db``) rewritten to go through this proxy."""
        from urllib.parse import urlsplit, urlunsplit

        parts = urlsplit(broker_url)
        auth = parts.netloc.rpartition("@")[0]
        netloc = f"{auth}@127.0.0.1:{self.port}" if auth else f"127.0.0.1:{self.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    def start(self) -> TcpProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        self._thread = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        self._thread.start()
        return self

    restore = start

    @property
    def black_holed(self) -> bool:
        """Whether the proxy black-holes now (between :meth:`blackhole` and :meth:`resume`)."""
        return not self._flowing.is_set()

    def blackhole(self) -> None:
        """Accept connections but forward nothing (existing connections stay open)."""
        self._flowing.clear()

    def hold_answers(self) -> None:
        """Forward what clients send, hold back what the server answers: a statement
        runs (and commits) but its answer never comes."""
        self._answering.clear()

    def resume(self) -> None:
        """Forward again after :meth:`blackhole` or :meth:`hold_answers`, including
        what was held back."""
        self._answering.set()
        self._flowing.set()

    def cut(self) -> None:
        """Drop every connection and stop listening (connects are refused)."""
        self.cuts += 1
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            conns, self._conns = self._conns, set()
        for conn in conns:
            # shutdown, not close: it wakes the pump thread blocked on this socket, which
            # then closes both ends (the worker sees its connection drop at once)
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    close = cut
    refuse = cut

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            if not self._flowing.is_set():
                # black-holed: hold the client without a server behind it, as a dead
                # server behind a live load balancer does; connect once resumed
                threading.Thread(target=self._hold, args=(client,), daemon=True).start()
                continue
            self._connect(client)

    def _hold(self, client: socket.socket) -> None:
        with self._lock:
            self._conns.add(client)
        while not self._flowing.wait(0.2):
            with self._lock:
                if client not in self._conns:
                    with contextlib.suppress(OSError):
                        client.close()
                    return
        self._connect(client)

    def _connect(self, client: socket.socket) -> None:
        with self._lock:
            self._conns.discard(client)
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        with self._lock:
            self._conns.update((client, upstream))
            self.upstream_ports.add(int(upstream.getsockname()[1]))
        threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        sel.register(a, selectors.EVENT_READ, b)
        sel.register(b, selectors.EVENT_READ, a)
        answering = True
        try:
            while True:
                if not self._flowing.is_set():
                    # black-holed: read nothing, send nothing, keep both ends open
                    self._flowing.wait(0.2)
                    with self._lock:
                        if a not in self._conns:
                            return
                    continue
                if answering != self._answering.is_set():
                    answering = not answering
                    if answering:
                        sel.register(b, selectors.EVENT_READ, a)
                    else:
                        sel.unregister(b)  # answers held: the server's side stays unread
                for key, _ in sel.select(timeout=1.0 if answering else 0.2):
                    if not self._flowing.is_set():
                        break  # black-holed while waiting: what arrived stays unread
                    src: socket.socket = key.fileobj  # type: ignore[assignment]
                    if src is b and not self._answering.is_set():
                        break  # answers held while waiting
                    data = src.recv(65536)
                    if not data:
                        return
                    key.data.sendall(data)
                with self._lock:
                    if a not in self._conns:
                        return
        except OSError:
            return
        finally:
            sel.close()
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.close()
            with self._lock:
                self._conns.discard(a)
                self._conns.discard(b)


@contextlib.contextmanager
def proxy_to_postgres() -> Iterator[TcpProxy]:
    proxy = TcpProxy().start()
    try:
        yield proxy
    finally:
        proxy.close()


@contextlib.contextmanager
def proxy_to_redis(redis_url: str) -> Iterator[TcpProxy]:
    """A proxy in front of the Redis server of ``redis_url`` (the test's own); point a
    project's broker at ``proxy.broker_url(redis_url)``."""
    from urllib.parse import urlsplit

    parts = urlsplit(redis_url)
    proxy = TcpProxy((parts.hostname or "127.0.0.1", parts.port or 6379)).start()
    try:
        yield proxy
    finally:
        proxy.close()
