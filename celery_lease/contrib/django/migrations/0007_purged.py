"""Schema version 7: tombstones of purged task ids, so that a message arriving after its
row was purged is not adopted as a new task. The database side runs the lease store's
own steps again; the Django models do not map this table (as for the counters), so the
state is unchanged."""

from django.db import migrations

from celery_lease.contrib.django import _migration


class Migration(migrations.Migration):
    dependencies = [("celery_lease", "0006_follow_ups")]  # noqa: RUF012 (Django's API)

    operations = [  # noqa: RUF012 (Django's API)
        migrations.RunPython(_migration.forwards, _migration.backwards, elidable=False),
    ]
