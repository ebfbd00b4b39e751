"""Schema version 13: concurrency limits. ``tasks.slot_key`` and ``tasks.slot`` (a
limited task's key and its row waiting for, or granted, a slot), their indexes, and the
``concurrency`` table (a row per limited task and key: its lock and limit).

The database side runs the lease store's own steps again (they add what is missing);
the state side adds the fields to the read-only model (the concurrency table has no
model: ``celery lease stats`` shows it).
"""

from django.db import migrations, models

from celery_lease.contrib.django import _migration


class Migration(migrations.Migration):
    dependencies = [("celery_lease", "0012_revision")]  # noqa: RUF012 (Django's API)

    operations = [  # noqa: RUF012 (Django's API)
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunPython(_migration.forwards, _migration.backwards, elidable=False),
            ],
            state_operations=[
                migrations.AddField(
                    model_name="task",
                    name="slot_key",
                    field=models.CharField(
                        help_text="A task with a concurrency limit: the key its last claim "
                        "counted it under (empty: the task's one global limit).",
                        max_length=255,
                        null=True,
                    ),
                ),
                migrations.AddField(
                    model_name="task",
                    name="slot",
                    field=models.CharField(
                        help_text="While PENDING: 'waiting' for a concurrency slot "
                        "(published when one frees) or 'granted' one (published, not yet "
                        "claimed).",
                        max_length=8,
                        null=True,
                    ),
                ),
            ],
        ),
    ]
