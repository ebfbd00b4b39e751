"""Schema version 5: the transition totals the reaper folds from the audit table, and
their watermark. The database side runs the lease store's own steps again; the Django
models do not map these tables (as for the counters), so the state is
unchanged."""

from django.db import migrations

from celery_lease.contrib.django import _migration


class Migration(migrations.Migration):
    dependencies = [("celery_lease", "0004_pauses")]  # noqa: RUF012 (Django's API)

    operations = [  # noqa: RUF012 (Django's API)
        migrations.RunPython(_migration.forwards, _migration.backwards, elidable=False),
    ]
