"""The kit's own tests test it on :mod:`tests.kit.kitapp`, as a user would on theirs."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def lease_app(redis_url: str) -> Any:
    # redis_url: the suite's own Redis database, flushed around each test
    from .kitapp import app

    return app


@pytest.fixture
def lease_database(request: pytest.FixtureRequest) -> str:
    if request.node.get_closest_marker("postgres") is not None:
        return str(request.getfixturevalue("pg_url"))
    return "sqlite"
