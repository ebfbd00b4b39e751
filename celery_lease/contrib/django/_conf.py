"""Where the Django app finds its Celery app, its settings and its database.

Every ``lease_*`` setting is read by the Celery app (``app.config_from_object(
"django.conf:settings", namespace="CELERY")`` makes ``CELERY_LEASE_TTL`` the
``lease_ttl`` setting), so workers, the CLI and the admin agree. Three settings are
the Django app's own:

``CELERY_LEASE_APP``
    ``"proj.celery:app"`` (or ``"proj.celery.app"``): the Celery app whose lease store
    the admin acts on. Default: ``celery.current_app``.
``CELERY_LEASE_DATABASE_ALIAS``
    The ``DATABASES`` alias the lease tables live in (default ``"default"``): the
    models read through it, the migration runs on it, and, when
    ``CELERY_LEASE_DATABASE_URL`` is not set, the lease store connects to it.
``CELERY_LEASE_TABLE_PREFIX`` / ``CELERY_LEASE_SCHEMA``
    Read here too, because the models' table names are fixed when Django imports
    them; a system check fails when the Celery app's configuration disagrees.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from celery import Celery
from sqlalchemy.engine import URL

from ... import config as lease_config
from ..._apps import AppRegistry
from ..._runtime import runtime
from ...exceptions import ConfigurationError

SETTING_APP = "CELERY_LEASE_APP"
SETTING_ALIAS = "CELERY_LEASE_DATABASE_ALIAS"
SETTING_PREFIX = "CELERY_LEASE_TABLE_PREFIX"
SETTING_SCHEMA = "CELERY_LEASE_SCHEMA"
SETTING_URL = "CELERY_LEASE_DATABASE_URL"

#: The database URL this module derived from ``DATABASES``, per app. A URL that still
#: equals it was not chosen by the user and follows Django's connection settings
#: (the test runner renames the database after start-up).
_derived: AppRegistry[str] = AppRegistry()
_lock = threading.Lock()


def _setting(name: str, default: Any = None) -> Any:
    from django.conf import settings

    return getattr(settings, name, default)


def table_prefix() -> str:
    """The lease table prefix the models use (``CELERY_LEASE_TABLE_PREFIX``, default ``lease_``)."""
    prefix = _setting(SETTING_PREFIX) or lease_config.LeaseConfig.table_prefix
    return str(prefix)


def schema() -> str | None:
    """The PostgreSQL schema of the lease tables (``CELERY_LEASE_SCHEMA``), if any."""
    value = _setting(SETTING_SCHEMA)
    return str(value) if value else None


def db_table(suffix: str) -> str:
    """The ``Meta.db_table`` of one lease table.

    A schema-qualified name uses Django's quoting trick (``schema"."table``), which
    PostgreSQL reads as ``"schema"."table"``.
    """
    name = f"{table_prefix()}{suffix}"
    qualifier = schema()
    return f'{qualifier}"."{name}' if qualifier else name


def database_alias() -> str:
    """The ``DATABASES`` alias holding the lease tables."""
    return str(_setting(SETTING_ALIAS) or "default")


def get_celery_app() -> Celery:
    """The Celery app named by ``CELERY_LEASE_APP``, else ``celery.current_app``."""
    path = _setting(SETTING_APP)
    if not path:
        # what celery.current_app stands for
        from celery._state import get_current_app

        found: Celery = get_current_app()
        return found
    if isinstance(path, Celery):
        return path
    module_name, sep, attr = str(path).partition(":")
    if not sep:
        module_name, _, attr = str(path).rpartition(".")
    if not module_name or not attr:
        raise ConfigurationError(f'{SETTING_APP} must look like "proj.celery:app", got {path!r}')
    import importlib

    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise ConfigurationError(f"{SETTING_APP} = {path!r} cannot be imported: {error}") from error
    if not isinstance(found, Celery):
        raise ConfigurationError(f"{SETTING_APP} = {path!r} is not a Celery app: {found!r}")
    return found


def django_database_url(alias: str | None = None) -> str:
    """A SQLAlchemy URL for the Django database ``alias`` (its current connection settings:
    during tests, the test database).

    Raises :class:`~celery_lease.ConfigurationError` for engines the lease store does not
    support (only PostgreSQL and SQLite) and for in-memory SQLite databases, which other
    processes (workers) cannot open.
    """
    from django.db import connections

    alias = alias or database_alias()
    return url_from_settings(connections[alias].settings_dict, alias)


#: libpq options of ``DATABASES[...]["OPTIONS"]`` that carry over to the lease store's URL.
_PG_OPTIONS = frozenset(
    {"sslmode", "sslrootcert", "sslcert", "sslkey", "options", "service", "target_session_attrs"}
)


def url_from_settings(conf: dict[str, Any], alias: str = "default") -> str:
    """A SQLAlchemy URL for one ``DATABASES`` entry (see :func:`django_database_url`)."""
    engine = str(conf.get("ENGINE", ""))
    name = conf.get("NAME")
    if engine.endswith(("postgresql", "postgis")):
        options = dict(conf.get("OPTIONS") or {})
        query = {key: str(value) for key, value in options.items() if key in _PG_OPTIONS}
        host = str(conf.get("HOST") or "") or None
        if host and host.startswith("/"):  # a Unix socket directory
            query["host"] = host
            host = None
        port = conf.get("PORT")
        url = URL.create(
            "postgresql+psycopg",
            username=conf.get("USER") or None,
            password=conf.get("PASSWORD") or None,
            host=host,
            port=int(port) if port else None,
            database=str(name) if name else None,
            query=query,
        )
        return url.render_as_string(hide_password=False)
    if engine.endswith("sqlite3"):
        text = str(name or "")
        if not text or text == ":memory:" or "mode=memory" in text:
            raise ConfigurationError(
                f"DATABASES[{alias!r}] is an in-memory SQLite database, which worker processes "
                f"cannot share: give it a file (for tests: TEST NAME) or set {SETTING_URL}"
            )
        return f"sqlite:///{Path(text).expanduser().resolve()}"
    raise ConfigurationError(
        f"DATABASES[{alias!r}] uses {engine or 'no ENGINE'}: the lease store supports "
        f"PostgreSQL and SQLite; set {SETTING_URL} to one of those"
    )


def _explicit_url(app: Celery) -> str | None:
    value = app.conf.get("lease_database_url")
    if value and value != _derived.get(app):
        return str(value)
    if not value and os.environ.get(SETTING_URL):
        return os.environ[SETTING_URL]
    return None


def configure(app: Celery) -> Celery:
    """Point ``app``'s lease store at Django's database unless a URL was chosen.

    When neither the Celery configuration nor the environment sets
    ``lease_database_url``, the URL is derived from ``DATABASES[CELERY_LEASE_DATABASE_ALIAS]``
    and set on ``app.conf``; it is derived again on each call, so a test database that
    Django created after start-up is followed (the app's store is reset when it moves).
    """
    if _explicit_url(app) is not None:
        return app
    url = django_database_url()
    with _lock:
        if app.conf.get("lease_database_url") != url:
            app.conf["lease_database_url"] = url
            _derived[app] = url
            runtime(app).reset()
        else:
            _derived[app] = url
    return app


def lease_app() -> Celery:
    """The Celery app the Django integration acts on, with its lease store configured."""
    return configure(get_celery_app())


def is_derived(app: Celery) -> bool:
    """Whether ``app``'s lease database URL follows Django's ``DATABASES``."""
    return _explicit_url(app) is None


def close_connections() -> None:
    """Close the lease store's pooled connections (the next use opens new ones).

    Django's test runner drops the test database at the end, which PostgreSQL refuses
    while the lease store still holds connections to it: a runner calls this first
    (:class:`celery_lease.contrib.django.testing.DiscoverRunner` does).
    """
    try:
        app = get_celery_app()
    except ConfigurationError:
        return
    runtime(app).reset()
