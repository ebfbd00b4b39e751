"""Leased tasks of the test project (loaded by workers through CELERY_IMPORTS)."""

from typing import Any

from celery_lease import LeasedTask

from .celery import app


@app.task(base=LeasedTask, bind=True, name="proj.tasks.add")
def add(self: Any, a: int, b: int) -> int:
    return a + b
