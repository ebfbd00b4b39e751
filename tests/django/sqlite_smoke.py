"""The Django integration on SQLite, end to end, in a process of its own (Django can be
set up once per process; the pytest process uses PostgreSQL).

``python -m tests.django.sqlite_smoke`` with ``DJANGO_SETTINGS_MODULE`` =
``tests.django.proj.settings_sqlite`` and ``CELERY_LEASE_DJANGO_SQLITE`` = a file path:
migrates, makes tasks through the store, drives the admin with the test client and
prints what it saw as JSON (asserted by ``test_sqlite.py``).
"""

from __future__ import annotations

import json
import sys
from typing import Any


def main() -> dict[str, Any]:
    import django

    django.setup()
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.test import Client
    from django.test.utils import setup_test_environment

    setup_test_environment()
    call_command("migrate", verbosity=0)

    from celery_lease._runtime import runtime
    from celery_lease.contrib.django import lease_app
    from tests.django.conftest import LeaseRows

    app = lease_app()
    rows = LeaseRows(app)
    manual = rows.make("WAIT_MANUAL", nodename="alpha@host")
    pending = rows.make("PENDING", dedup_key="order-1")
    done = rows.make("SUCCEEDED", nodename="beta@host")

    user = User.objects.create_superuser("sam", "sam@example.com", "pw")
    client = Client()
    client.force_login(user)
    base = "/admin/celery_lease/task/"
    listing = client.get(base)
    filtered = client.get(base, {"state__exact": "WAIT_MANUAL"})
    by_worker = client.get(base, {"worker": "beta@host"})
    searched = client.get(base, {"q": "order-1"})
    detail = client.get(f"{base}{manual}/change/")
    failed = client.post(
        f"{base}{manual}/lease/fail/", {"lease_confirm": "yes", "reason": "given up"}
    )
    refused = client.post(
        base,
        {"action": "lease_cancel", "_selected_action": [done], "lease_confirm": "yes"},
        follow=True,
    )
    cancelled = client.post(
        base,
        {"action": "lease_cancel", "_selected_action": [pending], "lease_confirm": "yes"},
    )
    store = runtime(app).store
    trail = store.history(manual)
    out = {
        "store_url": store.url,
        "list_status": listing.status_code,
        "listed": sorted(str(t.pk) for t in listing.context["cl"].result_list),
        "filtered": [str(t.pk) for t in filtered.context["cl"].result_list],
        "by_worker": [str(t.pk) for t in by_worker.context["cl"].result_list],
        "searched": [str(t.pk) for t in searched.context["cl"].result_list],
        "detail_status": detail.status_code,
        "detail_has_trail": all(t.actor in detail.content.decode() for t in trail[:-1]),
        "created_at_shown": str(detail.context["original"].created_at),
        "fail_status": failed.status_code,
        "cancel_status": cancelled.status_code,
        "refused_messages": [str(m) for m in refused.context["messages"]],
        "states": {
            "manual": store.get(manual).state.value,
            "pending": store.get(pending).state.value,
            "done": store.get(done).state.value,
        },
        "last_actor": trail[-1].actor,
        "ids": {"manual": manual, "pending": pending, "done": done},
    }
    runtime(app).reset()
    return out


if __name__ == "__main__":
    json.dump(main(), sys.stdout)
