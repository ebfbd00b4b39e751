"""A PostgreSQL primary and a streaming replica of its own, on this machine, for the
failover tests (crash matrix row 31) and ``scripts/failover_window.py``.

:class:`ReplicatedPostgres` makes two new clusters with the server binaries found on
the machine (``initdb``, ``pg_basebackup -R``, ``pg_ctl``) in a directory of their own,
on two free ports, and removes them afterwards. It never touches another cluster.
PostgreSQL refuses to run as root: run as root, every server command runs as the
``postgres`` OS user (``runuser``). :func:`missing` says why the pair cannot be made
here (the tests skip with that reason).

Replication is synchronous (``synchronous_standby_names`` names the replica and
``synchronous_commit`` is on: a commit is acknowledged once the replica has flushed
it) or asynchronous. For the asynchronous case the replica can stream through a TCP
proxy that :meth:`ReplicatedPostgres.cut_replication` cuts: from then on the primary
acknowledges commits the replica will never have (the lost window, made on purpose).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..helpers import wait_until
from .faults import TcpProxy

#: The OS user the servers run as when this process is root.
PG_OS_USER = "postgres"
#: The database the store uses on the pair.
DATABASE = "lease"
#: The replica's ``application_name`` (what ``synchronous_standby_names`` names).
REPLICA_NAME = "replica"


def server_bindir() -> Path | None:
    """The directory of the newest PostgreSQL server binaries installed (``initdb``,
    ``pg_ctl``, ``pg_basebackup``, ``postgres``), or ``None``."""
    wanted = ("initdb", "pg_ctl", "pg_basebackup", "postgres")
    candidates: list[Path] = []
    found = shutil.which("initdb")
    if found:
        candidates.append(Path(found).resolve().parent)
    lib = Path("/usr/lib/postgresql")
    if lib.is_dir():
        versions = sorted(
            (p for p in lib.iterdir() if p.name.isdigit()), key=lambda p: int(p.name), reverse=True
        )
        candidates += [v / "bin" for v in versions]
    for bindir in candidates:
        if all((bindir / name).is_file() for name in wanted):
            return bindir
    return None


def missing() -> str | None:
    """Why a replicated pair cannot be made on this machine (``None``: it can)."""
    if server_bindir() is None:
        return (
            "the PostgreSQL server binaries (initdb, pg_ctl, pg_basebackup, postgres) "
            "are not installed"
        )
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(PG_OS_USER)
        except KeyError:
            return f"running as root and there is no {PG_OS_USER!r} OS user to run PostgreSQL"
        if shutil.which("runuser") is None:
            return "running as root and there is no runuser to run PostgreSQL as postgres"
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _children(pid: int) -> list[int]:
    """Every live process whose parent is ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name (2nd field) is in parentheses and may hold spaces
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid:
            out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Cluster:
    """One cluster of the pair: its data directory, port and log."""

    def __init__(self, pair: ReplicatedPostgres, name: str) -> None:
        self.pair = pair
        self.name = name
        self.data = pair.root / name
        self.log = pair.root / f"{name}.log"
        self.port = _free_port()

    @property
    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def start(self, *settings: str) -> None:
        """Start the server (``settings``: ``name=value`` given on its command line)."""
        options = " ".join(
            [f"-p {self.port}", f"-k {self.pair.root}", *(f"-c {s}" for s in settings)]
        )
        data, log = str(self.data), str(self.log)
        self.pair.run("pg_ctl", "-D", data, "-l", log, "-w", "-o", options, "start")

    def libpq(self, database: str = DATABASE) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={database}"

    def sql(self, statement: str, *, database: str = DATABASE) -> list[tuple[object, ...]]:
        import psycopg

        with psycopg.connect(self.libpq(database), autocommit=True, connect_timeout=5) as conn:
            cur = conn.execute(statement)  # type: ignore[arg-type]
            return list(cur.fetchall()) if cur.description else []

    def kill(self) -> None:
        """SIGKILL the postmaster and every one of its processes at once, and wait until
        they are gone. The kernel closes their sockets, so clients see their connections
        reset at once; a machine lost without a reset is left to the store's deadlines
        (crash matrix rows 13 and 33)."""
        pid = self.postmaster_pid
        if pid is None:
            return
        pids = [pid, *_children(pid)]
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        wait_until(
            lambda: not any(_alive(p) for p in pids),
            timeout=30,
            interval=0.02,
            message=f"the {self.name}'s processes to die",
        )

    def stop(self) -> None:
        """Stop the server at once if it runs (teardown)."""
        if self.postmaster_pid is not None and (self.data / "postmaster.pid").exists():
            self.pair.run(
                "pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", check=False
            )


