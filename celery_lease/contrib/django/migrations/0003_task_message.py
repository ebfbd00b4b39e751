"""Schema version 4: ``tasks.message``, the message Celery built for the task.

The database side runs the lease store's own steps again (they add the column where it
is missing); the state side adds the field to the read-only model.
"""

from django.db import migrations, models

from celery_lease.contrib.django import _migration


class Migration(migrations.Migration):
    dependencies = [("celery_lease", "0002_operations")]  # noqa: RUF012 (Django's API)

    operations = [  # noqa: RUF012 (Django's API)
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunPython(_migration.forwards, _migration.backwards, elidable=False),
            ],
            state_operations=[
                migrations.AddField(
                    model_name="task",
                    name="message",
                    field=models.TextField(
                        help_text="The message Celery built for the task (JSON).", null=True
                    ),
                ),
            ],
        ),
    ]
