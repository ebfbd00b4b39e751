"""The lease tables: created by the lease store's own schema steps.

The database side runs :func:`celery_lease.store.migrations.migrate` (what
``celery -A proj lease migrate`` runs) through the lease store's SQLAlchemy engine;
the state side tells Django what the tables look like, for the read-only models.
Table names follow ``CELERY_LEASE_TABLE_PREFIX`` / ``CELERY_LEASE_SCHEMA``, as the
models' do, so the state always matches the models.
"""

import django.db.models.deletion
from django.db import migrations, models

import celery_lease.contrib.django.fields
from celery_lease.contrib.django import _conf, _migration


class Migration(migrations.Migration):
    initial = True

    dependencies: list[tuple[str, str]] = []  # noqa: RUF012 (Django's API)

    operations = [  # noqa: RUF012 (Django's API)
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunPython(_migration.forwards, _migration.backwards, elidable=False),
            ],
            state_operations=[
                migrations.CreateModel(
                    name="Task",
                    fields=[
                        ("id", models.CharField(max_length=255, primary_key=True, serialize=False)),
                        ("name", models.CharField(max_length=255)),
                        (
                            "state",
                            models.CharField(
                                choices=[
                                    ("PENDING", "PENDING"),
                                    ("RUNNING", "RUNNING"),
                                    ("SUCCEEDED", "SUCCEEDED"),
                                    ("FAILED", "FAILED"),
                                    ("RETRY_WAIT", "RETRY_WAIT"),
                                    ("TIMEOUT", "TIMEOUT"),
                                    ("WAIT_MANUAL", "WAIT_MANUAL"),
                                    ("CANCELLED", "CANCELLED"),
                                ],
                                max_length=16,
                            ),
                        ),
                        ("attempt", models.IntegerField(default=0)),
                        ("token", models.CharField(max_length=32, null=True)),
                        (
                            "owner",
                            models.CharField(
                                help_text="Incarnation id of the worker of the latest attempt.",
                                max_length=64,
                                null=True,
                            ),
                        ),
                        ("recoveries", models.IntegerField(default=0)),
                        ("retries", models.IntegerField(default=0)),
                        ("dedup_key", models.CharField(max_length=255, null=True, unique=True)),
                        ("args", models.TextField(null=True)),
                        ("kwargs", models.TextField(null=True)),
                        ("options", models.TextField(null=True)),
                        ("eta", celery_lease.contrib.django.fields.LeaseTimeField(null=True)),
                        ("lease_ttl", models.FloatField()),
                        ("max_runtime", models.FloatField(null=True)),
                        ("max_retries", models.IntegerField(null=True)),
                        ("on_timeout", models.CharField(default="retry", max_length=8)),
                        ("on_exhausted", models.CharField(default="fail", max_length=8)),
                        ("max_recoveries", models.IntegerField()),
                        ("created_at", celery_lease.contrib.django.fields.LeaseTimeField()),
                        ("updated_at", celery_lease.contrib.django.fields.LeaseTimeField()),
                        (
                            "published_at",
                            celery_lease.contrib.django.fields.LeaseTimeField(null=True),
                        ),
                        ("publish_count", models.IntegerField(default=0)),
                        (
                            "started_at",
                            celery_lease.contrib.django.fields.LeaseTimeField(null=True),
                        ),
                        (
                            "progress_at",
                            celery_lease.contrib.django.fields.LeaseTimeField(null=True),
                        ),
                        (
                            "finished_at",
                            celery_lease.contrib.django.fields.LeaseTimeField(null=True),
                        ),
                        (
                            "next_retry_at",
                            celery_lease.contrib.django.fields.LeaseTimeField(null=True),
                        ),
                        ("result", models.TextField(null=True)),
                        ("error", models.TextField(null=True)),
                        ("reason", models.TextField(null=True)),
                        ("progress", models.TextField(null=True)),
                        (
                            "cancel_requested_at",
                            celery_lease.contrib.django.fields.LeaseTimeField(null=True),
                        ),
                        ("cancel_actor", models.CharField(max_length=255, null=True)),
                        ("cancel_reason", models.TextField(null=True)),
                    ],
                    options={
                        "verbose_name": "leased task",
                        "verbose_name_plural": "leased tasks",
                        "db_table": _conf.db_table("tasks"),
                        "ordering": ("-created_at",),
                        "permissions": (
                            ("retry_task", "Can retry a leased task"),
                            ("fail_task", "Can fail a leased task"),
                            ("resolve_task", "Can resolve a leased task"),
                            ("cancel_task", "Can cancel a leased task"),
                        ),
                        "managed": False,
                        "default_permissions": ("view",),
                    },
                ),
                migrations.CreateModel(
                    name="Transition",
                    fields=[
                        ("id", models.BigAutoField(primary_key=True, serialize=False)),
                        (
                            "from_state",
                            models.CharField(
                                choices=[
                                    ("PENDING", "PENDING"),
                                    ("RUNNING", "RUNNING"),
                                    ("SUCCEEDED", "SUCCEEDED"),
                                    ("FAILED", "FAILED"),
                                    ("RETRY_WAIT", "RETRY_WAIT"),
                                    ("TIMEOUT", "TIMEOUT"),
                                    ("WAIT_MANUAL", "WAIT_MANUAL"),
                                    ("CANCELLED", "CANCELLED"),
                                ],
                                max_length=16,
                                null=True,
                            ),
                        ),
                        (
                            "to_state",
                            models.CharField(
                                choices=[
                                    ("PENDING", "PENDING"),
                                    ("RUNNING", "RUNNING"),
                                    ("SUCCEEDED", "SUCCEEDED"),
                                    ("FAILED", "FAILED"),
                                    ("RETRY_WAIT", "RETRY_WAIT"),
                                    ("TIMEOUT", "TIMEOUT"),
                                    ("WAIT_MANUAL", "WAIT_MANUAL"),
                                    ("CANCELLED", "CANCELLED"),
                                ],
                                max_length=16,
                            ),
                        ),
                        ("reason", models.TextField(null=True)),
                        ("actor", models.CharField(max_length=255)),
                        ("attempt", models.IntegerField()),
                        ("at", celery_lease.contrib.django.fields.LeaseTimeField()),
                    ],
                    options={
                        "verbose_name": "transition",
                        "verbose_name_plural": "audit trail",
                        "db_table": _conf.db_table("transitions"),
                        "ordering": ("id",),
                        "managed": False,
                        "default_permissions": ("view",),
                    },
                ),
                migrations.CreateModel(
                    name="Worker",
                    fields=[
                        ("id", models.CharField(max_length=64, primary_key=True, serialize=False)),
                        ("nodename", models.CharField(max_length=255)),
                        ("hostname", models.CharField(max_length=255)),
                        ("pid", models.IntegerField()),
                        ("started_at", celery_lease.contrib.django.fields.LeaseTimeField()),
                        ("heartbeat_at", celery_lease.contrib.django.fields.LeaseTimeField()),
                        (
                            "stopped_at",
                            celery_lease.contrib.django.fields.LeaseTimeField(null=True),
                        ),
                        ("stop_reason", models.TextField(null=True)),
                    ],
                    options={
                        "verbose_name": "lease worker",
                        "verbose_name_plural": "lease workers",
                        "db_table": _conf.db_table("workers"),
                        "ordering": ("-started_at",),
                        "managed": False,
                        "default_permissions": ("view",),
                    },
                ),
                migrations.CreateModel(
                    name="Step",
                    fields=[
                        (
                            "task",
                            celery_lease.contrib.django.fields.StepTaskField(
                                db_column="task_id",
                                db_constraint=False,
                                on_delete=django.db.models.deletion.DO_NOTHING,
                                primary_key=True,
                                related_name="steps",
                                serialize=False,
                                to="celery_lease.task",
                            ),
                        ),
                        ("name", models.CharField(max_length=255)),
                        ("state", models.CharField(max_length=16)),
                        ("idempotent", models.BooleanField()),
                        ("checkable", models.BooleanField(default=False)),
                        ("attempt", models.IntegerField()),
                        ("result", models.TextField(null=True)),
                        ("started_at", celery_lease.contrib.django.fields.LeaseTimeField()),
                        (
                            "finished_at",
                            celery_lease.contrib.django.fields.LeaseTimeField(null=True),
                        ),
                    ],
                    options={
                        "verbose_name": "step",
                        "verbose_name_plural": "steps",
                        "db_table": _conf.db_table("steps"),
                        "ordering": ("started_at", "name"),
                        "managed": False,
                        "default_permissions": ("view",),
                    },
                ),
            ],
        ),
    ]
