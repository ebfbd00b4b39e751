"""Per-app registries that accept Celery's ``current_app`` proxy.

celery-lease keeps per-app state (the runtime, a worker's services, its claimer and
outcome writer, the backlog guard) in weak-keyed maps, so that an app's state goes with
the app. Celery hands out proxies for the app (``celery.current_app``, a shared task's
``.app`` seen through its proxy): a proxy cannot be weakly referenced, and as a key
it would not be the app it stands for. :class:`AppRegistry` resolves a proxy to the
app behind it on every access, so each registry holds one entry per real app whoever
asks, and no caller has to remember to resolve first.
"""

from __future__ import annotations

import weakref
from typing import Any, TypeVar, overload

from celery import Celery
from celery.local import Proxy

V = TypeVar("V")
T = TypeVar("T")

_MISSING: Any = object()


def real_app(app: Celery) -> Celery:
    """The app object behind ``app`` (``app`` itself when it is not a proxy)."""
    if isinstance(app, Proxy):
        resolved: Celery = app._get_current_object()
        return resolved
    return app


class AppRegistry(weakref.WeakKeyDictionary[Celery, V]):
    """A ``WeakKeyDictionary`` keyed by Celery app whose keys may be proxies."""

    def __getitem__(self, app: Celery) -> V:
        return super().__getitem__(real_app(app))

    def __setitem__(self, app: Celery, value: V) -> None:
        super().__setitem__(real_app(app), value)

    def __delitem__(self, app: Celery) -> None:
        super().__delitem__(real_app(app))

    def __contains__(self, app: object) -> bool:
        return super().__contains__(real_app(app) if isinstance(app, Celery) else app)

    @overload
    def get(self, app: Celery, default: None = None) -> V | None: ...
    @overload
    def get(self, app: Celery, default: V) -> V: ...
    @overload
    def get(self, app: Celery, default: T) -> V | T: ...
    def get(self, app: Celery, default: Any = None) -> Any:
        return super().get(real_app(app), default)

    @overload
    def pop(self, app: Celery) -> V: ...
    @overload
    def pop(self, app: Celery, default: V) -> V: ...
    @overload
    def pop(self, app: Celery, default: T) -> V | T: ...
    def pop(self, app: Celery, default: Any = _MISSING) -> Any:
        if default is _MISSING:
            return super().pop(real_app(app))
        return super().pop(real_app(app), default)


__all__ = ["AppRegistry", "real_app"]
