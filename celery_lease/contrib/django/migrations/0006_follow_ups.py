"""Schema version 6: ``tasks.follow_ups_at``, follow-ups recorded with a success and not
yet published.

The database side runs the lease store's own steps again (they add the column and its
index where they are missing); the state side adds the field to the read-only model.
"""

from django.db import migrations

from celery_lease.contrib.django import _migration
from celery_lease.contrib.django.fields import LeaseTimeField


class Migration(migrations.Migration):
    dependencies = [("celery_lease", "0005_transition_totals")]  # noqa: RUF012 (Django's API)

    operations = [  # noqa: RUF012 (Django's API)
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunPython(_migration.forwards, _migration.backwards, elidable=False),
            ],
            state_operations=[
                migrations.AddField(
                    model_name="task",
                    name="follow_ups_at",
                    field=LeaseTimeField(
                        help_text="Follow-ups recorded with the success and not yet published "
                        "(chain, link callbacks, chord part-return), since.",
                        null=True,
                    ),
                ),
            ],
        ),
    ]