class ReplicatedPostgres:
    """A primary and a streaming replica (see the module's docstring); a context manager
    that removes both clusters on exit."""

    def __init__(self, *, synchronous: bool, proxied: bool = False) -> None:
        reason = missing()
        if reason is not None:
            raise RuntimeError(reason)
        bindir = server_bindir()
        assert bindir is not None
        self.bindir = bindir
        self.synchronous = synchronous
        self.root = Path(tempfile.mkdtemp(prefix="celery-lease-failover-"))
        self.as_root = os.geteuid() == 0
        if self.as_root:
            entry = pwd.getpwnam(PG_OS_USER)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self.primary = Cluster(self, "primary")
        self.replica = Cluster(self, "replica")
        #: The replica's way to the primary when ``proxied`` (see :meth:`cut_replication`).
        self.proxy: TcpProxy | None = None
        if proxied:
            self.proxy = TcpProxy(("127.0.0.1", self.primary.port))

    # -- commands ---------------------------------------------------------------------

    def run(
        self, program: str, *argv: str, check: bool = True, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        command: Sequence[str] = [str(self.bindir / program), *argv]
        if self.as_root:
            command = ["runuser", "-u", PG_OS_USER, "--", *command]
        proc = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, check=False, cwd=self.root
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(command)} exited {proc.returncode}: {proc.stderr.strip()}" + self.logs()
            )
        return proc

    def logs(self, lines: int = 30) -> str:
        out = []
        for cluster in (self.primary, self.replica):
            with contextlib.suppress(OSError):
                tail = cluster.log.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"\n--- {cluster.name} log ---\n" + "\n".join(tail))
        return "".join(out)

    # -- the pair ---------------------------------------------------------------------

    def create(self) -> ReplicatedPostgres:
        """initdb the primary, start it, copy it to the replica, start that, and wait
        until the replica streams (and, when synchronous, is the synchronous standby)."""
        self.run(
            "initdb", "-D", str(self.primary.data), "-U", "postgres", "--auth=trust",
            "-E", "UTF8", "--no-sync", "--no-instructions",
        )  # fmt: skip
        with (self.primary.data / "postgresql.conf").open("a") as conf:
            conf.write(
                "\n# celery-lease failover test\n"
                "listen_addresses = '127.0.0.1'\n"
                "wal_level = replica\n"
                "max_wal_senders = 4\n"
                "synchronous_commit = on\n"
                # the machine is not what is lost, only the processes: no fsync
                "fsync = off\n"
                "full_page_writes = off\n"
                "shared_buffers = 16MB\n"
                "max_connections = 60\n"
                "wal_sender_timeout = 5s\n"
                "wal_receiver_status_interval = 1s\n"
            )
        self.primary.start()
        self.primary.sql(f"CREATE DATABASE {DATABASE}", database="postgres")
        port = self.primary.port
        if self.proxy is not None:
            self.proxy.start()
            port = self.proxy.port
        source = f"host=127.0.0.1 user=postgres application_name={REPLICA_NAME}"
        self.run(
            "pg_basebackup", "-D", str(self.replica.data), "-R", "-X", "stream", "--no-sync",
            "-c", "fast", "-d", f"{source} port={self.primary.port}",
        )  # fmt: skip
        conninfo = f"{source} port={port}"
        self.replica.start(f"primary_conninfo='{conninfo}'", "synchronous_standby_names=''")
        if self.synchronous:
            # set once the replica is a copy (a promoted replica waiting for a standby of
            # its own would acknowledge no commit at all), and the replica runs: until a
            # synchronous standby answers, the primary acknowledges no commit
            self.primary.sql(
                f"ALTER SYSTEM SET synchronous_standby_names = 'FIRST 1 ({REPLICA_NAME})'",
                database="postgres",
            )
            self.primary.sql("SELECT pg_reload_conf()", database="postgres")
        wanted = "sync" if self.synchronous else "async"
        wait_until(
            lambda: (
                self.primary.sql(
                    "SELECT sync_state FROM pg_stat_replication WHERE state = 'streaming'"
                    f" AND application_name = '{REPLICA_NAME}'",
                    database="postgres",
                )
                == [(wanted,)]
            ),
            timeout=60,
            interval=0.05,
            message=f"the replica to stream ({wanted})",
        )
        return self

    def url(self) -> str:
        """The store's URL: both hosts, libpq picks the one that accepts writes."""
        return (
            f"postgresql+psycopg://postgres@/{DATABASE}"
            f"?host=127.0.0.1:{self.primary.port}&host=127.0.0.1:{self.replica.port}"
            "&target_session_attrs=read-write"
        )

    def cut_replication(self) -> None:
        """Stop the replica from receiving anything more (asynchronous pair, ``proxied``):
        commits the primary acknowledges from now on exist on the primary only."""
        assert self.proxy is not None, "made without proxied=True"
        self.proxy.cut()

    def promote(self) -> None:
        """Promote the replica to primary (``pg_ctl promote``, waiting until it accepts
        writes)."""
        self.run("pg_ctl", "-D", str(self.replica.data), "-w", "promote")

    def remove(self) -> None:
        """Stop both servers and delete their directory."""
        try:
            for cluster in (self.replica, self.primary):
                cluster.stop()
                pid = cluster.postmaster_pid
                if pid is not None and _alive(pid):
                    cluster.kill()
        finally:
            if self.proxy is not None:
                self.proxy.close()
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> ReplicatedPostgres:
        try:
            return self.create()
        except BaseException:
            self.remove()
            raise

    def __exit__(self, *exc: object) -> None:
        self.remove()
