"""The lease agent: claims in batches, in a process of their own.

Each pool process used to claim its delivery itself as it started: one statement and
one commit per task on the task's critical path. A thread of the worker's main process
could claim ahead in batches instead, but on Redis that process is already Celery's
bottleneck (its event loop), and the thread's wake-ups slowed the worker down. The
agent is a small process, forked by the worker's bootstep before the pool forks, that
owns the claims:

- the worker's main process tells it each delivery it reserves (one non-blocking
  send per delivery, nothing else: no thread of the main process wakes up for it),
  each one Celery drops before it runs (revoked, expired) and, once a second, which
  deliveries it still holds;
- the main process's reconciliation (:mod:`.reconcile`) asks it, only about rows the
  worker owns and cannot otherwise explain, which of them it holds a claim of (made
  ahead and not handed over, or being given back): those are its to give back;
- it claims the deliveries that start next together, in one statement
  (:meth:`~celery_lease.store.Store.claim_many`): one round of them (as many as there
  are pool processes, which take them as the running tasks end) and beyond that as
  many as the worker starts within ``claim_ahead_window`` (1 s) at its recent rate;
- a pool process (a thread of the threads pool, the solo worker) asks it for its
  delivery's claim as the task starts, before any of the task's code runs
  (:func:`~celery_lease.worker.protocol.ask_claim`): the claim made ahead at once, or
  one made then, together with the other asks that arrived meanwhile; the answer "not
  claimed" sends the pool process to its own claim, which adopts a message without a
  row, drops a copy, publishes an early delivery again or holds a paused one, as it
  always did.

What a row claimed ahead changes, and the rules that keep it safe:

- a claim made ahead is RUNNING while its delivery waits for a pool process, so tasks
  with ``max_runtime`` (the wait would count against their limit) and tasks whose
  ``on_timeout`` is ``'manual'`` (a lost worker would hand a person a run that never
  began) are never claimed ahead: their pool processes claim them at start; nor are
  tasks with a concurrency limit (a slot held by a delivery waiting for a pool
  process would be a slot no one runs in);
- a claim whose delivery will not start here is given back
  (:meth:`~celery_lease.store.Store.unclaim`, fenced by owner, attempt and token): its
  lease ends and the row is retried at once with no recovery counted (none of its
  code ran), the reaper publishing it again: a claim made for a
  delivery the main process no longer holds after ``_STRANDED_AFTER`` seconds (a lost
  broker connection clears the worker's reservations), one whose pool process stopped
  waiting for the answer, and every claim not handed over when the worker stops (its
  deliveries go back to the broker, and a copy that arrives before the retry is
  dropped). A delivery Celery drops because it was revoked or expired is cancelled
  instead;
- a worker that fenced itself claims nothing, and the claims made before the fence
  are forgotten (the heartbeat's recovery expires them with the worker's other
  leases): their pool processes claim for themselves;
- the database not answering: the asks are answered "not claimed" and the pool
  processes claim for themselves (and fail as they always did, which expires or
  publishes again once the database answers);
- the agent lost (killed): the main process sees it within a second and stops the
  worker as a warm shutdown does (the tasks running finish, their outcomes are
  written); the claims the agent made and never handed over expire with the worker's
  other leases when it stops, and are retried, none of their code having run (the
  only case where a claim made ahead costs an attempt). A pool process that asks
  meanwhile claims for itself: a row the agent claimed is refused (RUNNING) and its
  delivery dropped; the expiry at the stop publishes it again.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import select
import selectors
import signal
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from celery.worker import state as worker_state

from ..._incarnation import Incarnation
from ..._runtime import Runtime
from ...exceptions import StoreError
from ...producer.message import revision_of
from ...states import State
from ...store import Claim, Lease
from .. import protocol

logger = logging.getLogger("celery_lease.worker")

#: Seconds a claim made ahead may wait for its pool process before the agent checks
#: that the main process still holds the delivery.
_STRANDED_AFTER = 5.0
#: Seconds over which the rate of starts is measured.
_RATE_SPAN = 2.0
#: Longest the agent sleeps without looking at its parent and the fence.
_IDLE = 0.2
#: Longest a delivery in the window waits to be claimed with others, while as many
#: claims made ahead wait as there are pool processes.
_GATHER = 0.05
#: Most deliveries named in one report of what the main process holds.
_HELD_REPORT_MAX = 4000
#: Longest the main process waits for the agent's answer to :meth:`LeaseAgent.holds`.
_HOLDS_WAIT = 1.0

QUEUED, CLAIMED, UNCLAIMED = "queued", "claimed", "unclaimed"

#: The agent's process name (``/proc/PID/comm``, what ``ps`` and ``top`` show):
#: the testing kit tells it from the pool processes by it.
AGENT_NAME = "lease-agent"


def _name_process(name: str) -> None:
    """Set this process's name as ``ps`` shows it (Linux; elsewhere nothing)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME


