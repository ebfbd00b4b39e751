"""A user's app, as the testing kit sees one: a real module, leased tasks, steps.

Its store URL points nowhere on purpose: the kit must give each test its own store.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

from celery_lease import LeasedTask
from celery_lease.testing import side_effects

app = Celery(
    "kitapp", broker=os.environ.get("CELERY_LEASE_TEST_REDIS_URL", "redis://127.0.0.1:6379/9")
)
app.conf.update(
    lease_database_url="sqlite:////nonexistent/kitapp-store-must-not-be-used.sqlite3",
    task_default_queue="kitapp-must-not-be-used",
    worker_prefetch_multiplier=1,
)


def hold(gate: str | None) -> None:
    """Block while the file ``gate`` exists (the test holds the task there)."""
    while gate is not None and os.path.exists(gate):
        time.sleep(0.02)


@app.task(base=LeasedTask, bind=True, name="kit.pay")
def pay(self: LeasedTask, order: int, gate: str | None = None) -> dict[str, Any]:
    fx = side_effects()
    fx.call("attempt", payload=order)  # every attempt that reached the body
    key = self.idempotency_key("reserve")
    self.step("reserve", fx.call, "reserve", key=key, idempotent=True)
    hold(gate)
    self.step("charge", fx.call, "charge", payload=order)  # not idempotent
    return {"order": order}


@app.task(base=LeasedTask, bind=True, name="kit.other")
def other(self: LeasedTask) -> str:
    # the same step name as kit.pay: a point armed for kit.pay must not hit it
    self.step("charge", side_effects().call, "other-charge")
    return "ok"


@app.task(base=LeasedTask, bind=True, name="kit.double")
def double(self: LeasedTask) -> str:
    # declared idempotent, yet calls without a key: a re-run repeats the effect
    self.step("send", side_effects().call, "send", idempotent=True)
    return "sent"


@app.task(base=LeasedTask, bind=True, name="kit.notify")
def notify(self: LeasedTask, order: int, by_task: bool) -> str:
    # the stand-in deduplicates on the key: one built from the arguments is shared by
    # every task sent with those arguments, one from idempotency_key() by one task's attempts
    key = self.idempotency_key("notify") if by_task else f"notify:{order}"
    self.step("notify", side_effects().call, "notify", key=key, idempotent=True)
    return "notified"
