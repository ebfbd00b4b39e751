"""Publishing rows: the one place that sends a PENDING row's message and records it.

The row is the outbox: whoever holds a reserved PENDING row (the reaper after a lost
or never-published message, a worker that could not claim a delivery, an operator's
retry) publishes it here, with the message Celery built for it
(:mod:`celery_lease.producer.message`), and records it published.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

from celery import Celery
from kombu.exceptions import OperationalError as KombuOperationalError
from kombu.utils.json import loads as json_loads

from .. import notify
from .._broker import PUBLISH_RETRY, timed_out
from ..store import Publishable, Store
from . import message as _message

logger = logging.getLogger("celery_lease.publish")


class Published(NamedTuple):
    """What one :func:`publish_rows` did."""

    sent: int
    failed: int
    #: The broker failed or did not answer in time (the rest of the rows were left).
    broker_down: bool


def publish(app: Celery, store: Store, rows: Sequence[Publishable]) -> tuple[int, int]:
    """Publish PENDING rows' messages; returns (sent, failed). Rows left unpublished
    are published again after ``lease_publish_grace``."""
    done = publish_rows(app, store, rows)
    return done.sent, done.failed


def publish_rows(
    app: Celery, store: Store, rows: Sequence[Publishable], *, retry: bool = True
) -> Published:
    """:func:`publish`, telling whether it stopped because of the broker. Each message
    is given up after about ``lease_db_timeout`` without an answer (see
    :mod:`._broker`; ``retry=False``: after one try); the first such failure leaves the
    rest for later."""
    sent: list[str] = []
    failed = 0
    broker_down = False
    if rows:
        # the lease states this process committed for these rows (an operator's PENDING,
        # the reaper's TIMEOUT) reach the result backend before the message can start a
        # run: Celery writes that run's STARTED before its claim, and it is newer news
        notify.flush(store, notify.BEFORE_PUBLISH_TIMEOUT)
    origin = store.config.origin
    for row in rows:
        if row.origin is not None and row.origin != origin:
            # another broker's row (an operator's retry through another app): left
            # unpublished, its own app's reaper publishes it after lease_publish_grace
            logger.info(
                "task %s[%s]: not published to this app's broker; it belongs to %s",
                row.name,
                row.id,
                row.origin,
            )
            continue
        if row.args is None:
            logger.error(
                "task %s[%s]: arguments were not stored, cannot publish; "
                "it needs a person (`celery lease show %s`)",
                row.name,
                row.id,
                row.id,
            )
            failed += 1
            continue
        try:
            try:
                _send(app, store, row, retry)
            except _BROKER_ERRORS as error:
                if retry or timed_out(error):
                    raise
                # failed at once: a pooled connection a broker restart left stale; the
                # pool reconnects for the second try (a broker that does not answer is
                # not waited for twice)
                _send(app, store, row, retry)
        except _BROKER_ERRORS as error:
            logger.warning(
                "broker unavailable, %d rows left to publish later: %s",
                len(rows) - len(sent),
                error,
            )
            failed += len(rows) - len(sent)
            broker_down = True
            break
        sent.append(row.id)
    if sent:
        store.mark_published(sent)
    return Published(len(sent), failed, broker_down)


_BROKER_ERRORS = (KombuOperationalError, ConnectionError, OSError)


def _send(app: Celery, store: Store, row: Publishable, retry: bool) -> None:
    if row.message is not None:
        _message.send_stored(
            app, row.message, countdown=row.countdown, timeout=store.config.db_timeout, retry=retry
        )
    else:
        _send_legacy(app, row, retry)


def _send_legacy(app: Celery, row: Publishable, retry: bool) -> None:
    """A row stored before rows kept their message: name, arguments and routing only."""
    options: dict[str, Any] = json.loads(row.options) if row.options else {}
    app.send_task(
        row.name,
        args=json_loads(row.args or "[]"),
        kwargs=json_loads(row.kwargs) if row.kwargs else {},
        task_id=row.id,
        retries=row.retries,
        countdown=row.countdown,
        retry=retry,
        retry_policy=dict(PUBLISH_RETRY),
        **options,
    )
