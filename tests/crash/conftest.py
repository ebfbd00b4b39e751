"""The crash suite: every test here kills, freezes or restarts real worker processes.

Each test is marked ``crash`` (``pytest -m crash`` runs the suite, ``-m 'not crash'``
skips it); ``lease_env`` builds leased projects (see :mod:`tests.crash.support`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ..helpers import ExternalSystem
from .support import LeaseEnv

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.crash)


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
