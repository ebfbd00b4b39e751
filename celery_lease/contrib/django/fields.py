"""Model fields for columns whose storage differs from Django's defaults."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from django.db import models
from django.utils import timezone as dj_timezone


class LeaseTimeField(models.DateTimeField):
    """A lease-store timestamp (``DbTime``): ``timestamptz`` on PostgreSQL, epoch seconds
    (REAL) on SQLite, where the store needs sub-second precision. Values are aware UTC
    datetimes on both.

    Its internal type is its own so that no backend converter (SQLite's parses ISO
    strings) runs before :meth:`from_db_value`.
    """

    def get_internal_type(self) -> str:
        return "LeaseTimeField"

    def db_type(self, connection: Any) -> str:
        return "real" if connection.vendor == "sqlite" else "timestamp with time zone"

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> datetime | None:
        if value is None:
            return None
        if isinstance(value, datetime):
            return value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)
        return datetime.fromtimestamp(float(value), timezone.utc)

    def get_db_prep_value(self, value: Any, connection: Any, prepared: bool = False) -> Any:
        if not prepared:
            value = self.get_prep_value(value)
        if value is None:
            return None
        if connection.vendor == "sqlite":
            if dj_timezone.is_naive(value):
                value = dj_timezone.make_aware(value, timezone.utc)
            return value.timestamp()
        return connection.ops.adapt_datetimefield_value(value)


class StepTaskField(models.ForeignKey):
    """The task of a step, standing in as the step's primary key.

    The steps table's key is ``(task_id, name)``; Django wants a single primary-key
    field, and steps are only ever read by task (the admin's inline), so ``task`` plays
    that part. It is not unique in fact, so Django's advice for unique foreign keys
    (use a OneToOneField) does not apply.
    """

    def _check_unique(self, **kwargs: Any) -> list[Any]:
        return []
