"""What the Django migrations run: the lease store's own schema steps.

The Django migrations do not describe the tables themselves; each one that changes
the database calls :func:`forwards`, which runs
:func:`celery_lease.store.migrations.migrate` (the steps ``celery -A proj lease migrate``
runs) through the lease store's SQLAlchemy engine, in a transaction of its own.
Every missing step is applied, so one call brings any database to the current
``SCHEMA_VERSION``; a later schema version adds a Django migration that calls it
again, next to the ``AlterField``-style state operations that keep the models in step.

The reverse is a no-op: unapplying the Django migration leaves the tables and their
audit trail alone (drop them by hand if that is really wanted).
"""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from ..._runtime import runtime
from ...store import Store
from . import _conf

logger = logging.getLogger("celery_lease.contrib.django")


def forwards(apps: Any, schema_editor: Any) -> None:
    """Create or upgrade the lease tables (only on ``CELERY_LEASE_DATABASE_ALIAS``)."""
    if schema_editor.connection.alias != _conf.database_alias():
        return
    app = _conf.lease_app()
    config = runtime(app).config
    if (config.table_prefix, config.schema) != (_conf.table_prefix(), _conf.schema()):
        raise ImproperlyConfigured(
            f"the Celery app's lease tables (prefix {config.table_prefix!r}, schema "
            f"{config.schema!r}) are not the ones the Django models map (prefix "
            f"{_conf.table_prefix()!r}, schema {_conf.schema()!r}): set "
            f"{_conf.SETTING_PREFIX} / {_conf.SETTING_SCHEMA} in the Django settings"
        )
    store = Store(config)
    try:
        before, after = store.migrate()
    finally:
        store.dispose()
    if before != after:
        logger.info(
            "celery-lease: %s migrated from %s to schema version %s",
            store.url,
            before or "nothing",
            after,
        )


def backwards(apps: Any, schema_editor: Any) -> None:
    """Leave the lease tables in place (see the module docstring)."""
