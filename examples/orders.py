"""A crash-safe order fulfilment with celery-lease (see docs/howto-crash-safe-tasks.md).

An order is placed and its ``fulfil`` task enqueued in one database transaction. The
task loads the order, charges it through a payment API (idempotency key, plus a
``check`` that looks the charge up after a crash), and ships it. Kill the worker at
any point: a re-run resumes after the last finished step and never charges twice.

Needs Redis (``BROKER_URL``, default ``redis://127.0.0.1:6379/0``). Everything else
lives in SQLite files under ``ORDERS_DATA`` (default ``./orders-data``)::

    cd examples
    celery -A orders worker -l INFO                          # terminal 1 (first: it
                                                             # creates the lease tables)
    python orders.py place 42.50                             # terminal 2
    python orders.py show <task id>

    # the crash the payment step exists for: the worker's child dies right after the
    # payment API charged the card, before the step was recorded (once)
    ORDERS_CRASH_ONCE=after_charge celery -A orders worker -l INFO
    python orders.py place 10 && python orders.py payments   # one charge, not two
"""

from __future__ import annotations

import os
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

from celery import Celery
from sqlalchemy import Column, Integer, MetaData, Numeric, String, Table, create_engine, select
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from celery_lease import LeasedTask, State, admin

DATA = Path(os.environ.get("ORDERS_DATA", "orders-data")).resolve()
DATA.mkdir(parents=True, exist_ok=True)

app = Celery("orders", broker=os.environ.get("BROKER_URL", "redis://127.0.0.1:6379/0"))
app.conf.task_default_queue = os.environ.get("ORDERS_QUEUE", "orders")
# The orders and the lease tables share one database, so that placing an order and
# enqueuing its task is one transaction. In production: PostgreSQL, e.g.
# "postgresql+psycopg://app:secret@db/shop" (run `celery -A orders lease migrate` once).
app.conf.lease_database_url = f"sqlite:///{DATA / 'shop.sqlite3'}"

# NullPool: no connection is kept open, so none crosses the worker's fork into its pool
engine = create_engine(app.conf.lease_database_url, poolclass=NullPool)
orders = Table(
    "orders",
    MetaData(),
    Column("id", Integer, primary_key=True),
    Column("total", Numeric(10, 2), nullable=False),
    Column("status", String(16), nullable=False, default="placed"),
)
orders.metadata.create_all(engine)


class PaymentAPI:
    """Stands in for a real payment provider: another system, with its own storage,
    that deduplicates on an idempotency key (as Stripe, Adyen and most others do)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with self._db() as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS charges (id INTEGER PRIMARY KEY, "
                "amount TEXT NOT NULL, idempotency_key TEXT UNIQUE)"
            )

    def _db(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=30, isolation_level=None)

    def charge(self, amount: str, idempotency_key: str) -> dict[str, Any]:
        """Charge ``amount`` once per key: a repeated key returns the first charge."""
        with self._db() as db:
            db.execute(
                "INSERT OR IGNORE INTO charges (amount, idempotency_key) VALUES (?, ?)",
                (amount, idempotency_key),
            )
        charge = self.find(amount, idempotency_key)
        assert charge is not None
        crash_once("after_charge")  # the demo's crash: charged, but the step not recorded
        return charge

    def find(self, amount: str, idempotency_key: str) -> dict[str, Any] | None:
        """The charge made with this key, or ``None``: what ``check=`` asks after a crash."""
        with self._db() as db:
            row = db.execute(
                "SELECT id, amount FROM charges WHERE idempotency_key = ?", (idempotency_key,)
            ).fetchone()
        return None if row is None else {"id": row[0], "amount": row[1]}

    def charges(self) -> list[tuple[int, str, str]]:
        with self._db() as db:
            return list(db.execute("SELECT id, amount, idempotency_key FROM charges"))


payments = PaymentAPI(DATA / "payments.sqlite3")


def crash_once(point: str) -> None:
    """Die here, as an OOM kill would, the first time only, if ORDERS_CRASH_ONCE names
    this point (a demo device: real code has no such thing)."""
    if os.environ.get("ORDERS_CRASH_ONCE") != point:
        return
    try:
        os.close(os.open(DATA / f"crashed-{point}", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return
    os._exit(137)


def load_order(order_id: int) -> dict[str, Any]:
    with engine.connect() as conn:
        row = conn.execute(select(orders).where(orders.c.id == order_id)).one()
    return {"id": row.id, "total": str(row.total)}


def ship(order_id: int) -> str:
    # a real carrier API without idempotency keys: declared non-idempotent, so a crash
    # in the middle of it hands the order to a person instead of shipping twice
    with engine.begin() as conn:
        conn.execute(orders.update().where(orders.c.id == order_id).values(status="shipped"))
    return f"label-{order_id}"


@app.task(base=LeasedTask, bind=True, lease_ttl=30, max_runtime=300, max_retries=5)
def fulfil(self: LeasedTask, order_id: int) -> int:
    """Load, charge, ship: each step runs once per order, whatever crashes in between."""
    order = self.step("load", load_order, order_id, idempotent=True)
    charge = self.step(
        "charge",
        payments.charge,
        order["total"],
        idempotency_key=self.idempotency_key("charge"),
        check=payments.find,
    )
    self.step("ship", ship, order_id)
    return int(charge["id"])


@app.task(base=LeasedTask, bind=True)
def newsletter(self: LeasedTask, recipients: int) -> int:
    """A long loop with a progress cursor: a re-run continues where the last one was."""
    start = self.load_progress(0)
    for n in range(start, recipients):
        time.sleep(0.01)  # send message n
        if (n + 1) % 100 == 0 or n + 1 == recipients:
            self.save_progress(n + 1)  # also a cancel point, and progress for max_runtime
    return int(recipients)


def place(total: str) -> str:
    """Insert the order and enqueue its fulfilment in one transaction; return the task id."""
    with Session(engine) as session, session.begin():
        order_id = session.execute(orders.insert().values(total=total)).inserted_primary_key[0]
        result = fulfil.apply_async((order_id,), connection=session)
    # committed: the order exists and its task is on its way (or the reaper sends it)
    return str(result.id)


def show(task_id: str) -> None:
    ops = admin(app)
    record = ops.get(task_id)
    if record is None:
        print(f"no task {task_id}")
        return
    print(f"task {task_id}: {record.state}, attempt {record.attempt}, result {record.result!r}")
    if record.state is State.WAIT_MANUAL:
        print(f"  waiting for a person: {record.reason}")
    for step in ops.steps(task_id):
        print(f"  step {step.name}: {step.state} (attempt {step.attempt}) {step.result!r}")
    for row in ops.history(task_id):
        before = row.from_state.value if row.from_state else "-"
        print(f"  {row.at:%H:%M:%S} {before} -> {row.to_state.value}: {row.reason}")


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "place":
        print(place(argv[1]))
    elif len(argv) == 2 and argv[0] == "show":
        show(argv[1])
    elif len(argv) == 2 and argv[0] == "cancel":
        print(f"was {admin(app).cancel(argv[1], reason='cancelled from orders.py')}")
    elif argv == ["payments"]:
        for charge_id, amount, key in payments.charges():
            print(f"charge {charge_id}: {amount} (idempotency key {key})")
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
