"""The Django app: ``INSTALLED_APPS += ["celery_lease.contrib.django"]``."""

from __future__ import annotations

import logging
from typing import Any

from django.apps import AppConfig
from django.db.models.signals import post_migrate

from ...exceptions import CeleryLeaseError

logger = logging.getLogger("celery_lease.contrib.django")


class CeleryLeaseConfig(AppConfig):
    """Models, migrations and admin for the lease tables (label ``celery_lease``)."""

    name = "celery_lease.contrib.django"
    label = "celery_lease"
    verbose_name = "Celery lease"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import _checks, _conf

        _checks.register()

        # workers (Celery's Django fixup calls django.setup()) and web processes use
        # the same store: Django's database unless CELERY_LEASE_DATABASE_URL is set
        try:
            _conf.lease_app()
        except CeleryLeaseError as error:
            # reported by the system check; failing here would break every manage.py command
            logger.debug("celery-lease: not configured at start-up: %s", error)
        post_migrate.connect(_follow_database, sender=self)


def _follow_database(sender: Any, using: str = "default", **kwargs: Any) -> None:
    """After ``migrate`` (the test runner's too, once it renamed the database), point the
    lease store at the database the migration ran on."""
    from . import _conf

    if using != _conf.database_alias():
        return
    try:
        _conf.lease_app()
    except CeleryLeaseError as error:
        logger.warning("celery-lease: %s", error)


__all__ = ["CeleryLeaseConfig"]
