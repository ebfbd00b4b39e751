#!/usr/bin/env python
"""Celery's own integration suite, plain and with every task leased, compared test by test.

    python scripts/celery_suite.py [--subset ci|full] [--broker redis,amqp]
                                   [--store sqlite,postgresql] [--timeout 120] [--json FILE]

Celery ships its integration tests (``t/integration/``) in its source distribution.
The script fetches the sdist of the installed Celery version with pip (``pip download
--no-deps --no-binary :all: celery==<version>``, cached), unpacks ``t/`` and Celery's
pytest settings, and runs the suite's files (or the CI subset) with pytest:

* **plain**: Celery's own fixtures, as Celery's CI runs them;
* **leased**: the same, with the plugin ``tests/celery_suite/plugin.py``, which gives
  the app ``task_cls="celery_lease:LeasedTask"`` and a lease store (a fresh SQLite
  file, or a fresh PostgreSQL schema). No test of Celery's is edited.

once per broker (Redis, and RabbitMQ with the Redis result backend) and, leased, per
store. Each test's outcome comes from pytest's JUnit XML. The result is the comparison:
a test that passes plain and not leased is listed, and unless
``tests/celery_suite/__init__.py`` lists it in ``REVIEWED`` with its reason, the script
exits with status 1. It prints a markdown table (per run: counts and wall time; then
every test whose outcome differs), and with ``--json`` writes the same as JSON.

Services: Redis (``CELERY_LEASE_TEST_REDIS_URL``, its host and port; the suite uses that
database, flushed before each run, and db 0 for its own keys), RabbitMQ
(``CELERY_LEASE_TEST_AMQP_URL``), PostgreSQL (``--pg-url``, default
``CELERY_LEASE_TEST_PG_ADMIN_URL``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from tests.celery_suite import CI_SUBSET, REVIEWED, SUITE_FILES  # noqa: E402
from tests.celery_suite.plugin import LEASE_DB_ENV, LEASE_SCHEMA_ENV  # noqa: E402

DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "celery-lease"
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed")


# -- the suite, from the sdist ------------------------------------------------------------


def celery_version() -> str:
    return importlib.metadata.version("celery")


def fetch_suite(cache: Path, version: str) -> Path:
    """The unpacked suite of Celery ``version`` (``<root>/t/integration``), downloaded
    with pip once and cached."""
    root = cache / f"celery-{version}-suite"
    if (root / "t" / "integration" / "conftest.py").exists():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "--quiet",
                f"celery=={version}",
                "-d",
                tmp,
            ],
            check=True,
        )
        (sdist,) = Path(tmp).glob("celery-*.tar.gz")
        unpacked = Path(tmp) / "suite"
        with tarfile.open(sdist) as tar:
            top = f"celery-{version}/"
            members = []
            for member in tar.getmembers():
                name = member.name.removeprefix(top)
                # the tests, their helpers at t/, and Celery's pytest settings (markers)
                if name == "pyproject.toml" or (
                    name.startswith("t/") and not name.startswith(("t/unit/", "t/smoke/"))
                ):
                    member.name = name
                    members.append(member)
            tar.extractall(unpacked, members=members, filter="data")
        shutil.move(str(unpacked), root)
    return root


# -- one run ------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """One pytest run of the suite."""

    mode: str  # "plain" | "leased"
    broker: str  # "redis" | "amqp"
    store: str | None  # "sqlite" | "postgresql" (leased only)
    seconds: float = 0.0
    outcomes: dict[str, str] = dataclasses.field(default_factory=dict)
    returncode: int = 0

    @property
    def label(self) -> str:
        return f"{self.mode} {self.broker}" + (f" {self.store}" if self.store else "")

    def counts(self) -> Counter[str]:
        return Counter(self.outcomes.values())


def _test_id(case: ET.Element) -> str:
    """``t/integration/test_canvas.py::test_chain::test_simple_chain`` from a JUnit case
    (class name ``t.integration.test_canvas.test_chain``)."""
    parts = (case.get("classname") or "").split(".")
    cut = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
    path = "/".join(parts[: cut + 1]) + ".py"
    return "::".join([path, *parts[cut + 1 :], case.get("name") or ""])


def _outcome(case: ET.Element) -> str:
    if case.find("failure") is not None:
        return "failed"
    if case.find("error") is not None:
        return "error"
    skipped = case.find("skipped")
    if skipped is not None:
        return "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
    return "passed"


#: Worse outcomes win when a test has several JUnit cases (a subtest's, a teardown's).
_RANK = {"error": 4, "failed": 3, "passed": 2, "xfailed": 1, "skipped": 0}


def read_junit(path: Path) -> dict[str, str]:
    """Each test's outcome in a JUnit XML file (none if pytest wrote none)."""
    outcomes: dict[str, str] = {}
    if not path.exists():
        return outcomes
    for case in ET.parse(path).iter("testcase"):
        key, outcome = _test_id(case), _outcome(case)
        if key not in outcomes or _RANK[outcome] > _RANK[outcomes[key]]:
            outcomes[key] = outcome
    return outcomes


