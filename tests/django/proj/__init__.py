"""A minimal Django project for the tests of ``celery_lease.contrib.django``."""

from .celery import app as celery_app

__all__ = ["celery_app"]
