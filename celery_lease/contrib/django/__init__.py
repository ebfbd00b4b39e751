"""Django integration: ``INSTALLED_APPS += ["celery_lease.contrib.django"]``.

Gives Django migrations that create the lease tables (the lease store's own schema
steps), read-only models of them, and an admin to list tasks, read their audit trail
and steps, and retry / fail / resolve / cancel them through the operator API.
See ``docs/django.md``.

Importing this package does not import Django models, so it is safe from a
``celery.py`` module or settings.
"""

from ._conf import close_connections, django_database_url, get_celery_app, lease_app

__all__ = ["close_connections", "django_database_url", "get_celery_app", "lease_app"]