@dataclasses.dataclass(frozen=True)
class Services:
    redis_url: str
    amqp_url: str
    pg_url: str


def _flush_redis(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


def _purge_amqp(url: str) -> None:
    from kombu import Connection

    with Connection(url, connect_timeout=5) as conn, contextlib.suppress(Exception):
        conn.default_channel.queue_purge("celery")  # type: ignore[attr-defined]


def _pg_drop_schema(url: str, schema: str) -> None:
    import psycopg
    from psycopg import sql
    from sqlalchemy.engine import make_url

    libpq = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(libpq, autocommit=True, connect_timeout=5) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def run_suite(
    root: Path,
    run: Run,
    tests: list[str],
    services: Services,
    timeout: float,
    work: Path,
    reuse: bool = False,
) -> Run:
    """Run ``tests`` once as ``run`` says; fill in its outcomes and wall time. With
    ``reuse``, a run whose JUnit XML and wall time are in ``work`` is read, not run."""
    from sqlalchemy.engine import make_url

    name = run.label.replace(" ", "-")
    junit, timing = work / f"{name}.xml", work / f"{name}.seconds"
    if reuse and junit.exists() and timing.exists():
        run.seconds = float(timing.read_text())
        run.outcomes = read_junit(junit)
        return run

    redis = make_url(services.redis_url)
    _flush_redis(services.redis_url)
    broker = services.redis_url if run.broker == "redis" else services.amqp_url
    if run.broker == "amqp":
        _purge_amqp(services.amqp_url)
    env = dict(os.environ)
    for key in ("PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER"):
        env.pop(key, None)
    env.update(
        TEST_BROKER=broker,
        TEST_BACKEND=services.redis_url,
        REDIS_HOST=str(redis.host or "127.0.0.1"),
        REDIS_PORT=str(redis.port or 6379),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
    )
    plugins = ["-p", "celery.contrib.pytest", "-p", "no:celery_lease"]
    schema: str | None = None
    if run.mode == "leased":
        plugins += ["-p", "tests.celery_suite.plugin"]
        if run.store == "sqlite":
            db = work / f"{name}.sqlite3"
            for stale in work.glob(f"{name}.sqlite3*"):
                stale.unlink()
            env[LEASE_DB_ENV] = f"sqlite:///{db}"
        else:
            schema = f"celery_suite_{uuid.uuid4().hex[:10]}"
            env[LEASE_DB_ENV] = services.pg_url
            env[LEASE_SCHEMA_ENV] = schema
    junit.unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        "pytest",
        *plugins,
        "-p",
        "no:cacheprovider",
        "-q",
        "-rN",
        f"--timeout={timeout}",
        f"--junitxml={junit}",
        *tests,
    ]
    started = time.monotonic()
    with open(work / f"{name}.log", "w") as log:
        done = subprocess.run(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    run.seconds = time.monotonic() - started
    run.returncode = done.returncode
    timing.write_text(f"{run.seconds:.1f}")
    run.outcomes = read_junit(junit)
    if schema is not None:
        _pg_drop_schema(services.pg_url, schema)
    return run


# -- the comparison -----------------------------------------------------------------------


@dataclasses.dataclass
class Difference:
    test: str
    broker: str
    store: str
    plain: str
    leased: str
    reviewed: str | None  # the reason, if REVIEWED lists the test


def compare(runs: list[Run]) -> list[Difference]:
    """Every test whose leased outcome differs from the plain one on the same broker."""
    plain = {r.broker: r for r in runs if r.mode == "plain"}
    out = []
    for leased in (r for r in runs if r.mode == "leased"):
        base = plain.get(leased.broker)
        if base is None:
            continue
        for test in sorted(set(base.outcomes) | set(leased.outcomes)):
            was, now = base.outcomes.get(test, "absent"), leased.outcomes.get(test, "absent")
            if was != now:
                out.append(
                    Difference(test, leased.broker, str(leased.store), was, now, REVIEWED.get(test))
                )
    return out


def regressions(differences: list[Difference]) -> list[Difference]:
    """Tests that pass plain and not leased, and that no reviewed reason explains."""
    return [d for d in differences if d.plain == "passed" and d.reviewed is None]


def markdown(runs: list[Run], differences: list[Difference]) -> str:
    lines = [
        "| run | tests | " + " | ".join(OUTCOMES) + " | wall time |",
        "|---|---:|" + "---:|" * len(OUTCOMES) + "---:|",
    ]
    for r in runs:
        c = r.counts()
        cells = " | ".join(str(c.get(o, 0)) for o in OUTCOMES)
        lines.append(f"| {r.label} | {len(r.outcomes)} | {cells} | {r.seconds / 60:.1f} min |")
    lines.append("")
    if not differences:
        lines.append("Every test has the same outcome plain and leased.")
        return "\n".join(lines)
    lines += [
        "| test | broker | store | plain | leased | reviewed reason |",
        "|---|---|---|---|---|---|",
    ]
    for d in differences:
        lines.append(
            f"| `{d.test}` | {d.broker} | {d.store} | {d.plain} | {d.leased} | {d.reviewed or ''} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subset", choices=("ci", "full"), default="full")
    parser.add_argument("--tests", nargs="*", help="node ids or files instead of --subset")
    parser.add_argument("--broker", default="redis,amqp")
    parser.add_argument("--store", default="sqlite,postgresql")
    parser.add_argument("--modes", default="plain,leased")
    parser.add_argument("--timeout", type=float, default=120.0, help="pytest-timeout per test")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--work", type=Path, help="where logs, JUnit XML and stores go")
    parser.add_argument("--json", type=Path, help="write runs and differences as JSON")
    parser.add_argument("--reuse", action="store_true", help="read runs already recorded in --work")
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("CELERY_LEASE_TEST_REDIS_URL", "redis://127.0.0.1:6379/9"),
    )
    parser.add_argument(
        "--amqp-url",
        default=os.environ.get("CELERY_LEASE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1//"),
    )
    parser.add_argument(
        "--pg-url",
        default=os.environ.get(
            "CELERY_LEASE_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/test"
        ),
    )
    args = parser.parse_args(argv)

    version = celery_version()
    root = fetch_suite(args.cache, version)
    tests = args.tests or (list(CI_SUBSET) if args.subset == "ci" else list(SUITE_FILES))
    services = Services(args.redis_url, args.amqp_url, args.pg_url)
    work = args.work or Path(tempfile.mkdtemp(prefix="celery-suite-"))
    work.mkdir(parents=True, exist_ok=True)
    modes = args.modes.split(",")
    runs: list[Run] = []
    for broker in args.broker.split(","):
        if "plain" in modes:
            runs.append(Run("plain", broker, None))
        if "leased" in modes:
            runs += [Run("leased", broker, store) for store in args.store.split(",")]
    print(f"celery {version}, suite in {root}, logs in {work}", flush=True)
    for run in runs:
        run_suite(root, run, tests, services, args.timeout, work, reuse=args.reuse)
        c = run.counts()
        print(
            f"{run.label}: {len(run.outcomes)} tests, "
            + ", ".join(f"{c.get(o, 0)} {o}" for o in OUTCOMES)
            + f", {run.seconds:.0f} s",
            flush=True,
        )
    differences = compare(runs)
    print(markdown(runs, differences))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "celery": version,
                    "runs": [
                        {**dataclasses.asdict(r), "label": r.label, "counts": dict(r.counts())}
                        for r in runs
                    ],
                    "differences": [dataclasses.asdict(d) for d in differences],
                    "regressions": [dataclasses.asdict(d) for d in regressions(differences)],
                },
                indent=2,
            )
        )
    missing = [r.label for r in runs if not r.outcomes]
    if missing:
        print(f"no outcome recorded for: {', '.join(missing)} (see the logs)", file=sys.stderr)
        return 2
    return 1 if regressions(differences) else 0


if __name__ == "__main__":
    sys.exit(main())
