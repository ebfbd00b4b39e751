"""``lease_*`` settings: defaults, coercion from strings, validation errors naming the setting."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
from celery import Celery
from hypothesis import given
from hypothesis import strategies as st

from celery_lease import config
from celery_lease.config import SETTINGS, LeaseConfig, from_mapping, resolve_database_url
from celery_lease.exceptions import (
    CeleryLeaseDeprecationWarning,
    CeleryLeaseError,
    ConfigurationError,
)


@pytest.fixture(autouse=True)
def _no_env_url(monkeypatch):
    monkeypatch.delenv("CELERY_LEASE_DATABASE_URL", raising=False)


#: The documented defaults (docs' settings reference must show the same values).
DEFAULTS = {
    "database_url": "sqlite:///celery-lease.sqlite3",
    "table_prefix": "lease_",
    "schema": None,
    "ttl": 30.0,
    "heartbeat_interval": 5.0,
    "reaper_interval": 5.0,
    "embedded_reaper": True,
    "republish_after": 60.0,
    "publish_grace": 10.0,
    "max_recoveries": 5,
    "max_age": None,
    "max_runtime": None,
    "result_max_bytes": 65536,
    "args_max_bytes": 1048576,
    "auto_migrate": False,
    "pool_size": 5,
    "db_timeout": 10.0,
    "db_startup_timeout": 60.0,
    "retention": 7 * 86400.0,
    "send_events": True,
    "result_backend_sync": True,
    "outcome_write_through": False,
    "batch_groups": True,
    "origin": None,
    "catchup": "latest",
    "catchup_window": 86400.0,
    "catchup_max": 10,
    "overlap": "allow",
    "hold_eta_after": 60.0,
}


def test_defaults():
    # the default SQLite file is resolved once, against the current directory
    resolved = {**DEFAULTS, "database_url": resolve_database_url(DEFAULTS["database_url"])}
    assert resolved["database_url"] == f"sqlite:///{os.path.abspath('celery-lease.sqlite3')}"
    assert dataclasses.asdict(LeaseConfig()) == resolved


def test_a_removed_setting_warns_naming_its_replacement_and_has_no_effect():
    for key, replacement in config.DEPRECATED.items():
        with pytest.warns(CeleryLeaseDeprecationWarning) as caught:
            cfg = from_mapping({key: 0})
        message = str(caught[0].message)
        assert key in message and replacement in message and "no effect" in message
        assert cfg == LeaseConfig()
    with pytest.warns(CeleryLeaseDeprecationWarning, match="lease_db_startup_timeout"):
        from_mapping({"lease_db_retry_on_startup": False})
    with pytest.warns(CeleryLeaseDeprecationWarning, match="lease_db_timeout"):
        from_mapping({"lease_sqlite_busy_timeout": 60})


def test_internal_sizes_are_constants_or_derived_from_the_settings():
    cfg = LeaseConfig()
    assert (cfg.reaper_batch_size, cfg.retention_batch_size, cfg.db_retries) == (100, 1000, 3)
    assert (cfg.outcome_batch_size, cfg.outcome_flush_interval, cfg.outcome_buffer) == (
        100,
        0.05,
        1000,
    )
    assert (cfg.claim_batch_size, cfg.claim_interval, cfg.claim_ahead_window) == (100, 0.005, 1.0)
    assert (cfg.totals_batch_size, cfg.totals_settle, cfg.metrics_tail_rows) == (
        50_000,
        60.0,
        200_000,
    )
    # the documented values of the settings they replace, derived from lease_db_timeout
    assert (cfg.db_connect_timeout, cfg.sqlite_busy_timeout) == (5.0, 30.0)
    fast = LeaseConfig(db_timeout=2.0)
    assert (fast.db_connect_timeout, fast.sqlite_busy_timeout) == (1.0, 6.0)
    assert cfg.db_retry_on_startup is True
    assert LeaseConfig(db_startup_timeout=0).db_retry_on_startup is False


def test_tests_change_the_internal_sizes_through_tuned_or_the_environment(monkeypatch):
    tuned = LeaseConfig().tuned(reaper_batch_size=2, totals_settle=0.0)
    assert (tuned.reaper_batch_size, tuned.totals_settle) == (2, 0.0)
    assert tuned == LeaseConfig()  # not a setting: the settings are the same
    monkeypatch.setenv(config.TUNING_ENV, "claim_interval=0.3, retention_batch_size=2")
    cfg = from_mapping({})
    assert (cfg.claim_interval, cfg.retention_batch_size) == (0.3, 2)
    monkeypatch.setenv(config.TUNING_ENV, "no_such=1")
    with pytest.raises(ConfigurationError, match=config.TUNING_ENV):
        from_mapping({})


def test_empty_mapping_gives_the_defaults():
    assert from_mapping({}) == LeaseConfig()


def test_retention_none_keeps_everything_and_unset_is_the_default():
    assert from_mapping({"lease_retention": None}).retention is None
    assert from_mapping({}).retention == config.DEFAULT_RETENTION
    app = Celery(set_as_current=False)
    assert from_mapping(app.conf).retention == config.DEFAULT_RETENTION
    app.conf.lease_retention = None
    assert from_mapping(app.conf).retention is None
    app.conf.lease_retention = "3600"
    assert from_mapping(app.conf).retention == 3600.0
    with pytest.raises(ConfigurationError, match="lease_retention"):
        LeaseConfig(retention=0)


def test_hold_eta_after_none_turns_holding_off_and_is_checked_as_a_duration():
    assert from_mapping({}).hold_eta_after == 60.0
    assert from_mapping({"lease_hold_eta_after": None}).hold_eta_after is None
    app = Celery(set_as_current=False)
    app.conf.lease_hold_eta_after = None
    assert from_mapping(app.conf).hold_eta_after is None
    app.conf.lease_hold_eta_after = "0"
    assert from_mapping(app.conf).hold_eta_after == 0.0  # every future ETA held
    for bad in (-1, math.inf, math.nan, 1e300, "soon"):
        with pytest.raises(ConfigurationError, match="lease_hold_eta_after"):
            from_mapping({"lease_hold_eta_after": bad})


def test_the_origin_is_the_broker_unless_lease_origin_names_it():
    url = "redis://:secret@10.0.0.5:6379/0"
    assert from_mapping({"broker_url": url}).origin == "redis://:**@10.0.0.5:6379/0"
    named = {"broker_url": url, "lease_origin": "orders-redis"}
    assert from_mapping(named).origin == "orders-redis"
    with pytest.raises(ConfigurationError, match="lease_origin"):
        from_mapping({"lease_origin": "x" * 256})


def test_every_field_has_exactly_one_setting():
    fields = {f.name for f in dataclasses.fields(LeaseConfig)}
    assert {key.removeprefix("lease_") for key in SETTINGS} == fields
    assert all(key.startswith("lease_") and key == key.lower() for key in SETTINGS)


def test_read_from_a_celery_app_conf():
    app = Celery("t", set_as_current=False)
    app.conf.update(
        lease_database_url="postgresql://u@h/db",
        lease_schema="jobs",
        lease_ttl=12,
        lease_heartbeat_interval="1.5",
        lease_embedded_reaper="off",
        lease_max_runtime="600",
    )
    cfg = from_mapping(app.conf)
    assert cfg.database_url == "postgresql://u@h/db"
    assert cfg.schema == "jobs"
    assert cfg.ttl == 12.0 and isinstance(cfg.ttl, float)
    assert cfg.heartbeat_interval == 1.5
    assert cfg.embedded_reaper is False
    assert cfg.max_runtime == 600.0


def test_coercion_from_strings():
    cfg = from_mapping(
        {
            "lease_ttl": "0.75",
            "lease_heartbeat_interval": "0.25",
            "lease_result_max_bytes": "17",
            "lease_max_recoveries": "0",
            "lease_auto_migrate": "yes",
            "lease_batch_groups": "0",
            "lease_max_age": "3600.5",
        }
    )
    assert cfg.ttl == 0.75 and cfg.heartbeat_interval == 0.25
    assert cfg.result_max_bytes == 17 and isinstance(cfg.result_max_bytes, int)
    assert cfg.max_recoveries == 0
    assert cfg.auto_migrate is True and cfg.batch_groups is False
    assert cfg.max_age == 3600.5


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", True),
        ("TRUE", True),
        (" on ", True),
        ("Yes", True),
        ("0", False),
        ("false", False),
        ("OFF", False),
        ("no", False),
    ],
)
def test_boolean_strings(text, expected):
    assert from_mapping({"lease_auto_migrate": text}).auto_migrate is expected


def test_fractional_seconds_are_accepted():
    cfg = LeaseConfig(
        ttl=0.5,
        heartbeat_interval=0.1,
        reaper_interval=0.05,
        publish_grace=0.2,
        republish_after=0.3,
    )
    assert (cfg.ttl, cfg.heartbeat_interval, cfg.reaper_interval) == (0.5, 0.1, 0.05)
    assert (
        from_mapping({"lease_ttl": 0.5, "lease_heartbeat_interval": "0.125"}).heartbeat_interval
        == 0.125
    )


def test_none_values_mean_unset():
    assert from_mapping({"lease_ttl": None, "lease_max_age": None}) == LeaseConfig()


def test_environment_supplies_an_unset_database_url(monkeypatch):
    monkeypatch.setenv("CELERY_LEASE_DATABASE_URL", "postgresql://env@h/db")
    assert from_mapping({}).database_url == "postgresql://env@h/db"
    explicit = from_mapping({"lease_database_url": "sqlite:///x.db"})
    assert explicit.database_url == f"sqlite:///{os.path.abspath('x.db')}"


def test_config_is_frozen():
    cfg = LeaseConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.ttl = 1.0  # type: ignore[misc]


#: (setting, invalid value): each must raise ConfigurationError naming the setting.
INVALID = [
    ("lease_ttl", 0),
    ("lease_ttl", -1.5),
    ("lease_ttl", "nan"),
    ("lease_heartbeat_interval", 0),
    ("lease_reaper_interval", -0.1),
    ("lease_republish_after", 0),
    ("lease_publish_grace", -3),
    ("lease_db_timeout", 0),
    ("lease_args_max_bytes", 0),
    ("lease_result_max_bytes", 0),
    ("lease_pool_size", 0),
    ("lease_max_recoveries", -1),
    ("lease_db_startup_timeout", -1),
    ("lease_max_age", 0),
    ("lease_max_runtime", -5),
    ("lease_table_prefix", "bad-prefix;"),
    ("lease_table_prefix", "has space_"),
    # coercion errors
    ("lease_ttl", "soon"),
    ("lease_pool_size", "1.5"),
    ("lease_max_recoveries", "many"),
    ("lease_auto_migrate", "maybe"),
    ("lease_ttl", True),
    ("lease_pool_size", False),
    ("lease_ttl", [1]),
]


@pytest.mark.parametrize(("setting", "value"), INVALID, ids=[f"{k}={v!r}" for k, v in INVALID])
def test_invalid_setting_raises_configuration_error_naming_it(setting, value):
    overrides = {setting: value}
    if setting == "lease_ttl":
        overrides["lease_heartbeat_interval"] = 0.01  # isolate the ttl check
    with pytest.raises(ConfigurationError) as info:
        from_mapping(overrides)
    assert setting in str(info.value)
    assert isinstance(info.value, CeleryLeaseError)


@pytest.mark.parametrize(("ttl", "heartbeat"), [(1.0, 1.0), (1.0, 2.0), (0.5, 0.75)])
def test_heartbeat_must_be_shorter_than_ttl(ttl, heartbeat):
    with pytest.raises(ConfigurationError) as info:
        LeaseConfig(ttl=ttl, heartbeat_interval=heartbeat)
    assert "lease_heartbeat_interval" in str(info.value)
    assert "lease_ttl" in str(info.value)


@given(
    ttl=st.floats(0.001, 1e6, allow_nan=False, allow_infinity=False),
    ratio=st.floats(0.001, 0.999),
)
def test_any_positive_ttl_with_a_shorter_heartbeat_is_valid(ttl, ratio):
    heartbeat = ttl * ratio
    cfg = from_mapping({"lease_ttl": str(ttl), "lease_heartbeat_interval": repr(heartbeat)})
    assert math.isclose(cfg.ttl, ttl) and cfg.heartbeat_interval < cfg.ttl


@given(value=st.floats(allow_nan=True, allow_infinity=False).filter(lambda v: not v > 0))
def test_non_positive_or_nan_seconds_are_rejected(value):
    with pytest.raises(ConfigurationError, match="lease_publish_grace"):
        LeaseConfig(publish_grace=value)


def test_coerce_keeps_the_driver_error_as_cause():
    with pytest.raises(ConfigurationError) as info:
        config._coerce("lease_ttl", "x", float)
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize(
    ("broker", "given", "expected"),
    [
        # Redis waits for ever by default: a third of lease_db_timeout, at least 2 s
        ("redis://127.0.0.1:6399/0", {}, {"socket_timeout": 4.0, "socket_connect_timeout": 4.0}),
        # what the app sets is kept
        (
            "redis://127.0.0.1:6399/0",
            {"socket_timeout": 30, "visibility_timeout": 60},
            {"socket_timeout": 30, "socket_connect_timeout": 4.0, "visibility_timeout": 60},
        ),
        # RabbitMQ: connect bounded by broker_connection_timeout, publish does not wait
        ("amqp://guest:guest@127.0.0.1:5699//", {}, {}),
    ],
)
def test_installing_bounds_the_redis_broker_sockets(broker, given, expected):
    from celery_lease._runtime import install

    app = Celery("bounded", broker=broker, set_as_current=False)
    app.conf.update(broker_transport_options=given, lease_db_timeout=12.0)
    install(app)  # no connection is made
    assert dict(app.conf.broker_transport_options) == expected


def test_the_origin_is_the_broker_url_without_its_password():
    conf = from_mapping({"broker_url": "amqp://guest:s3cret@rabbit:5672/prod"})
    assert conf.origin == "amqp://guest:**@rabbit:5672/prod"
    assert from_mapping({}).origin is None
    app = Celery("t", broker="redis://:pw@127.0.0.1:6379/3", set_as_current=False)
    assert from_mapping(app.conf).origin == "redis://:**@127.0.0.1:6379/3"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("lease_catchup", "sometimes"),
        ("lease_overlap", "queue"),
        ("lease_catchup_window", -1),
        ("lease_catchup_max", 0),
    ],
)
def test_a_bad_beat_setting_is_refused_naming_it(key: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=key):
        from_mapping({key: value})
