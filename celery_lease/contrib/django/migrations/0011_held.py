"""Schema version 11: ``tasks.held``, a task due far ahead written and not published
until due (``lease_hold_eta_after``), and the partial index on ``eta`` of the held rows
the reaper reads.

The database side runs the lease store's own steps again (they add the column and its
index where they are missing); the state side adds the field to the read-only model.
"""

from django.db import migrations, models

from celery_lease.contrib.django import _migration


class Migration(migrations.Migration):
    dependencies = [("celery_lease", "0010_schedules")]  # noqa: RUF012 (Django's API)

    operations = [  # noqa: RUF012 (Django's API)
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunPython(_migration.forwards, _migration.backwards, elidable=False),
            ],
            state_operations=[
                migrations.AddField(
                    model_name="task",
                    name="held",
                    field=models.BooleanField(
                        default=False,
                        help_text="Held in the store until its ETA (lease_hold_eta_after): "
                        "the reaper publishes it when due.",
                    ),
                ),
            ],
        ),
    ]
