#!/usr/bin/env python
"""The long seeded chaos soak: the engine of ``tests/crash/test_soak.py``, run longer.

    python scripts/soak.py --seed 7 --chaos-seconds 300 --tasks 400 [--workers 4]
    python scripts/soak.py --broker amqp --seed 7 ...     # RabbitMQ as the broker
    python scripts/soak.py --store sqlite --seed 7 ...    # one SQLite file as the store

N real workers (prefork and threads pools) on a PostgreSQL store and a Redis broker run
a mixed workload while a seeded schedule SIGKILLs pool children and whole workers
(restarting them), freezes and resumes workers, makes the broker lose its queued
messages and kills the store's database connections (PostgreSQL); then the system is left alone
and every invariant is checked (see ``tests/crash/chaos.py``). Prints a summary table;
exits 1 on any violation (the seed reproduces the schedule). On a violation nothing is
dropped: the evidence of the tasks involved (rows with their stored messages, audit
trails, steps, the result backend's keys and chord counters) is written to a JSON file
next to the workers' logs, and the database, the Redis database (and the RabbitMQ
vhost) are kept; the script prints where.

With ``--store sqlite`` the store is one SQLite file (in the directory of the workers'
logs) that every worker, producer, the workers' embedded reapers and the checker open,
as celery-lease's embedded default does on one host; there are no connections to kill,
so the schedule draws no ``pg_terminate`` (every other fault as on PostgreSQL). On a
violation the file is kept with the logs and its path printed.

With ``--broker amqp`` the workers and producers use RabbitMQ on a vhost of the run's
own (made with ``rabbitmqctl``, deleted at the end unless evidence is kept); the result
backend stays the Redis database. The broker's faults are then the vhost's queues
purged (``rabbitmq_purge``) and every connection of the vhost closed by the broker
(``rabbitmq_disconnect``); the shared RabbitMQ node is never restarted.

Needs the services of the test suite (``CELERY_LEASE_TEST_PG_ADMIN_URL``,
``CELERY_LEASE_TEST_REDIS_URL``: a Redis database the script flushes, default 10;
``CELERY_LEASE_TEST_AMQP_URL``: RabbitMQ's server and user, ``rabbitmqctl`` on the
path). Redis is really restarted (``SHUTDOWN NOSAVE``) only on a Redis broker that is
the shared server (127.0.0.1:6379; a Redis of the run's own is never restarted), with
``--restart-redis yes``, or with ``auto`` when ``CELERY_LEASE_TEST_EXCLUSIVE=1`` or no
other test session runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.crash.chaos import SOURCE, TIMINGS, Options, Soak, seed_from_env
from tests.crash.faults import EXCLUSIVE_ENV, foreign_sessions, restarts_redis_of
from tests.crash.standalone import REDIS_URL, Standalone


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=seed_from_env())
    parser.add_argument(
        "--broker",
        choices=("redis", "amqp"),
        default="redis",
        help="redis, or amqp: RabbitMQ on a vhost of the run's own (Redis result backend)",
    )
    parser.add_argument(
        "--store",
        choices=("postgresql", "sqlite"),
        default="postgresql",
        help="postgresql (a database of the run's own), or sqlite: one SQLite file shared "
        "by every process (no pg_terminate faults)",
    )
    parser.add_argument("--chaos-seconds", type=float, default=300.0)
    parser.add_argument("--tasks", type=int, default=400)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--producers", type=int, default=3)
    parser.add_argument(
        "--settle-timeout",
        type=float,
        default=180.0,
        help="bound on the time from the end of the schedule until every task settled",
    )
    parser.add_argument("--restart-redis", choices=("auto", "yes", "no"), default="auto")
    parser.add_argument("--quiet", action="store_true", help="do not print every fault")
    parser.add_argument("--keep", action="store_true", help="keep the workers' logs")
    args = parser.parse_args(argv)

    if args.broker == "amqp":
        restart = False  # Redis is the result backend only: no broker fault touches it
    elif not restarts_redis_of(REDIS_URL):
        restart = False  # a Redis of the run's own: only the shared one is ever restarted
    elif args.restart_redis == "auto":
        restart = os.environ.get(EXCLUSIVE_ENV) == "1" or not foreign_sessions()
    else:
        restart = args.restart_redis == "yes"
    started = time.monotonic()
    with Standalone(keep=args.keep, broker=args.broker, store=args.store) as env:
        # the result backend (chords): the Redis database, whatever the broker
        project = env.leased_project(SOURCE, settings={"result_backend": env.redis_url}, **TIMINGS)
        opts = Options(
            seed=args.seed,
            broker=args.broker,
            store=args.store,
            chaos_seconds=args.chaos_seconds,
            tasks=args.tasks,
            workers=args.workers,
            producers=args.producers,
            settle_timeout=args.settle_timeout,
            restart_redis=restart,
            database_url=project.store.config.database_url,
            evidence_dir=str(env.dir),
        )
        echo = None if args.quiet else (lambda line: print(line, flush=True))
        report = Soak(project, opts, env.redis_url, echo=echo).run()
        if not report.ok:
            env.keep = True
    print()
    print(report.table())
    print(f"\nwall time {time.monotonic() - started:.0f} s; reproduce with --seed {args.seed}")
    if not report.ok:
        print("\n" + report.failure_message(), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
