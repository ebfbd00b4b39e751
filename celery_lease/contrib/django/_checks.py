"""System checks: the models, the migration and the Celery app must agree on the tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core import checks
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from ..._runtime import runtime
from ...exceptions import CeleryLeaseError
from . import _conf

_registered = False


def register() -> None:
    """Register the checks once (``AppConfig.ready`` may run more than once in tests)."""
    global _registered
    if not _registered:
        checks.register(check_configuration)
        _registered = True


def _same_database(a: str, b: str) -> bool:
    try:
        ua, ub = make_url(a), make_url(b)
    except ArgumentError:
        return a == b
    if ua.get_backend_name() != ub.get_backend_name():
        return False
    if ua.get_backend_name() == "sqlite":
        return Path(ua.database or "").resolve() == Path(ub.database or "").resolve()
    return (ua.host or "", ua.port or 5432, ua.database) == (
        ub.host or "",
        ub.port or 5432,
        ub.database,
    )


def check_configuration(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """The Celery app is found, its prefix and schema match the models, and the lease
    store's database is the one the models read."""
    if app_configs is not None and not any(c.label == "celery_lease" for c in app_configs):
        return []
    try:
        app = _conf.lease_app()
        config = runtime(app).config
    except CeleryLeaseError as error:
        return [
            checks.Error(
                f"celery-lease cannot find its Celery app or database: {error}",
                hint=f'set {_conf.SETTING_APP} ("proj.celery:app") and, for databases other '
                f"than PostgreSQL or SQLite files, {_conf.SETTING_URL}",
                id="celery_lease.E001",
            )
        ]
    errors: list[checks.CheckMessage] = []
    if (config.table_prefix, config.schema) != (_conf.table_prefix(), _conf.schema()):
        errors.append(
            checks.Error(
                f"the Celery app uses lease tables with prefix {config.table_prefix!r} "
                f"(schema {config.schema!r}) but the Django models map prefix "
                f"{_conf.table_prefix()!r} (schema {_conf.schema()!r})",
                hint=f"set {_conf.SETTING_PREFIX} / {_conf.SETTING_SCHEMA} in the Django settings "
                'and load them into the Celery app with namespace="CELERY"',
                id="celery_lease.E002",
            )
        )
    if not _conf.is_derived(app):
        try:
            django_url = _conf.django_database_url()
        except CeleryLeaseError:
            django_url = None
        if django_url is None or not _same_database(config.database_url, django_url):
            alias = _conf.database_alias()
            errors.append(
                checks.Warning(
                    f"lease_database_url is not DATABASES[{alias!r}]: the admin reads the "
                    "lease tables through that alias and will not see the store's rows",
                    hint=f"point {_conf.SETTING_ALIAS} at a DATABASES entry for the lease store, "
                    f"or leave {_conf.SETTING_URL} unset to use DATABASES[{alias!r}]",
                    id="celery_lease.W001",
                )
            )
    return errors
