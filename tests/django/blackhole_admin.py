"""The lease admin while its database black-holes or refuses, in a process of its own
(Django can be set up once per process; the pytest process has it on one database).

``python -m tests.django.blackhole_admin`` with ``DJANGO_SETTINGS_MODULE`` =
``tests.django.proj.settings_blackhole``, ``CELERY_LEASE_BH_URL`` (the PostgreSQL
database, migrated here) and ``CELERY_LEASE_BH_SQLITE`` (Django's own data). It starts
the two TCP proxies of the settings (:class:`tests.crash.faults.TcpProxy`), makes tasks,
drives the admin with the test client through each fault and prints what each request
answered as JSON, for ``test_admin_unavailable.py`` to assert. Durations are printed
on stderr, never asserted.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from tests.crash.faults import TcpProxy

BASE = "/admin/celery_lease/task/"
PAUSES = "/admin/celery_lease/pause/"


def answered(label: str, call: Callable[[], Any]) -> dict[str, Any]:
    """What one request answered: status, the error shown, the messages."""
    from django.contrib.messages import get_messages

    started = time.monotonic()
    response = call()
    seconds = time.monotonic() - started
    print(f"{label}: {response.status_code} in {seconds:.2f} s", file=sys.stderr)
    context = response.context or {}
    error = context.get("error") if hasattr(context, "get") else None
    return {
        "status": response.status_code,
        "error": error,
        "retry_after": response.get("Retry-After"),
        "body_says_unavailable": b"lease-unavailable" in response.content,
        "messages": [(m.level_tag, str(m)) for m in get_messages(response.wsgi_request)],
    }


def main() -> dict[str, Any]:
    store_proxy = TcpProxy().start()
    django_proxy = TcpProxy().start()
    os.environ["CELERY_LEASE_BH_STORE_PORT"] = str(store_proxy.port)
    os.environ["CELERY_LEASE_BH_DJANGO_PORT"] = str(django_proxy.port)

    import django

    django.setup()
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.test import Client
    from django.test.utils import setup_test_environment

    setup_test_environment()
    call_command("migrate", verbosity=0)
    call_command("migrate", database="lease", verbosity=0)

    from celery_lease.contrib.django import close_connections, lease_app
    from tests.django.conftest import LeaseRows

    rows = LeaseRows(lease_app())
    manual = rows.make("WAIT_MANUAL")
    other = rows.make("WAIT_MANUAL")
    pending = rows.make("PENDING")
    user = User.objects.create_superuser("sam", "sam@example.com", "pw")
    client = Client()
    client.force_login(user)

    def requests(prefix: str) -> dict[str, dict[str, Any]]:
        fail = {"lease_confirm": "yes", "reason": "given up"}
        return {
            f"{prefix}list": answered(f"{prefix}list", lambda: client.get(BASE)),
            f"{prefix}detail": answered(
                f"{prefix}detail", lambda: client.get(f"{BASE}{manual}/change/")
            ),
            f"{prefix}action": answered(
                f"{prefix}action",
                lambda: client.post(
                    BASE, {"action": "lease_fail", "_selected_action": [manual], **fail}
                ),
            ),
            f"{prefix}detail_action": answered(
                f"{prefix}detail_action",
                lambda: client.post(f"{BASE}{manual}/lease/fail/", fail),
            ),
            f"{prefix}all_matching": answered(
                f"{prefix}all_matching",
                lambda: client.post(
                    f"{BASE}?state__exact=WAIT_MANUAL",
                    {
                        "action": "lease_fail",
                        "_selected_action": [manual],
                        "select_across": "1",
                        "limit": "100",
                        "batch": "10",
                        **fail,
                    },
                ),
            ),
            f"{prefix}pauses": answered(f"{prefix}pauses", lambda: client.get(PAUSES)),
            f"{prefix}pause": answered(
                f"{prefix}pause",
                lambda: client.post(
                    PAUSES, {"op": "pause", "kind": "queue", "target": "exports", "reason": "x"}
                ),
            ),
            f"{prefix}workers": answered(
                f"{prefix}workers", lambda: client.get("/admin/celery_lease/worker/")
            ),
        }

    out: dict[str, Any] = {"ids": {"manual": manual, "other": other, "pending": pending}}
    out["before"] = answered("before", lambda: client.get(BASE))

    # the database stops answering: both the store's and Django's connections
    store_proxy.blackhole()
    django_proxy.blackhole()
    out.update(requests("blackhole_"))

    # only Django's own connection to the lease tables is black-holed: the store answers
    store_proxy.resume()
    out["django_only_list"] = answered("django_only_list", lambda: client.get(BASE))
    out["django_only_detail"] = answered(
        "django_only_detail", lambda: client.get(f"{BASE}{manual}/change/")
    )

    django_proxy.resume()
    out["resumed_list"] = answered("resumed_list", lambda: client.get(BASE))

    # refused: connections cut, nothing listens
    store_proxy.cut()
    django_proxy.cut()
    out["refused_list"] = answered("refused_list", lambda: client.get(BASE))
    out["refused_action"] = answered(
        "refused_action",
        lambda: client.post(f"{BASE}{manual}/lease/fail/", {"lease_confirm": "yes", "reason": "x"}),
    )

    store_proxy.restore()
    django_proxy.restore()
    out["restored_list"] = answered("restored_list", lambda: client.get(BASE))
    out["restored_action"] = answered(
        "restored_action",
        lambda: client.post(
            f"{BASE}{other}/lease/fail/", {"lease_confirm": "yes", "reason": "after the outage"}
        ),
    )
    close_connections()
    from django.db import connections

    connections.close_all()
    store_proxy.close()
    django_proxy.close()
    return out


if __name__ == "__main__":
    json.dump(main(), sys.stdout)
