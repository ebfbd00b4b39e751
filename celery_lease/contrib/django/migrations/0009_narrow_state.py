"""Schema version 9: what a task's lifecycle writes, narrowed (no index on
(name, state), the dedup index only over rows that have a key, PostgreSQL fillfactor
70 on the tasks table). No column changes: the models stay as they are.

The database side runs the lease store's own steps again (see ``_migration``).
"""

from django.db import migrations

from celery_lease.contrib.django import _migration


class Migration(migrations.Migration):
    dependencies = [("celery_lease", "0008_origin")]  # noqa: RUF012 (Django's API)

    operations = [  # noqa: RUF012 (Django's API)
        migrations.RunPython(_migration.forwards, _migration.backwards, elidable=False),
    ]
