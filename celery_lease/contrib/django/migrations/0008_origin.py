"""Schema version 8: ``origin`` on tasks and workers, the broker of the row's app, so
that apps on different brokers sharing one store each publish only their own rows.

The database side runs the lease store's own steps again (they add the columns where
they are missing); the state side adds the fields to the read-only models.
"""

from django.db import migrations, models

from celery_lease.contrib.django import _migration


class Migration(migrations.Migration):
    dependencies = [("celery_lease", "0007_purged")]  # noqa: RUF012 (Django's API)

    operations = [  # noqa: RUF012 (Django's API)
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunPython(_migration.forwards, _migration.backwards, elidable=False),
            ],
            state_operations=[
                migrations.AddField(
                    model_name="task",
                    name="origin",
                    field=models.CharField(
                        help_text="The broker of the task's app (URL, no password).",
                        max_length=255,
                        null=True,
                    ),
                ),
                migrations.AddField(
                    model_name="worker",
                    name="origin",
                    field=models.CharField(
                        help_text="The broker of the worker's app (URL, no password).",
                        max_length=255,
                        null=True,
                    ),
                ),
            ],
        ),
    ]
