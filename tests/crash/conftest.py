"""The crash suite: every test here kills, freezes or restarts real worker processes.

Each test is marked ``crash`` (``pytest -m crash`` runs the suite, ``-m 'not crash'``
skips it); ``lease_env`` builds leased projects (see :mod:`tests.crash.support`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.crash)
