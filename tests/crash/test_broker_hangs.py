"""Crash-point matrix row 33: a broker that accepts connections and never answers.

The broker is a TCP proxy in front of the test's Redis (:class:`tests.crash.faults.TcpProxy`)
that black-holes: connections are accepted, nothing is forwarded either way, as with a
hung server or a dead host behind a live load balancer. Nothing else on the machine is
touched.

- ``.delay()`` returns while the broker hangs: its publish gives up after about
  ``lease_db_timeout`` and leaves the row (the outbox) to the reaper, which publishes
  it once the broker answers again; the task runs once.
- A worker SIGKILLed with a task RUNNING while the broker hangs: the surviving worker's
  reaper expires the lease within the TTL plus a few sweeps, although every publish it
  tries meanwhile hangs; once the broker answers, the task runs once.
"""

from __future__ import annotations

import signal
import threading

import pytest

from celery_lease import State

from ..helpers import wait_until
from .faults import proxy_to_redis
from .support import LeaseEnv, Stopwatch, released, report

#: The generated module reads ``TEST_CONF_<KEY>`` after the project's settings.
BROKER_URL_ENV = "TEST_CONF_BROKER_URL"
#: The bound of the tests' store calls and publishes (the default is 10 s).
DB_TIMEOUT = 2.0


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_delay_returns_while_the_broker_hangs_and_the_reaper_publishes_it_later(
    lease_env: LeaseEnv, redis_url: str
) -> None:
    with proxy_to_redis(redis_url) as proxy:
        through = proxy.broker_url(redis_url)
        p = lease_env.project(broker_url=through, settings={"lease_db_timeout": DB_TIMEOUT})
        p.worker()
        p.drain()  # the worker consumes through the proxy
        before = p.submit("t.add", 1, 1)  # the test's producer connection, in its pool
        p.wait_state(before, State.SUCCEEDED)

        proxy.blackhole()
        submitted: list[str] = []
        clock = Stopwatch()
        producer = threading.Thread(
            target=lambda: submitted.append(p.submit("t.add", 2, 3)), daemon=True
        )
        producer.start()
        producer.join(timeout=10 * DB_TIMEOUT)
        report("hung broker: .delay() returned", clock.lap())
        # before: the call blocked for as long as the broker hung
        assert not producer.is_alive(), ".delay() still blocked on a broker that hangs"
        assert submitted, ".delay() raised instead of leaving the row to the reaper"
        (task_id,) = submitted
        record = p.get(task_id)
        assert record.state is State.PENDING
        assert p.external.count("add") == 2  # drain's and before's

        proxy.resume()
        p.wait_state(task_id, State.SUCCEEDED, timeout=60)
        report("hung broker: resumed -> SUCCEEDED", clock.lap())
        p.drain()  # anything published twice has been received by now
        assert p.get(task_id).attempt == 1
        assert p.external.count("add") == 4  # drain, before, the task, drain


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_row_33_a_dead_workers_lease_expires_while_the_broker_hangs(
    lease_env: LeaseEnv, redis_url: str
) -> None:
    ttl, interval = 1.0, 0.2  # the project's lease_ttl and lease_reaper_interval
    with proxy_to_redis(redis_url) as proxy:
        through = proxy.broker_url(redis_url)
        p = lease_env.project(broker_url=through, settings={"lease_db_timeout": DB_TIMEOUT})
        app = p.module.app
        # the victim runs the task and no reaper; the survivor's reaper is the only one
        victim = p.worker("a", env={"TEST_CONF_LEASE_EMBEDDED_REAPER": "false"})
        gate = p.gates.hold("gate")
        with released(p.gates, gate):
            task_id = p.submit("t.work", "k", gate)
            p.wait_count("start:k", 1)
            survivor = p.worker("b")

            proxy.blackhole()
            # a row only the reaper publishes (written in a bare Connection's transaction):
            # the survivor's reaper is inside a publish to the hung broker when the victim
            # dies, and stops sweeping (the reaper lock it renews every sweep runs out)
            with p.store.engine.begin() as conn:
                waiting = app.tasks["t.add"].apply_async((7, 8), connection=conn)
            wait_until(
                lambda: p.store.try_lock("reaper", "test-probe", 0.01),
                timeout=30,
                message="the survivor's reaper inside a publish to the hung broker",
            )
            victim.kill_group(signal.SIGKILL)
            clock = Stopwatch()
            victim.wait_group_gone()

        def expired() -> bool:
            return ("RUNNING", "TIMEOUT") in p.trail(task_id)

        # the lease expires while the broker hangs: within the TTL, a sweep, and the
        # publish under way giving up (before: never, for as long as the broker hung)
        wait_until(
            expired,
            timeout=ttl + interval + 4 * DB_TIMEOUT + 5.0,
            message="the dead worker's lease expired while the broker hangs",
        )
        report("hung broker: worker killed -> lease expired", clock.lap())
        assert proxy.black_holed, "the broker was still black-holed when the lease expired"
        expiry = next(h for h in p.store.history(task_id) if h.to_state is State.TIMEOUT)
        assert expiry.actor == f"reaper:{survivor.nodename}"
        assert p.external.count("start:k") == 1  # nothing could be published meanwhile

        proxy.resume()
        record = p.wait_state(task_id, State.SUCCEEDED, timeout=60)
        report("hung broker: resumed -> SUCCEEDED", clock.lap())
        assert record.attempt == 2 and record.recoveries == 1
        assert record.result == {"key": "k", "node": survivor.nodename}
        p.wait_state(str(waiting.id), State.SUCCEEDED, timeout=60)
        p.drain()
        assert [e.payload for e in p.external.effects("done:k")] == [survivor.nodename]
        assert p.external.count("add") == 2  # the waiting row and drain's, each once