@dataclasses.dataclass
class _Entry:
    """A reserved delivery the agent may claim ahead."""

    task_id: str
    name: str
    queue: str | None
    status: str = QUEUED
    claim: Claim | None = None
    reserved_at: float = dataclasses.field(default_factory=time.monotonic)
    #: Reports of the main process in a row that did not name the delivery.
    missing: int = 0


# -- the worker's main process ------------------------------------------------------------


class LeaseAgent:
    """The main process's side of the agent: forks it, tells it what the worker
    reserves and drops, and notices when it is gone."""

    def __init__(self, rt: Runtime, inc: Incarnation, concurrency: int) -> None:
        self.rt = rt
        self.inc = inc
        self.address = protocol.agent_address(inc)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(self.address)
        listener.listen(128)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        life_r, life_w = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the agent
            code = 0
            try:
                mine.close()
                os.close(life_r)
                _Agent(rt, inc, max(1, concurrency), listener, theirs, parent).serve()
            except BaseException:
                logger.exception("celery-lease: lease agent failed")
                code = 70
            finally:
                os._exit(code)
        listener.close()
        theirs.close()
        os.close(life_w)
        mine.setblocking(False)
        self.pid = pid
        self._sock = mine
        #: readable (end of file) once the agent is gone: it holds the only writing end
        self._life = life_r
        self.gone = False
        self._takes: dict[str, bool] = {}
        #: the questions of :meth:`holds` asked so far (each answer names its own)
        self._asked = 0
        protocol.use_agent(rt.app, self.address)
        logger.info("celery-lease: worker %s: lease agent started (pid %d)", inc.nodename, pid)

    def _send(self, *fields: str) -> None:
        if self.gone:
            return
        with contextlib.suppress(OSError):  # full or gone: the pool process claims
            self._sock.send("\x1f".join(fields).encode())

    def takes(self, task: Any) -> bool:
        """Whether deliveries of ``task`` may be claimed ahead (see the module's text)."""
        name = task.name
        takes = self._takes.get(name)
        if takes is None:
            takes = False
            if hasattr(task, "lease_options"):
                options = task.lease_options(self.rt.config)
                takes = (
                    options.max_runtime is None
                    and options.on_timeout == "retry"
                    # a limited task takes its slot in its own claim, at its start
                    and options.concurrency_limit is None
                )
            self._takes[name] = takes
        return takes

    def reserved(self, request: Any) -> None:
        """Celery reserved ``request`` (the main process's event loop: one send). A
        message with a revision (its task's arguments were replaced) is claimed by its
        pool process, which checks the revision."""
        if self.takes(request.task) and revision_of(request.request_dict) is None:
            queue = (request.delivery_info or {}).get("routing_key") or ""
            self._send("R", request.id, request.name, queue)

    def dropped(self, task_id: str, why: str) -> None:
        """Celery dropped the delivery of ``task_id`` before it ran (revoked, expired):
        a claim made ahead for it goes back to the lease, cancelled."""
        self._send("D", task_id, why)

    def report_held(self) -> None:
        """Tell the agent which deliveries the worker still holds (the service thread,
        once a second): a claim made for one it dropped goes back to the lease."""
        # stamped with the time it was taken (the monotonic clock is the machine's, the
        # same in the agent): the agent judges by it, not by when it reads the report,
        # so a report read late never makes a delivery reserved since look dropped
        at = time.monotonic()
        ids = [r.id for r in list(worker_state.reserved_requests)]
        if len(ids) <= _HELD_REPORT_MAX:
            self._send("S", repr(at), "\x1e".join(ids))

    def holds(self, task_ids: Sequence[str]) -> set[str] | None:
        """Which of ``task_ids`` the agent holds a claim of: made ahead and not handed
        over to a pool process, or being given back (the service thread, for the
        worker's reconciliation, only when some row it owns is not in its hand).
        ``None``: no answer within ``_HOLDS_WAIT`` (the agent is in a statement) or
        the agent is gone: unknown."""
        if self.gone:
            return None
        self._asked += 1
        seq = str(self._asked)
        try:
            self._sock.send("\x1f".join(("H", seq, "\x1e".join(task_ids))).encode())
        except OSError:
            return None
        deadline = time.monotonic() + _HOLDS_WAIT
        while (left := deadline - time.monotonic()) > 0:
            readable, _, _ = select.select([self._sock], [], [], left)
            if not readable:
                break
            try:
                data = self._sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return None
            if not data:
                return None
            fields = data.decode().split("\x1f")
            if len(fields) == 3 and fields[0] == "h" and fields[1] == seq:
                return set(fields[2].split("\x1e")) if fields[2] else set()
            # the answer to an earlier question, read late: dropped
        return None

    def check(self) -> bool:
        """Whether the agent is still there (the service thread, once a second). Gone,
        the worker stops as a warm shutdown does (see the module's text)."""
        if self.gone:
            return False
        readable, _, _ = select.select([self._life], [], [], 0)
        if not readable:
            return True
        self.gone = True
        protocol.use_agent(self.rt.app, None)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, os.WNOHANG)
        logger.critical(
            "celery-lease: worker %s: the lease agent (pid %d) is gone; the worker stops "
            "(warm shutdown): the claims it made ahead expire when it stops, and are retried",
            self.inc.nodename,
            self.pid,
        )
        worker_state.should_stop = 70  # type: ignore[assignment]  # EX_SOFTWARE: a warm stop
        return False

    def stop(self) -> None:
        """Claim nothing more (at shutdown): the agent exits. Claims made ahead for
        deliveries that never reached a pool process expire with the worker's other
        leases as it stops."""
        protocol.use_agent(self.rt.app, None)
        if not self.gone:
            self._send("Q")
            self.gone = True
            deadline = time.monotonic() + self.rt.config.db_timeout + 1.0
            while time.monotonic() < deadline:
                with contextlib.suppress(ChildProcessError):
                    if os.waitpid(self.pid, os.WNOHANG)[0]:
                        break
                time.sleep(0.01)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
        for close in (self._sock.close, lambda: os.close(self._life)):
            with contextlib.suppress(OSError):
                close()


