"""Schema version 15: ``concurrency.last_start_at``, the last start of a rate-limited task
and key. A paced row late for its reserved start takes it when no start was taken
within the last interval (it fills an idle interval), and is paced again otherwise.

The database side runs the lease store's own steps again (they add the column where it
is missing); the concurrency table has no model, so the state side has nothing to change.
"""

from django.db import migrations

from celery_lease.contrib.django import _migration


class Migration(migrations.Migration):
    dependencies = [("celery_lease", "0014_rate_limits")]  # noqa: RUF012 (Django's API)

    operations = [  # noqa: RUF012 (Django's API)
        migrations.RunPython(_migration.forwards, _migration.backwards, elidable=False),
    ]
