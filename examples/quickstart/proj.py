"""A minimal celery-lease project: one crash-safe task (see README.md in this folder)."""

import os

from celery import Celery

from celery_lease import LeasedTask

app = Celery("proj", broker=os.environ.get("BROKER_URL", "redis://127.0.0.1:6379/0"))
# The lease store. Default: celery-lease.sqlite3 in the directory each process starts
# in (run the worker and the producer from the same folder; the worker logs the path,
# `celery -A proj lease check` reports a worker on another store). Production:
# PostgreSQL, e.g.
# app.conf.lease_database_url = "postgresql+psycopg://user:password@db-host/app"


def build_report(user_id):
    return {"user": user_id, "rows": 42}


def send_report(report, *, key):
    # a real mailer or API would receive `key` as its idempotency key
    print(f"sending the report of user {report['user']} (idempotency key {key})")
    return "sent"


@app.task(base=LeasedTask, bind=True, lease_ttl=60, max_runtime=600, max_retries=3)
def export_report(self, user_id):
    # each step runs once per task, across attempts: a re-run after a crash
    # gets the stored result of a finished step instead of running it again
    report = self.step("build", build_report, user_id, idempotent=True)
    return self.step("send", send_report, report, key=self.idempotency_key("send"))