def start_for(worker: Any, agent: LeaseAgent) -> None:
    """Tell ``agent`` every delivery ``worker`` reserves: wraps the consumer's
    ``on_task_request`` before the consumer starts (Celery's task strategies take it
    when they are made)."""
    consumer = getattr(worker, "consumer", None)
    if consumer is None:
        return
    on_task_request = consumer.on_task_request

    def reserve_then_request(request: Any) -> Any:
        agent.reserved(request)
        return on_task_request(request)

    consumer.on_task_request = reserve_then_request


# -- the agent's process ------------------------------------------------------------------


class _Agent:
    """The agent's loop: one thread, one database connection (the store's pool)."""

    def __init__(
        self,
        rt: Runtime,
        inc: Incarnation,
        concurrency: int,
        listener: socket.socket,
        main: socket.socket,
        parent: int,
    ) -> None:
        threading.current_thread().name = "celery-lease-agent"
        _name_process(AGENT_NAME)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGUSR1):
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, signal.SIG_IGN)  # the main process says when to stop
        self.rt = rt
        self.inc = inc
        self.store = rt.store
        cfg = rt.config
        self.concurrency = concurrency
        self.batch_size = cfg.claim_batch_size
        self.interval = cfg.claim_interval
        self.window = cfg.claim_ahead_window
        #: the heartbeat's interval: no claim too close to its deadline
        self.margin = cfg.heartbeat_interval
        self.parent = parent
        self.listener = listener
        self.main = main
        self.sel = selectors.DefaultSelector()
        listener.setblocking(False)
        main.setblocking(False)
        self.sel.register(listener, selectors.EVENT_READ, "accept")
        self.sel.register(main, selectors.EVENT_READ, "main")
        #: Reserved deliveries by task id, in the order the worker reserved them.
        self.entries: dict[str, _Entry] = {}
        #: Asks waiting for a claim: (the pool process's connection, task id).
        self.asks: list[tuple[socket.socket, str]] = []
        #: Claims to give back: (the claim, reason, cancel).
        self.give_back: list[tuple[Claim, str, bool]] = []
        self.starts: collections.deque[float] = collections.deque()
        self.gather_until = 0.0
        self.stopping = False
        self.failing = False

    def serve(self) -> None:
        while not self.stopping:
            timeout = _IDLE
            if self.gather_until:
                timeout = min(_IDLE, max(0.0, self.gather_until - time.monotonic()))
            ready = self.sel.select(timeout)
            # the main process's messages first: a delivery's "reserved" is sent before
            # Celery hands the delivery to a pool process, so it is in this socket by the
            # time the pool process's ask is: read in that order, an ask never finds its
            # delivery unknown (answered "claim it yourself") while the claim made
            # ahead for it is still to come, and then stranded
            self._read(self.main, "main")
            for key, _ in ready:
                if key.data == "accept":
                    self._accept()
                elif key.data != "main":
                    self._read(key.fileobj, key.data)  # type: ignore[arg-type]
            if os.getppid() != self.parent:
                break  # the worker's main process is gone: so are its reservations
            if self.inc.flags.fenced:
                self._forget_claims()
            self._answer()
            if self._due():
                self._claim_batch()
                self._answer()
            if self.give_back:
                self._give_back()
        self._give_back_all()

    # -- messages ------------------------------------------------------------------------

    def _accept(self) -> None:
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while True:
                conn, _ = self.listener.accept()
                conn.setblocking(False)
                self.sel.register(conn, selectors.EVENT_READ, "pool")

    def _read(self, sock: socket.socket, who: str) -> None:
        while True:
            try:
                data = sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self._closed(sock, who)
                return
            fields = data.decode().split("\x1f")
            try:
                self._message(sock, fields)
            except (IndexError, ValueError) as bad:  # never from our own processes
                logger.error("celery-lease: lease agent: unreadable message dropped: %s", bad)

    def _closed(self, sock: socket.socket, who: str) -> None:
        if who == "main":
            return  # the pool processes hold copies of it: the parent check decides
        self.sel.unregister(sock)
        sock.close()
        mine = [a for a in self.asks if a[0] is sock]
        self.asks = [a for a in self.asks if a[0] is not sock]
        for _, task_id in mine:  # the pool process is gone (killed while asking)
            self._abandon(task_id, "its pool process stopped waiting for the claim")

    def _message(self, sock: socket.socket, fields: list[str]) -> None:
        kind = fields[0]
        if kind == "A":
            self.asks.append((sock, fields[1]))
            self._record_start()
        elif kind == "R":
            task_id = fields[1]
            if task_id not in self.entries:
                self.entries[task_id] = _Entry(task_id, fields[2], fields[3] or None)
        elif kind == "X":
            self._abandon(fields[1], "its pool process stopped waiting for the claim")
        elif kind == "D":
            entry = self.entries.pop(fields[1], None)
            if entry is not None and entry.claim is not None:
                self._back(entry, fields[2], cancel=True)
        elif kind == "S":
            self._held(float(fields[1]), set(fields[2].split("\x1e")) if fields[2] else set())
        elif kind == "H":
            holding = self._holding(fields[2].split("\x1e") if fields[2] else [])
            with contextlib.suppress(OSError):  # gone, or not reading: it stops waiting
                self.main.send("\x1f".join(("h", fields[1], "\x1e".join(holding))).encode())
        elif kind == "Q":
            self.stopping = True

    def _holding(self, task_ids: list[str]) -> list[str]:
        """Those of ``task_ids`` whose claim the agent holds: made ahead and not handed
        over, or to be given back."""
        mine = {e.task_id for e in self.entries.values() if e.claim is not None}
        mine.update(claim.lease.task_id for claim, _, _ in self.give_back)
        return [task_id for task_id in task_ids if task_id in mine]

    def _abandon(self, task_id: str, why: str) -> None:
        self.asks = [a for a in self.asks if a[1] != task_id]
        entry = self.entries.pop(task_id, None)
        if entry is not None and entry.claim is not None:
            self._back(entry, f"claimed ahead, and {why}", cancel=False)

    def _held(self, at: float, held: set[str]) -> None:
        """Give back the claims of deliveries the main process no longer held at ``at``
        (when it took the report): only those it had reserved well before then."""
        asked = {task_id for _, task_id in self.asks}
        for task_id, entry in list(self.entries.items()):
            if task_id in held or task_id in asked:
                entry.missing = 0
                continue
            if at - entry.reserved_at <= _STRANDED_AFTER:
                continue
            # missing from two reports in a row (a second apart): a delivery Celery
            # dropped as revoked or expired leaves the reservations just before the main
            # process says so ("D"), which a report taken in between must not overtake
            entry.missing += 1
            if entry.missing < 2:
                continue
            del self.entries[task_id]
            if entry.claim is not None:
                self._back(entry, "claimed ahead, and the worker no longer holds its delivery")

    def _back(self, entry: _Entry, reason: str, *, cancel: bool = False) -> None:
        assert entry.claim is not None
        self.give_back.append((entry.claim, reason, cancel))

    def _forget_claims(self) -> None:
        """Fenced: the heartbeat's recovery expires every lease of the worker, these
        with them; none is handed over (their pool processes claim for themselves)."""
        for task_id, entry in list(self.entries.items()):
            if entry.status != QUEUED:
                del self.entries[task_id]

    def _record_start(self) -> None:
        now = time.monotonic()
        self.starts.append(now)
        while self.starts and self.starts[0] < now - _RATE_SPAN:
            self.starts.popleft()

    # -- claims --------------------------------------------------------------------------

    def _answer(self) -> None:
        """Answer the asks whose delivery is decided: its claim, or "claim it yourself"."""
        waiting: list[tuple[socket.socket, str]] = []
        fenced = self.inc.flags.fenced
        for sock, task_id in self.asks:
            entry = self.entries.get(task_id)
            if entry is not None and entry.status == QUEUED and not fenced:
                waiting.append((sock, task_id))
                continue
            self.entries.pop(task_id, None)
            claim = entry.claim if entry is not None and not fenced else None
            try:
                sock.send(protocol.encode_claim(claim))
            except OSError:
                if claim is not None:
                    assert entry is not None
                    self._back(entry, "claimed ahead, and its pool process could not be told")
        self.asks = waiting

    def _due(self) -> bool:
        """Whether to claim now: a pool process waits for a delivery not claimed yet,
        or deliveries in the window have waited to be gathered: ``claim_interval``
        while fewer claims wait than the pool processes start within twice
        ``_GATHER`` (at least one round), ``_GATHER`` once that cushion is there
        (more claims per statement)."""
        if not self.entries or not self.inc.flags.claimable(self.margin):
            self.gather_until = 0.0  # nothing to claim: sleep until a message comes
            return False
        for _, task_id in self.asks:
            entry = self.entries.get(task_id)
            if entry is not None and entry.status == QUEUED:
                return True
        ahead = self._ahead()
        waiting = claimed = 0
        oldest = 0.0
        for position, entry in enumerate(self.entries.values()):
            if entry.status == CLAIMED:
                claimed += 1
            elif entry.status == QUEUED and position < ahead:
                waiting += 1
                oldest = entry.reserved_at if not oldest else min(oldest, entry.reserved_at)
        if not waiting:
            self.gather_until = 0.0
            return False
        if waiting >= self.batch_size:
            return True
        # gather longer only while the claims waiting outlast the gathering: at a high
        # rate of starts the pool processes would otherwise ask for deliveries not
        # claimed yet, and wait for their claims
        cushion = self.concurrency + int(len(self.starts) / _RATE_SPAN * _GATHER * 2)
        wait = self.interval if claimed < cushion else _GATHER
        self.gather_until = oldest + wait
        return time.monotonic() >= self.gather_until

    def _ahead(self) -> int:
        # one round ahead (as many as there are pool processes: they start as the
        # running tasks end), and beyond that as many as the worker starts within the
        # window
        return max(self.concurrency, int(len(self.starts) / _RATE_SPAN * self.window))

    def _claim_batch(self) -> None:
        self.gather_until = 0.0
        ahead = self._ahead()
        asked = {task_id for _, task_id in self.asks}
        batch: list[_Entry] = []
        for position, entry in enumerate(self.entries.values()):
            if len(batch) >= self.batch_size:
                break
            if entry.status == QUEUED and (position < ahead or entry.task_id in asked):
                batch.append(entry)
        if not batch:
            return
        tokens: dict[str, _Entry] = {}
        for entry in batch:
            if self._paused(entry):
                entry.status = UNCLAIMED  # its pool process decides (holds it)
            else:
                tokens[uuid.uuid4().hex] = entry
        claims: dict[str, Claim] = {}
        if tokens and not self.inc.flags.claimable(self.margin):
            # fenced since the batch was chosen: claim nothing (the pool processes
            # publish their deliveries again, due after the heartbeat recovers)
            for entry in tokens.values():
                entry.status = QUEUED
            return
        if tokens:
            try:
                claims = self.store.claim_many(
                    [(entry.task_id, token) for token, entry in tokens.items()],
                    self.inc.id,
                    self.inc.actor,
                )
                if self.failing:
                    logger.warning("celery-lease: lease agent: the database answers again")
                self.failing = False
            except StoreError as error:
                if not self.failing:
                    logger.warning(
                        "celery-lease: lease agent: %d deliveries not claimed ahead (%s): "
                        "their pool processes claim them",
                        len(tokens),
                        error,
                    )
                self.failing = True
            except Exception:
                logger.exception("celery-lease: claims ahead failed; pool processes claim")
        for token, entry in tokens.items():
            entry.claim = claims.get(token)
            entry.status = CLAIMED if entry.claim is not None else UNCLAIMED

    def _paused(self, entry: _Entry) -> bool:
        try:
            return self.rt.pauses.match(self.store, entry.name, entry.queue) is not None
        except Exception:  # unknown (the database, or anything): the pool process decides
            return True

    def _give_back(self) -> None:
        """Give back the claims made ahead whose deliveries will not run here (none of
        their code ran): retried at once, no recovery counted
        (:meth:`~celery_lease.store.Store.unclaim`); cancelled instead when Celery
        dropped a revoked or expired delivery. Kept while the database does not
        answer."""
        kept: list[tuple[Claim, str, bool]] = []
        inc = self.inc
        for claim, reason, cancel in self.give_back:
            lease = claim.lease
            try:
                if cancel:
                    self.store.request_cancel(
                        lease.task_id, actor=inc.actor, reason=reason, keep_earlier=True
                    )
                    done = self._expire(lease, reason)
                else:
                    # a cancel requested meanwhile (or the row moved on): the lease's
                    # expiry decides, as for a lost run
                    done = self.store.unclaim(lease, inc.id, inc.actor, reason)
                    done = done or self._expire(lease, reason)
                if not done and self._still_held(lease):
                    # the expiry skips a row another transaction has locked (the main
                    # process recording the same revoke, say): tried again next round
                    kept.append((claim, reason, cancel))
            except StoreError:
                kept.append((claim, reason, cancel))
            except Exception:
                logger.exception(
                    "celery-lease: lease agent: claim of %s not given back", lease.task_id
                )
        self.give_back = kept

    def _expire(self, lease: Lease, reason: str) -> bool:
        inc = self.inc
        expired = self.store.expire(
            actor=inc.actor,
            reason=reason,
            task_ids=[lease.task_id],
            owners=[inc.id],
            attempt=lease.attempt,
            only_expired=False,
        )
        return bool(expired)

    def _still_held(self, lease: Lease) -> bool:
        """Whether this claim's attempt is still RUNNING under this worker."""
        record = self.store.get(lease.task_id)
        return (
            record is not None
            and record.state is State.RUNNING
            and record.owner == self.inc.id
            and record.attempt == lease.attempt
        )

    def _give_back_all(self) -> None:
        """The worker stops: give back every claim made ahead not handed over yet (a
        warm shutdown leaves their deliveries to the broker: their rows must not wait
        RUNNING for a lease that expires as a crash's would, counting a recovery).
        What the database does not take now expires with the worker's other leases."""
        for entry in self.entries.values():
            if entry.claim is not None:
                self._back(entry, "claimed ahead, and the worker stopped before it started")
        self.entries.clear()
        self._give_back()
        if self.give_back:
            logger.warning(
                "celery-lease: lease agent: %d claims made ahead not given back (the "
                "database does not answer): they expire with the worker's leases",
                len(self.give_back),
            )


__all__ = ["LeaseAgent", "start_for"]
