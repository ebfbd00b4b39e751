"""Reconciliation: the RUNNING rows a worker owns against the tasks it has in hand.

A task's lease lives as long as its owner's heartbeat, and the heartbeat is one per
worker: a RUNNING row whose execution ended here without its outcome reaching the row
stays RUNNING for as long as the worker lives, and no reaper ever expires it. That
happens when the outcome is lost after it was acknowledged: an asynchronous replica
promoted without the last commits (``scripts/failover_window.py``), a backup restored
by an operator, a bug. So every ``ROUND_EVERY`` heartbeat intervals the service thread
(:mod:`.service`) compares:

1. the rows this incarnation owns, RUNNING and claimed longer ago than their own lease
   TTL (database time: ``started_at``), read first, in one statement on the partial
   index of RUNNING rows by owner (:meth:`~celery_lease.store.Store.owned_past_ttl`);
2. then what the worker has in hand, read after the rows: the deliveries Celery holds in
   this process (reserved, accepted, running in a pool process or a thread, scheduled:
   ``celery.worker.state``), the outcomes its writer has not written yet (what
   the children sent is read first), and, only for the rows none of those explains,
   the claims its lease agent made ahead and has not handed over or is giving back.

A row owned and not in hand in two rounds in a row, with the same attempt, is given
back through the worker's fenced expiry (owner and attempt, as for a pool child lost):
TIMEOUT, then the policy's decision (retried when safe; WAIT_MANUAL when a
non-idempotent step's outcome is unknown, or over ``max_recoveries``), with the reason
in the audit trail.

Why an execution that runs, or whose outcome is on its way, is never given back:

- every claim follows Celery's reservation of the delivery in this process (the lease
  agent claims ahead only deliveries the main process told it it reserved; a pool
  process claims its own delivery as it starts), and Celery keeps the request in
  its state until it is ready; a claim made ahead whose delivery Celery dropped is
  the agent's to give back (it answers for it meanwhile);
- a prefork pool process hands its outcome to the writer before Celery's main process
  learns the task is ready: read in this order (rows, then requests, then the writer),
  an outcome is either written before the rows were read (the row is no longer
  RUNNING), or in the request's place when the hand is read; a full writer buffer (the
  channel may hold more) makes the round unknown, and an unknown round counts for
  nothing. A written-through outcome (a thread of the threads pool, the solo pool,
  ``lease_outcome_write_through``, follow-ups) is committed before the request is
  ready;
- the windows in which a running execution is in none of these places (Celery's main
  process reads a prefork child's acceptance after the child claimed, say) last
  milliseconds; a row is judged only once it is older than its lease TTL and missing
  from two rounds ``ROUND_EVERY`` heartbeat intervals apart, and the expiry is fenced
  by the attempt seen in both, so a later claim of the same task is never touched;
- a worker that fenced itself (its heartbeat lapsed) does not reconcile: the heartbeat's
  recovery expires all it holds; a database that does not answer ends the round.

One limit, in Celery rather than here: after a lost broker connection Celery's prefork
pool forgets a job a pool process had received and not yet acknowledged, and that
process runs it all the same, unknown to the main process. Such an execution, if it
still runs one TTL and two rounds later, has its lease given back like a lost outcome:
its next write is fenced off and the policy decides, as for a self-fenced worker.
"""

from __future__ import annotations

import logging

from celery.worker import state as worker_state

from ..._incarnation import Incarnation
from ...store import Expiry, Store
from .agent import LeaseAgent
from .outcome_writer import OutcomeWriter

logger = logging.getLogger("celery_lease.worker")

#: Heartbeat intervals between two rounds of reconciliation.
ROUND_EVERY = 3
#: Most rows asked about in one round (a worker owns about as many as it runs).
_MOST = 1000
#: Tries at reading Celery's requests while the event loop changes them.
_READS = 3


def in_hand(outcomes: OutcomeWriter | None) -> set[str] | None:
    """The task ids this worker's main process has in hand: Celery's requests, then the
    outcomes its writer holds (read in that order: see the module's text). ``None``:
    unknown this round."""
    hand: set[str] | None = None
    for _ in range(_READS):
        try:
            # ``requests`` is copied in one C call (a dict of str keys). The request sets
            # are read too: a duplicate delivery of a task that runs here, dropped at
            # its claim, takes the task's id out of ``requests`` while the first copy
            # still runs
            hand = set(list(worker_state.requests))
            hand.update(r.id for r in list(worker_state.active_requests))
            hand.update(r.id for r in list(worker_state.reserved_requests))
            break
        except RuntimeError:  # a set changed while it was read (the event loop): again
            hand = None
    if hand is None:
        return None
    if outcomes is not None:
        buffered = outcomes.in_hand()
        if buffered is None:
            return None
        hand |= buffered
    return hand


class Reconciler:
    """The rounds of one worker incarnation; run by the service thread only."""

    def __init__(self, store: Store, incarnation: Incarnation) -> None:
        self.store = store
        self.incarnation = incarnation
        #: Rows owned and not in hand at the last round: task id -> attempt.
        self._suspects: dict[str, int] = {}
        #: Leases given back so far.
        self.given_back = 0

    def round(self, outcomes: OutcomeWriter | None, agent: LeaseAgent | None) -> list[Expiry]:
        """One round: give back the leases owned and not in hand now and at the last
        round (same attempt). Raises :class:`~celery_lease.exceptions.StoreError`
        (the round ends; its findings count for nothing)."""
        inc = self.incarnation
        if inc.flags.fenced:
            self._suspects = {}
            return []
        owned = self.store.owned_past_ttl(inc.id, limit=_MOST)
        if not owned:
            self._suspects = {}
            return []
        hand = in_hand(outcomes)
        if hand is None:
            return []
        missing = {task_id: attempt for task_id, attempt in owned if task_id not in hand}
        if missing and agent is not None:
            held = agent.holds(list(missing))
            if held is None:
                return []
            for task_id in held:
                missing.pop(task_id, None)
        confirmed = [(t, a) for t, a in missing.items() if self._suspects.get(t) == a]
        self._suspects = missing
        expired: list[Expiry] = []
        for task_id, attempt in confirmed:
            reason = (
                f"owned by worker {inc.nodename} but not running there (attempt {attempt} "
                "not in its hand in two checks: its outcome was lost or never written)"
            )
            found = self.store.expire(
                actor=inc.actor,
                reason=reason,
                task_ids=[task_id],
                owners=[inc.id],
                attempt=attempt,
                only_expired=False,
            )
            del self._suspects[task_id]
            for expiry in found:
                self.given_back += 1
                logger.warning(
                    "task %s attempt %d: RUNNING under worker %s, which no longer runs it "
                    "(outcome lost?): lease given back, now %s (%s)",
                    task_id,
                    attempt,
                    inc.nodename,
                    expiry.to_state.value,
                    expiry.reason,
                )
            expired.extend(found)
        return expired


__all__ = ["ROUND_EVERY", "Reconciler", "in_hand"]
