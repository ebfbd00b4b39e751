"""The pauses and their history (schema version 3's tables), for the pauses page.

State only: the lease store's own steps created the tables (every earlier migration
runs all of them), so nothing is run on the database. Table names follow
``CELERY_LEASE_TABLE_PREFIX`` / ``CELERY_LEASE_SCHEMA``, as the models' do.
"""

from django.db import migrations, models

import celery_lease.contrib.django.fields
from celery_lease.contrib.django import _conf

KINDS = [("queue", "queue"), ("task", "task name")]


class Migration(migrations.Migration):
    dependencies = [("celery_lease", "0003_task_message")]  # noqa: RUF012 (Django's API)

    operations = [  # noqa: RUF012 (Django's API)
        migrations.CreateModel(
            name="Pause",
            fields=[
                ("kind", models.CharField(choices=KINDS, max_length=8)),
                ("target", models.CharField(max_length=255, primary_key=True, serialize=False)),
                ("actor", models.CharField(max_length=255)),
                ("reason", models.TextField()),
                ("paused_at", celery_lease.contrib.django.fields.LeaseTimeField()),
            ],
            options={
                "verbose_name": "pause",
                "verbose_name_plural": "pauses",
                "db_table": _conf.db_table("pauses"),
                "ordering": ("paused_at",),
                "permissions": (
                    ("pause_task", "Can pause a queue or task name"),
                    ("resume_task", "Can resume a paused queue or task name"),
                ),
                "managed": False,
                "default_permissions": ("view",),
            },
        ),
        migrations.CreateModel(
            name="PauseEvent",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("kind", models.CharField(choices=KINDS, max_length=8)),
                ("target", models.CharField(max_length=255)),
                ("action", models.CharField(max_length=8)),
                ("actor", models.CharField(max_length=255)),
                ("reason", models.TextField()),
                ("at", celery_lease.contrib.django.fields.LeaseTimeField()),
            ],
            options={
                "verbose_name": "pause history entry",
                "verbose_name_plural": "pause history",
                "db_table": _conf.db_table("pause_log"),
                "ordering": ("-id",),
                "managed": False,
                "default_permissions": ("view",),
            },
        ),
    ]
