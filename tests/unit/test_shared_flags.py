"""The flags a worker's main process shares with its children: when a claim may be made."""

from __future__ import annotations

import time

from celery_lease._incarnation import SharedFlags


def test_no_claim_close_to_the_heartbeats_deadline() -> None:
    flags = SharedFlags()
    assert flags.claimable(0.5)  # no deadline yet (the heartbeat has not started)
    flags.ttl = 2.0
    # just renewed: the deadline a TTL away
    flags.deadline = time.monotonic() + 2.0
    assert flags.claimable(0.5)
    # a renewal missed: 0.3 s left, less than the heartbeat's interval
    flags.deadline = time.monotonic() + 0.3
    assert not flags.claimable(0.5) and not flags.fenced
    # a renewal due at its interval still leaves room: TTL minus interval, 1.5 s
    flags.deadline = time.monotonic() + 1.4
    assert flags.claimable(0.5)


def test_the_margin_never_exceeds_what_a_heartbeat_on_time_leaves() -> None:
    flags = SharedFlags()
    flags.ttl = 6.0  # an interval of 5 s: a renewal on time leaves 1 s at its lowest
    flags.deadline = time.monotonic() + 1.5
    assert flags.claimable(5.0)
    flags.deadline = time.monotonic() + 0.5
    assert not flags.claimable(5.0)


def test_a_fenced_worker_claims_nothing() -> None:
    flags = SharedFlags()
    flags.ttl = 30.0
    flags.deadline = time.monotonic() + 30.0
    flags.fenced = True
    assert not flags.claimable(5.0)
    flags.fenced = False
    assert flags.claimable(5.0)
