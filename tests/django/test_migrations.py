"""The Django migration creates the lease tables with the store's own steps; the models,
the migration state and the tables agree; the configuration checks catch mismatches."""

from __future__ import annotations

import os
from io import StringIO
from typing import Any

import pytest

pytestmark = pytest.mark.postgres


def test_test_database_has_the_lease_tables_at_the_current_version(django_project: Any):
    from django.db import connection
    from sqlalchemy import inspect, select

    from celery_lease._runtime import runtime
    from celery_lease.store import SCHEMA_VERSION
    from celery_lease.store.migrations import MIGRATIONS

    store = runtime(django_project).store
    # the store follows Django's test database, not the database named in settings
    assert store.engine.url.database == connection.settings_dict["NAME"]
    assert connection.settings_dict["NAME"] == os.environ.get(
        "CELERY_LEASE_DJANGO_TEST_DB", "test_celery_lease_django"
    )
    assert store.schema_version() == SCHEMA_VERSION
    with store.engine.connect() as conn:
        rows = conn.execute(select(store.t.version.c.version, store.t.version.c.description)).all()
        assert [tuple(r) for r in rows] == [(m.version, m.description) for m in MIGRATIONS]
        found = set(inspect(conn).get_table_names())
    assert {t.name for t in store.t.metadata.sorted_tables} <= found


def test_tables_are_those_of_the_schema_definitions(django_project: Any):
    """Columns, nullability and index names of the migrated tables equal store/schema.py."""
    from sqlalchemy import inspect

    from celery_lease._runtime import runtime

    store = runtime(django_project).store
    with store.engine.connect() as conn:
        insp = inspect(conn)
        for table in store.t.metadata.sorted_tables:
            columns = {c["name"]: c["nullable"] for c in insp.get_columns(table.name)}
            assert columns == {c.name: c.nullable for c in table.columns}, table.name
            indexes = {i["name"] for i in insp.get_indexes(table.name)}
            assert indexes == {i.name for i in table.indexes}, table.name


def test_models_map_every_column(django_project: Any):
    from django.apps import apps

    from celery_lease._runtime import runtime

    tables = runtime(django_project).store.t
    expected = {
        "Task": tables.tasks,
        "Transition": tables.transitions,
        "Step": tables.steps,
        "Worker": tables.workers,
        "Pause": tables.pauses,
        "PauseEvent": tables.pause_log,
    }
    for model_name, table in expected.items():
        model = apps.get_model("celery_lease", model_name)
        assert model._meta.db_table == table.name
        assert model._meta.managed is False
        columns = {f.column: f.null for f in model._meta.concrete_fields}
        sql_columns = {c.name: c.nullable for c in table.columns}
        if model_name == "Step":
            # Django's one primary-key field stands in for the (task_id, name) key
            columns["task_id"] = False
        if model_name == "Pause":
            # likewise for the (kind, target) key
            columns["target"] = False
        assert columns == sql_columns, model_name


def test_migration_state_matches_the_models(django_project: Any):
    from django.core.management import call_command

    out = StringIO()
    # exits non-zero (SystemExit) when the models need a migration the app lacks
    call_command("makemigrations", "celery_lease", check=True, dry_run=True, stdout=out)
    assert "No changes detected" in out.getvalue()


def test_custom_permissions_exist(django_project: Any):
    from django.contrib.auth.models import Permission

    codenames = set(
        Permission.objects.filter(content_type__app_label="celery_lease").values_list(
            "codename", flat=True
        )
    )
    assert {
        "view_task",
        "retry_task",
        "fail_task",
        "resolve_task",
        "cancel_task",
        "view_transition",
        "view_step",
        "view_worker",
        "view_pause",
        "pause_task",
        "resume_task",
        "view_pauseevent",
    } == codenames


