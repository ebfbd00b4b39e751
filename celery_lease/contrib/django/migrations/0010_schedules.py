"""Schema version 10: the beat's tables (a row per periodic entry of a leased task, and
the beat processes seen; see :mod:`celery_lease.beat`). The database side runs the
lease store's own steps again; the Django models do not map these tables (as for the
counters), so the state is unchanged."""

from django.db import migrations

from celery_lease.contrib.django import _migration


class Migration(migrations.Migration):
    dependencies = [("celery_lease", "0009_narrow_state")]  # noqa: RUF012 (Django's API)

    operations = [  # noqa: RUF012 (Django's API)
        migrations.RunPython(_migration.forwards, _migration.backwards, elidable=False),
    ]
