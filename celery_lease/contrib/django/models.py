"""Read-only models mapping the lease tables (``celery_lease/store/schema.py``).

The tables belong to the lease store: they are created by the store's own migration
steps (see ``migrations/0001_initial.py``), written only through the store, and these
models are ``managed = False``. Their table names follow ``CELERY_LEASE_TABLE_PREFIX``
and ``CELERY_LEASE_SCHEMA``; reads go to ``CELERY_LEASE_DATABASE_ALIAS``.

Django needs one primary-key column per model. The steps table's key is
``(task_id, name)``; :class:`Step` declares ``task`` as its primary key, which is
enough for what the admin does with it (list the steps of one task) and never
used to save or fetch a single step.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import models

from ...states import State
from . import _conf
from .fields import LeaseTimeField, StepTaskField

STATE_CHOICES = [(s.value, s.value) for s in State]


class LeaseManager(models.Manager):
    """Reads from the database alias holding the lease tables."""

    def get_queryset(self) -> Any:
        return super().get_queryset().using(_conf.database_alias())


class Task(models.Model):
    """One leased task (a row of ``<prefix>tasks``)."""

    id = models.CharField(primary_key=True, max_length=255)
    name = models.CharField(max_length=255)
    state = models.CharField(max_length=16, choices=STATE_CHOICES)
    attempt = models.IntegerField(default=0)
    token = models.CharField(max_length=32, null=True)
    owner = models.CharField(
        max_length=64, null=True, help_text="Incarnation id of the worker of the latest attempt."
    )
    recoveries = models.IntegerField(default=0)
    retries = models.IntegerField(default=0)
    dedup_key = models.CharField(max_length=255, null=True, unique=True)
    args = models.TextField(null=True)
    kwargs = models.TextField(null=True)
    options = models.TextField(null=True)
    message = models.TextField(null=True, help_text="The message Celery built for the task (JSON).")
    origin = models.CharField(
        max_length=255, null=True, help_text="The broker of the task's app (URL, no password)."
    )
    revision = models.CharField(
        max_length=32,
        null=True,
        help_text="Set while a PENDING task's arguments were replaced by a later submission "
        "with its dedup key (the revision of its message).",
    )
    eta = LeaseTimeField(null=True)
    lease_ttl = models.FloatField()
    max_runtime = models.FloatField(null=True)
    max_retries = models.IntegerField(null=True)
    on_timeout = models.CharField(max_length=8, default="retry")
    on_exhausted = models.CharField(max_length=8, default="fail")
    max_recoveries = models.IntegerField()
    created_at = LeaseTimeField()
    updated_at = LeaseTimeField()
    published_at = LeaseTimeField(null=True)
    publish_count = models.IntegerField(default=0)
    started_at = LeaseTimeField(null=True)
    progress_at = LeaseTimeField(null=True)
    finished_at = LeaseTimeField(null=True)
    next_retry_at = LeaseTimeField(null=True)
    result = models.TextField(null=True)
    error = models.TextField(null=True)
    reason = models.TextField(null=True)
    progress = models.TextField(null=True)
    cancel_requested_at = LeaseTimeField(null=True)
    cancel_actor = models.CharField(max_length=255, null=True)
    cancel_reason = models.TextField(null=True)
    follow_ups_at = LeaseTimeField(
        null=True,
        help_text="Follow-ups recorded with the success and not yet published "
        "(chain, link callbacks, chord part-return), since.",
    )
    held = models.BooleanField(
        default=False,
        help_text="Held in the store until its ETA (lease_hold_eta_after): the reaper "
        "publishes it when due.",
    )
    slot_key = models.CharField(
        max_length=255,
        null=True,
        help_text="A task with a concurrency limit: the key its last claim counted it "
        "under (empty: the task's one global limit).",
    )
    slot = models.CharField(
        max_length=8,
        null=True,
        help_text="While PENDING: 'waiting' for a concurrency slot (published when one "
        "frees), 'granted' one (published, not yet claimed), or 'paced' by a global rate "
        "limit (a start reserved at its ETA).",
    )

    objects: ClassVar[LeaseManager] = LeaseManager()

    class Meta:
        managed = False
        db_table = _conf.db_table("tasks")
        ordering = ("-created_at",)
        verbose_name = "leased task"
        verbose_name_plural = "leased tasks"
        # rows change only through the operator API: no add/change/delete permissions
        default_permissions = ("view",)
        permissions = (
            ("retry_task", "Can retry a leased task"),
            ("fail_task", "Can fail a leased task"),
            ("resolve_task", "Can resolve a leased task"),
            ("cancel_task", "Can cancel a leased task"),
        )

    def __str__(self) -> str:
        return f"{self.name}[{self.id}]"


class Transition(models.Model):
    """One audit row: a state change with who made it and why."""

    id = models.BigAutoField(primary_key=True)
    task = models.ForeignKey(
        Task,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_column="task_id",
        related_name="transitions",
    )
    from_state = models.CharField(max_length=16, null=True, choices=STATE_CHOICES)
    to_state = models.CharField(max_length=16, choices=STATE_CHOICES)
    reason = models.TextField(null=True)
    actor = models.CharField(max_length=255)
    attempt = models.IntegerField()
    at = LeaseTimeField()

    objects: ClassVar[LeaseManager] = LeaseManager()

    class Meta:
        managed = False
        db_table = _conf.db_table("transitions")
        ordering = ("id",)
        verbose_name = "transition"
        verbose_name_plural = "audit trail"
        default_permissions = ("view",)

    def __str__(self) -> str:
        return f"{self.from_state or '(new)'} -> {self.to_state}"


class Step(models.Model):
    """One recorded step of a task (the real key is ``(task_id, name)``)."""

    task = StepTaskField(
        Task,
        primary_key=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_column="task_id",
        related_name="steps",
    )
    name = models.CharField(max_length=255)
    state = models.CharField(max_length=16)
    idempotent = models.BooleanField()
    checkable = models.BooleanField(default=False)
    attempt = models.IntegerField()
    result = models.TextField(null=True)
    started_at = LeaseTimeField()
    finished_at = LeaseTimeField(null=True)

    objects: ClassVar[LeaseManager] = LeaseManager()

    class Meta:
        managed = False
        db_table = _conf.db_table("steps")
        ordering = ("started_at", "name")
        verbose_name = "step"
        verbose_name_plural = "steps"
        default_permissions = ("view",)

    def __str__(self) -> str:
        return str(self.name)


class Worker(models.Model):
    """One worker incarnation (a fresh id per start; host and pid are for humans)."""

    id = models.CharField(primary_key=True, max_length=64)
    nodename = models.CharField(max_length=255)
    hostname = models.CharField(max_length=255)
    pid = models.IntegerField()
    started_at = LeaseTimeField()
    heartbeat_at = LeaseTimeField()
    stopped_at = LeaseTimeField(null=True)
    stop_reason = models.TextField(null=True)
    origin = models.CharField(
        max_length=255, null=True, help_text="The broker of the worker's app (URL, no password)."
    )

    objects: ClassVar[LeaseManager] = LeaseManager()

    class Meta:
        managed = False
        db_table = _conf.db_table("workers")
        ordering = ("-started_at",)
        verbose_name = "lease worker"
        verbose_name_plural = "lease workers"
        default_permissions = ("view",)

    def __str__(self) -> str:
        return f"{self.nodename} ({self.id})"


PAUSE_KINDS = [("queue", "queue"), ("task", "task name")]


class Pause(models.Model):
    """A queue or task name paused now (a row of ``<prefix>pauses``).

    The table's key is ``(kind, target)``; Django needs one primary-key field, so
    ``target`` is declared as the key. The admin never fetches a pause by it: the pauses
    page reads and changes them through the operator API.
    """

    kind = models.CharField(max_length=8, choices=PAUSE_KINDS)
    target = models.CharField(max_length=255, primary_key=True)
    actor = models.CharField(max_length=255)
    reason = models.TextField()
    paused_at = LeaseTimeField()

    objects: ClassVar[LeaseManager] = LeaseManager()

    class Meta:
        managed = False
        db_table = _conf.db_table("pauses")
        ordering = ("paused_at",)
        verbose_name = "pause"
        verbose_name_plural = "pauses"
        # pausing and resuming go through the operator API, with these permissions
        default_permissions = ("view",)
        permissions = (
            ("pause_task", "Can pause a queue or task name"),
            ("resume_task", "Can resume a paused queue or task name"),
        )

    def __str__(self) -> str:
        return f"{self.kind} {self.target}"


class PauseEvent(models.Model):
    """One pause or resume, with who and why (a row of ``<prefix>pause_log``)."""

    id = models.BigAutoField(primary_key=True)
    kind = models.CharField(max_length=8, choices=PAUSE_KINDS)
    target = models.CharField(max_length=255)
    action = models.CharField(max_length=8)
    actor = models.CharField(max_length=255)
    reason = models.TextField()
    at = LeaseTimeField()

    objects: ClassVar[LeaseManager] = LeaseManager()

    class Meta:
        managed = False
        db_table = _conf.db_table("pause_log")
        ordering = ("-id",)
        verbose_name = "pause history entry"
        verbose_name_plural = "pause history"
        default_permissions = ("view",)

    def __str__(self) -> str:
        return f"{self.action} {self.kind} {self.target}"