def test_migrating_again_keeps_tables_and_rows(django_project: Any, lease: Any):
    """Unapplying the Django migration leaves the tables (and their history) in place;
    applying it again runs the store's steps, which find nothing to do."""
    from django.core.management import call_command
    from django.db import connection
    from django.db.migrations.recorder import MigrationRecorder

    from celery_lease.store import SCHEMA_VERSION

    task_id = lease.make("WAIT_MANUAL")
    call_command("migrate", "celery_lease", "zero", verbosity=0)
    try:
        applied = MigrationRecorder(connection).applied_migrations()
        assert ("celery_lease", "0001_initial") not in applied
        assert lease.state(task_id) == "WAIT_MANUAL"
    finally:
        call_command("migrate", "celery_lease", verbosity=0)
    assert ("celery_lease", "0001_initial") in MigrationRecorder(connection).applied_migrations()
    assert lease.store.schema_version() == SCHEMA_VERSION
    assert lease.state(task_id) == "WAIT_MANUAL"


def test_a_database_migrated_by_0001_at_version_1_is_upgraded_by_0002(
    django_project: Any, lease: Any
):
    """Lease tables that ``0001_initial`` created at schema version 1 reach the current
    version when Django applies the later migrations (which run the store's steps)."""
    from django.core.management import call_command

    from celery_lease.store import SCHEMA_VERSION

    store = lease.store
    task_id = lease.make("WAIT_MANUAL")
    t = store.t
    call_command("migrate", "celery_lease", "0001", verbosity=0)
    try:
        with store.engine.begin() as conn:  # back to version 1
            next(i for i in t.tasks.indexes if i.name.endswith("_finished")).drop(conn)
            for table in (
                t.counters,
                t.pauses,
                t.pause_log,
                t.transition_totals,
                t.transition_watermark,
                t.purged,
            ):
                table.drop(conn)
            conn.execute(t.version.delete().where(t.version.c.version > 1))
        assert store.schema_version() == 1
    finally:
        call_command("migrate", "celery_lease", verbosity=0)
    assert store.schema_version() == SCHEMA_VERSION
    assert store.pauses() == [] and store.counters()["purged"] == 0
    assert lease.state(task_id) == "WAIT_MANUAL"


# -- configuration ------------------------------------------------------------------------


def test_check_passes_for_the_test_project(django_project: Any):
    from celery_lease.contrib.django._checks import check_configuration

    assert check_configuration() == []


def test_check_fails_when_the_celery_app_uses_another_prefix(django_project: Any):
    from celery_lease._runtime import runtime
    from celery_lease.contrib.django._checks import check_configuration

    app = django_project
    app.conf.lease_table_prefix = "other_"
    runtime(app).reset()
    try:
        errors = check_configuration()
    finally:
        app.conf.lease_table_prefix = "lease_"
        runtime(app).reset()
    assert [e.id for e in errors] == ["celery_lease.E002"]
    assert "'other_'" in errors[0].msg and "'lease_'" in errors[0].msg


def test_check_fails_when_the_celery_app_cannot_be_found(
    django_project: Any, settings_override: Any
):
    from celery_lease.contrib.django._checks import check_configuration

    settings_override(CELERY_LEASE_APP="tests.django.proj.missing:app")
    assert [e.id for e in check_configuration()] == ["celery_lease.E001"]


def test_migration_refuses_tables_the_models_do_not_map(django_project: Any):
    from types import SimpleNamespace

    from django.core.exceptions import ImproperlyConfigured

    from celery_lease._runtime import runtime
    from celery_lease.contrib.django import _migration

    app = django_project
    editor = SimpleNamespace(connection=SimpleNamespace(alias="default"))
    app.conf.lease_table_prefix = "other_"
    runtime(app).reset()
    try:
        with pytest.raises(ImproperlyConfigured, match="other_"):
            _migration.forwards(None, editor)
        # another alias is not the lease tables' database: nothing to do, nothing checked
        _migration.forwards(None, SimpleNamespace(connection=SimpleNamespace(alias="other")))
    finally:
        app.conf.lease_table_prefix = "lease_"
        runtime(app).reset()


