"""Schema version 16: ``concurrency.changes``, the changes of a limited task's key. Every
claim, grant and waiting mark adds one under the key's lock, so that a claim or a free
made in one statement can tell whether another changed the key between its snapshot
and its lock.

The database side runs the lease store's own steps again (they add the column where it
is missing); the concurrency table has no model, so the state side has nothing to change.
"""

from django.db import migrations

from celery_lease.contrib.django import _migration


class Migration(migrations.Migration):
    dependencies = [("celery_lease", "0015_last_start")]  # noqa: RUF012 (Django's API)

    operations = [  # noqa: RUF012 (Django's API)
        migrations.RunPython(_migration.forwards, _migration.backwards, elidable=False),
    ]
