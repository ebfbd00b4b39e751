"""The reaper run by beat: a whole node lost while the workers' embedded reaper is off.

With ``lease_embedded_reaper = False`` the beat entry ``celery_lease.reap`` is the only
thing that sweeps: a real ``celery beat`` process sends it every
``lease_reaper_interval``, a surviving worker runs it, and the dead node's lease
expires once its heartbeat is a TTL old. Nothing else can recover the task here: the
whole worker is killed (no pool-child fast path) and never restarted (no start-up
path), so the audit row of the expiry names the beat reaper.
"""

from __future__ import annotations

import signal
import socket

import pytest

from celery_lease import State

from .support import RECOVERED, LeaseEnv, Stopwatch, released, report

TTL = 1.0
INTERVAL = 0.5
#: Beyond TTL + interval: beat's start, a survivor busy with a sweep, a slow CI machine.
MARGIN = 30.0


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [
        pytest.param("redis", "sqlite", id="redis-sqlite"),
        pytest.param("amqp", "postgresql", id="amqp-postgresql", marks=pytest.mark.postgres),
    ],
    indirect=True,
)
def test_beat_reaper_recovers_a_lost_node_with_the_embedded_reaper_off(
    lease_env: LeaseEnv, broker_url: str
) -> None:
    p = lease_env.project(
        broker_url=broker_url, ttl=TTL, reaper_interval=INTERVAL, embedded_reaper=False
    )
    workers = [p.worker("a"), p.worker("b")]
    beat = p.project.beat()
    beat.wait_ready(timeout=60)
    gate = p.gates.hold("gate")
    with released(p.gates, gate):
        task_id = p.submit("t.work", "k", gate)
        running = p.wait_state(task_id, State.RUNNING)
        by_incarnation = {p.incarnation(w): w for w in workers}
        victim = by_incarnation.pop(str(running.owner))
        (survivor,) = by_incarnation.values()
        victim.kill_group(signal.SIGKILL)
        clock = Stopwatch()
        victim.wait_group_gone()
    rec = p.wait_state(task_id, State.SUCCEEDED, timeout=TTL + INTERVAL + MARGIN)
    report(f"lost node (TTL {TTL} s, beat every {INTERVAL} s) -> SUCCEEDED", clock.lap())

    assert beat.is_alive() and survivor.is_alive()
    assert rec.owner == p.incarnation(survivor) and rec.attempt == 2
    assert rec.result == {"key": "k", "node": survivor.nodename}
    assert [e.payload for e in lease_env.external.effects("done:k")] == [survivor.nodename]
    assert p.trail(task_id) == RECOVERED
    expiry = p.store.history(task_id)[2]
    assert (expiry.from_state, expiry.to_state) == (State.RUNNING, State.TIMEOUT)
    assert expiry.actor == f"beat:{socket.gethostname()}"
    assert expiry.reason is not None and "heartbeat older than the TTL" in expiry.reason
    assert "celery_lease.reap" in beat.log_text()  # beat sent the entry
    assert "TypeError" not in survivor.log_text()
