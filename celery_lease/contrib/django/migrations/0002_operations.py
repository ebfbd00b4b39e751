"""Lease schema versions 2 and 3: retention's index and the counters table; durable
pauses and their log. The database side runs the lease store's own steps again
(:func:`celery_lease.store.migrations.migrate`, as ``0001_initial`` does): a
database whose lease tables 0001 created at version 1 is brought to the current
version, one already there is left as it is."""

from django.db import migrations

from celery_lease.contrib.django import _migration


class Migration(migrations.Migration):
    dependencies = [("celery_lease", "0001_initial")]  # noqa: RUF012 (Django's API)

    operations = [  # noqa: RUF012 (Django's API)
        migrations.RunPython(_migration.forwards, _migration.backwards, elidable=False),
    ]
