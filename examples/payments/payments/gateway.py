"""The processor the project uses outside tests: a sandbox that only logs.

A real project calls its provider's API here (and its tests use the stand-in in
:mod:`payments.fakes` instead, through the ``payments_processor`` setting).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

logger = logging.getLogger(__name__)


class SandboxProcessor:
    """Logs each request instead of sending it."""

    def charge(self, card: str, amount_cents: int) -> dict[str, Any]:
        charge_id = f"ch_{uuid.uuid4().hex[:12]}"
        logger.info("sandbox: charged %s cents to %s (%s)", amount_cents, card, charge_id)
        return {"id": charge_id}

    def send_receipt(self, email: str, charge_id: str, idempotency_key: str) -> str:
        logger.info("sandbox: receipt for %s sent to %s", charge_id, email)
        return "sent"
