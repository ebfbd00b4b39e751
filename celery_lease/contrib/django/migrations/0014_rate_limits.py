"""Schema version 14: global rate limits. ``concurrency.next_start_at`` (the earliest
start of a rate-limited task and key not yet given out) and a third value of
``tasks.slot``, ``paced`` (a start reserved for the row at its ETA).

The database side runs the lease store's own steps again (they add the column where it
is missing); the state side updates the help text of the read-only model's field (the
concurrency table has no model: ``celery lease stats`` shows it).
"""

from django.db import migrations, models

from celery_lease.contrib.django import _migration


class Migration(migrations.Migration):
    dependencies = [("celery_lease", "0013_concurrency")]  # noqa: RUF012 (Django's API)

    operations = [  # noqa: RUF012 (Django's API)
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunPython(_migration.forwards, _migration.backwards, elidable=False),
            ],
            state_operations=[
                migrations.AlterField(
                    model_name="task",
                    name="slot",
                    field=models.CharField(
                        help_text="While PENDING: 'waiting' for a concurrency slot "
                        "(published when one frees), 'granted' one (published, not yet "
                        "claimed), or 'paced' by a global rate limit (a start reserved at "
                        "its ETA).",
                        max_length=8,
                        null=True,
                    ),
                ),
            ],
        ),
    ]
