"""Settle an invoice: load it, charge the card, e-mail the receipt.

The card processor takes no idempotency key, so ``charge`` is a non-idempotent step:
if a worker dies after the card was charged but before the step was recorded, nobody
can tell whether the money moved, and celery-lease hands the task to a person
(WAIT_MANUAL) instead of charging again. The receipt mailer deduplicates on a key,
so that step is idempotent and is simply retried.

Which processor and mailer the task talks to is a setting (``payments_processor``),
so that tests can put a stand-in in the worker processes they start.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from kombu.utils.imports import symbol_by_name

from celery_lease import LeasedTask

app = Celery("payments", broker=os.environ.get("BROKER_URL", "redis://127.0.0.1:6379/0"))
app.conf.update(
    task_default_queue="payments",
    lease_database_url=os.environ.get("PAYMENTS_LEASE_DB", "sqlite:///payments-lease.sqlite3"),
    payments_processor="payments.gateway:SandboxProcessor",
)

INVOICES: dict[int, dict[str, Any]] = {
    1: {"id": 1, "card": "tok_visa", "amount_cents": 4250, "email": "ada@example.com"},
    2: {"id": 2, "card": "tok_amex", "amount_cents": 990, "email": "alan@example.com"},
}


def processor() -> Any:
    """The payment processor client named by the ``payments_processor`` setting."""
    return symbol_by_name(app.conf.payments_processor)()


def load_invoice(invoice_id: int) -> dict[str, Any]:
    return INVOICES[invoice_id]


@app.task(base=LeasedTask, bind=True, name="payments.settle_invoice")
def settle_invoice(self: LeasedTask, invoice_id: int) -> dict[str, Any]:
    """Charge an invoice once and send its receipt; returns what was settled."""
    client = processor()
    invoice = self.step("load", load_invoice, invoice_id, idempotent=True)
    charge = self.step("charge", client.charge, invoice["card"], invoice["amount_cents"])
    self.step(
        "receipt",
        client.send_receipt,
        invoice["email"],
        charge["id"],
        idempotency_key=self.idempotency_key("receipt"),
        idempotent=True,
    )
    return {"invoice": invoice_id, "charged_cents": invoice["amount_cents"]}
