"""Per-app registries are keyed by the app behind Celery's proxies (``current_app``)."""

from __future__ import annotations

from celery import Celery
from celery.local import Proxy

from celery_lease._apps import AppRegistry, real_app
from celery_lease._runtime import runtime


def test_a_proxy_of_an_app_reaches_the_apps_own_runtime() -> None:
    app = Celery("apps-test", set_as_current=False)
    proxy: Celery = Proxy(lambda: app)  # type: ignore[assignment]

    assert real_app(proxy) is app and real_app(app) is app
    assert runtime(proxy) is runtime(app)


def test_a_registry_holds_one_entry_per_app_whoever_asks() -> None:
    app = Celery("apps-test", set_as_current=False)
    proxy: Celery = Proxy(lambda: app)  # type: ignore[assignment]
    registry: AppRegistry[str] = AppRegistry()

    registry[proxy] = "value"
    assert registry[app] == "value" and registry.get(proxy) == "value"
    assert proxy in registry and app in registry and len(registry) == 1
    assert registry.pop(proxy) == "value"
    assert registry.get(app) is None and registry.pop(proxy, "gone") == "gone"
