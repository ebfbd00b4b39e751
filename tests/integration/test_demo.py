"""``python -m celery_lease.demo``, the README's first set-up command, works as it says.

The demo needs no server (SQLite store, kombu filesystem transport). It kills a pool
process and then a whole worker, restarts it, and exits 0 only if every order
SUCCEEDED and each side effect, counted outside the lease store, happened once.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from celery_lease.demo import main

SUMMARY = re.compile(
    r"^OK: 8/8 tasks SUCCEEDED, 24/24 side effects ran exactly once, "
    r"(?P<recovered>\d+) tasks recovered from 2 crashes$",
    re.MULTILINE,
)


@pytest.mark.slow
def test_demo_recovers_every_order_exactly_once(tmp_path: Path) -> None:
    data = tmp_path / "demo-data"
    proc = subprocess.run(
        [sys.executable, "-m", "celery_lease.demo", "--data-dir", str(data)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    output = f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, output
    summary = SUMMARY.search(proc.stdout)
    assert summary is not None, output
    # the pool-process kill and the worker kill each hit at least one running order
    assert int(summary["recovered"]) >= 2, output
    assert (data / "lease.sqlite3").is_file()
    assert (data / "external.sqlite3").is_file()
    assert (data / "worker1.log").is_file() and (data / "worker2.log").is_file()


def test_demo_refuses_a_directory_it_did_not_make(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keep = tmp_path / "precious.txt"
    keep.write_text("not the demo's")
    assert main(["--data-dir", str(tmp_path)]) == 1
    assert keep.read_text() == "not the demo's"
    assert "was not made by the demo" in capsys.readouterr().out
