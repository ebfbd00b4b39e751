"""The test project on a SQLite file (``CELERY_LEASE_DJANGO_SQLITE``): Django's data and
the lease store share it, as ``DATABASES["default"]`` with no lease_database_url."""

import os

from .settings import *  # noqa: F403

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ["CELERY_LEASE_DJANGO_SQLITE"],
    }
}
