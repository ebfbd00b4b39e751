"""Schema version 12: ``tasks.revision``, set on a PENDING row whose arguments a later
submission replaced (``on_conflict="replace"``): a message sent before it is refused at
claim.

The database side runs the lease store's own steps again (they add the column where it
is missing); the state side adds the field to the read-only model.
"""

from django.db import migrations, models

from celery_lease.contrib.django import _migration


class Migration(migrations.Migration):
    dependencies = [("celery_lease", "0011_held")]  # noqa: RUF012 (Django's API)

    operations = [  # noqa: RUF012 (Django's API)
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunPython(_migration.forwards, _migration.backwards, elidable=False),
            ],
            state_operations=[
                migrations.AddField(
                    model_name="task",
                    name="revision",
                    field=models.CharField(
                        help_text="Set while a PENDING task's arguments were replaced by a "
                        "later submission with its dedup key (the revision of its message).",
                        max_length=32,
                        null=True,
                    ),
                ),
            ],
        ),
    ]
