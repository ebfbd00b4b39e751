"""The test project with its lease tables behind TCP proxies that can black-hole or
refuse (``tests/django/blackhole_admin.py``): Django's own data on a SQLite file, the
lease tables on PostgreSQL as ``DATABASES["lease"]`` through one proxy, the lease store
through another, so that each can stop answering on its own.

``CELERY_LEASE_BH_URL`` is the database (reached directly); ``CELERY_LEASE_BH_DJANGO_PORT``
and ``CELERY_LEASE_BH_STORE_PORT`` are the proxies' ports in front of it."""

import os

from sqlalchemy.engine import make_url

from .settings import *  # noqa: F403

_URL = make_url(os.environ["CELERY_LEASE_BH_URL"])

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ["CELERY_LEASE_BH_SQLITE"],
    },
    "lease": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _URL.database,
        "USER": _URL.username or "",
        "PASSWORD": _URL.password or "",
        "HOST": "127.0.0.1",
        "PORT": os.environ["CELERY_LEASE_BH_DJANGO_PORT"],
    },
}
DATABASE_ROUTERS = ["tests.django.proj.settings_blackhole.LeaseRouter"]

CELERY_LEASE_DATABASE_ALIAS = "lease"
CELERY_LEASE_DATABASE_URL = (
    _URL.set(drivername="postgresql+psycopg", host="127.0.0.1")
    .set(port=int(os.environ["CELERY_LEASE_BH_STORE_PORT"]))
    .render_as_string(hide_password=False)
)
CELERY_LEASE_DB_TIMEOUT = 2.0


class LeaseRouter:
    """The lease alias holds the lease tables only."""

    def allow_migrate(self, db, app_label, **hints):  # type: ignore[no-untyped-def]
        if db == "lease":
            return app_label == "celery_lease"
        return None
