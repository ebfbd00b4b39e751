"""Celery's own integration suite, plain and with every task leased: the CI subset.

``scripts/celery_suite.py --subset ci`` fetches the sdist of the installed Celery
version with pip (as a new user's machine can; cached), runs the subset of Celery's
``t/integration`` tests listed in ``tests/celery_suite/__init__.py`` plain and leased
(``task_cls="celery_lease:LeasedTask"``), and compares every test's outcome. Here: on
Redis with SQLite and on RabbitMQ (Redis result backend) with PostgreSQL. The whole
suite is the script's job; its figures are in docs/what-stays-the-same.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.celery_suite import CI_SUBSET

from ..helpers import REPO_ROOT

pytestmark = pytest.mark.slow


def _run(tmp_path: Path, name: str, *args: str) -> dict[str, object]:
    out = tmp_path / f"{name}.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "scripts" / "celery_suite.py"),
            "--subset",
            "ci",
            "--work",
            str(tmp_path / name),
            "--json",
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.exists(), done.stdout + done.stderr
    summary: dict[str, object] = json.loads(out.read_text())
    assert done.returncode == 0, done.stdout + done.stderr
    return summary


@pytest.mark.postgres
@pytest.mark.timeout(1200)  # four pytest runs of Celery's suite, each with its own worker
def test_the_ci_subset_of_celerys_suite_has_the_same_outcomes_leased(
    tmp_path: Path, redis_url: str, amqp_url: str, pg_url: str
) -> None:
    services = ["--redis-url", redis_url, "--amqp-url", amqp_url, "--pg-url", pg_url]
    # each broker with one store, each store with one broker: four runs (the whole
    # suite, every pairing, is the script's job)
    on_redis = _run(tmp_path, "redis", "--broker", "redis", "--store", "sqlite", *services)
    on_amqp = _run(tmp_path, "amqp", "--broker", "amqp", "--store", "postgresql", *services)
    for summary in (on_redis, on_amqp):
        assert summary["regressions"] == []
        runs = summary["runs"]
        assert isinstance(runs, list)
        for run in runs:
            # every test of the subset ran in every run (a run that collected nothing, or
            # a test id that no longer exists, would compare clean)
            assert set(run["outcomes"]) == set(CI_SUBSET), run["label"]
            if run["mode"] == "leased":
                # every leased run passes the whole subset; a plain run is the reference
                # only (a test of Celery's own that times out under this machine's load
                # fails plain; the leased runs must not, and no difference may be a
                # regression, above)
                assert set(run["outcomes"].values()) <= {"passed", "skipped", "xfailed"}, run
            else:
                print(f"plain {run['broker']}: {run['outcomes']}")