def test_check_warns_when_the_store_is_not_the_admins_database(django_project: Any, tmp_path):
    from celery_lease._runtime import runtime
    from celery_lease.contrib.django import _conf
    from celery_lease.contrib.django._checks import check_configuration

    app = django_project
    derived = app.conf.lease_database_url
    app.conf.lease_database_url = f"sqlite:///{tmp_path / 'elsewhere.sqlite3'}"
    runtime(app).reset()
    try:
        assert not _conf.is_derived(app)
        assert [m.id for m in check_configuration()] == ["celery_lease.W001"]
        # the same database, spelled explicitly: fine
        app.conf.lease_database_url = derived.replace("postgresql+psycopg", "postgresql")
        runtime(app).reset()
        assert check_configuration() == []
    finally:
        app.conf.lease_database_url = derived
        runtime(app).reset()
    assert _conf.is_derived(app)


def test_celery_app_comes_from_the_setting(django_project: Any, settings_override: Any):
    from celery_lease.contrib.django import get_celery_app
    from celery_lease.exceptions import ConfigurationError
    from tests.django.proj.celery import app

    assert get_celery_app() is app
    settings_override(CELERY_LEASE_APP="tests.django.proj.celery.app")
    assert get_celery_app() is app
    settings_override(CELERY_LEASE_APP="tests.django.proj.celery:nothing")
    with pytest.raises(ConfigurationError, match="cannot be imported"):
        get_celery_app()
    settings_override(CELERY_LEASE_APP="tests.django.proj.settings:SECRET_KEY")
    with pytest.raises(ConfigurationError, match="not a Celery app"):
        get_celery_app()


@pytest.fixture
def settings_override(django_project: Any) -> Any:
    from django.test.utils import override_settings

    active: list[Any] = []

    def override(**values: Any) -> None:
        manager = override_settings(**values)
        manager.enable()
        active.append(manager)

    yield override
    for manager in reversed(active):
        manager.disable()


@pytest.mark.parametrize(
    ("conf", "url"),
    [
        (
            {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": "shop",
                "USER": "app",
                "PASSWORD": "s3cret/!",
                "HOST": "db.internal",
                "PORT": "6432",
                "OPTIONS": {"sslmode": "require", "pool": True},
            },
            "postgresql+psycopg://app:s3cret%2F%21@db.internal:6432/shop?sslmode=require",
        ),
        (
            {"ENGINE": "django.db.backends.postgresql", "NAME": "shop", "HOST": "/run/postgresql"},
            "postgresql+psycopg:///shop?host=%2Frun%2Fpostgresql",
        ),
        (
            {"ENGINE": "django.contrib.gis.db.backends.postgis", "NAME": "geo"},
            "postgresql+psycopg:///geo",
        ),
        (
            {"ENGINE": "django.db.backends.sqlite3", "NAME": "/srv/app/db.sqlite3"},
            "sqlite:////srv/app/db.sqlite3",
        ),
    ],
)
def test_store_url_from_django_database_settings(conf: dict[str, Any], url: str):
    from sqlalchemy.engine import make_url

    from celery_lease.contrib.django._conf import url_from_settings

    made = url_from_settings(conf)
    assert make_url(made) == make_url(url)


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}, "in-memory"),
        (
            {
                "ENGINE": "django.db.backends.sqlite3",
                "NAME": "file:memorydb_default?mode=memory&cache=shared",
            },
            "in-memory",
        ),
        ({"ENGINE": "django.db.backends.mysql", "NAME": "shop"}, "PostgreSQL and SQLite"),
    ],
)
def test_unsupported_django_databases_are_refused(conf: dict[str, Any], message: str):
    from celery_lease.contrib.django._conf import url_from_settings
    from celery_lease.exceptions import ConfigurationError

    with pytest.raises(ConfigurationError, match=message):
        url_from_settings(conf)
