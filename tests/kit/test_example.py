"""``examples/payments`` proves its task crash-safe with the kit alone, run as its users
would run it (``python -m pytest examples/payments``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from .test_plugin import plugin_args

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "payments"


def test_the_payments_example_passes_with_real_sigkills(redis_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["CELERY_LEASE_TESTING_BROKER_URL"] = redis_url
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *plugin_args(),
            "-p",
            "no:cacheprovider",
            "-q",
            "-rA",
            str(EXAMPLE),
        ],
        cwd=EXAMPLE,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"\b3 passed\b", out), out
    assert "PASSED test_payments.py::test_every_crash_point_charges_at_most_once" in out, out
