"""Fixtures of the parity suite: leased projects (see :mod:`tests.parity.support`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ..crash.support import LeaseEnv
from ..helpers import ExternalSystem


@pytest.fixture
def lease_env(
    celery_project: Callable[..., Any],
    lease_config: Callable[..., Any],
    make_store: Callable[..., Any],
    external: ExternalSystem,
    harness: Any,
    tmp_path: Path,
) -> LeaseEnv:
    """Leased projects on this test's store and brokers (see :class:`LeaseEnv`)."""
    return LeaseEnv(
        celery_project, lease_config, make_store, external, harness.finalizers, tmp_path
    )
