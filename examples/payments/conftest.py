"""Which app the kit's fixtures test, and the stand-in processor its workers use."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def lease_app() -> Any:
    from payments.app import app

    return app


@pytest.fixture
def lease_conf(lease_conf: dict[str, Any]) -> dict[str, Any]:
    # applied in the test process and in every worker the test starts
    return {**lease_conf, "payments_processor": "payments.fakes:CountingProcessor"}
