"""The demo's Celery project: ``python -m celery_lease.demo`` runs workers of it.

Broker: kombu's filesystem transport (a folder); store: a SQLite file; the side
effects' counter: another SQLite file. All three live in the data directory that
``CELERY_LEASE_DEMO_DATA`` names (default ``./demo-data``): no server. To look at a
task after a run, from the directory the demo ran in::

    celery -A celery_lease.demo.app lease show <task id>
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from celery import Celery

from celery_lease import LeasedTask
from celery_lease.testing import SideEffects

from ._names import DATA_ENV, STEP_SECONDS_ENV, STEPS

DATA = Path(os.environ.get(DATA_ENV, "demo-data")).resolve()
STEP_SECONDS = float(os.environ.get(STEP_SECONDS_ENV, "0.7"))

# not the current app: importing the demo (its tests do) must not change another
# program's current app
app = Celery("demo_app", broker="filesystem://localhost/", set_as_current=False)
app.conf.update(
    broker_transport_options={
        "data_folder_in": str(DATA / "broker"),
        "data_folder_out": str(DATA / "broker"),
        "polling_interval": 0.05,
    },
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    # Celery waits this long (default 10 s) before reporting a dead pool process, in case
    # it sent its result first; the outcome is in the lease store, so nothing is lost.
    worker_lost_wait=1,
    # celery-lease, with short timings so that the demo is quick
    lease_database_url=f"sqlite:///{DATA / 'lease.sqlite3'}",
    lease_ttl=3,  # default 30
    lease_heartbeat_interval=0.5,  # default 5
    lease_reaper_interval=0.5,  # default 5
    lease_republish_after=4,  # default 60
    lease_publish_grace=1,  # default 10
)


def external() -> SideEffects:
    """The stand-in for a payment API, a mailer...: counts every real side effect."""
    return SideEffects(DATA / "external.sqlite3")


def perform(task_id: str, step: str) -> str:
    """One step's real side effect: slow work, then one effect in the external system."""
    time.sleep(STEP_SECONDS)
    external().call(step, payload=task_id)
    return f"{step}: done"


def already_performed(task_id: str, step: str) -> str | None:
    """Asked on a re-run when a crash hit this step: did the effect happen?"""
    done = any(effect.payload == task_id for effect in external().effects(step))
    return f"{step}: done" if done else None  # None: it did not, run it


@app.task(base=LeasedTask, bind=True, name="demo.process_order")
def process_order(self: LeasedTask, order: int) -> str:
    # demo instrumentation: tells the demo which process runs the order, since when
    external().call("run", payload=self.request.id)
    for step in STEPS:
        self.step(step, perform, self.request.id, step, check=already_performed)
    return f"order {order} done"
