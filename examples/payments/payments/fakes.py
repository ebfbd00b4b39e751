"""The tests' stand-in processor: every real call is counted by celery-lease's kit.

``side_effects()`` is the test's counter, shared by the test and every worker process
the test started; a repeated idempotency key is counted once, as the provider would
deduplicate it.
"""

from __future__ import annotations

from typing import Any

from celery_lease.testing import side_effects


class CountingProcessor:
    """Charges and receipts recorded in the test's side-effect counter."""

    def charge(self, card: str, amount_cents: int) -> dict[str, Any]:
        # no idempotency key: the processor cannot deduplicate a repeated charge
        effect = side_effects().call("charge", payload=f"{card}:{amount_cents}")
        return {"id": f"ch_{effect}"}

    def send_receipt(self, email: str, charge_id: str, idempotency_key: str) -> str:
        side_effects().call("receipt", key=idempotency_key, payload=f"{email}:{charge_id}")
        return "sent"
