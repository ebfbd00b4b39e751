"""The lease admin when the lease tables' database stops answering: a bounded wait,
then a 503 page that says so, never a hang and never a traceback.

Django bounds none of its queries: against a server that accepts connections and
never answers (a black hole: a dead server behind a live load balancer, a lost NAT
entry), a changelist would wait for ever. So every view of the lease admin runs under
:func:`guarded`:

- It first asks the lease store whether the database answers (``Store.ping``, a store
  call bounded by ``lease_db_timeout`` like every other). A database that does not
  answer ends the request there, before Django's own connection is used.
- Django's connection to ``CELERY_LEASE_DATABASE_ALIAS`` is opened with libpq's
  ``connect_timeout`` (``lease_db_timeout``, unless that entry's ``OPTIONS`` sets its
  own), and each query Django runs on it is watched by the store's deadline watchdog:
  past ``lease_db_timeout`` its socket is shut down and the query fails at once.
- Either way the view ends with :class:`~celery_lease.exceptions.StoreUnavailable`,
  answered with a 503 page naming what did not answer and saying that nothing was
  changed. Operator actions go through the store, so they are never half-sent: a
  refused request was not made.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from django.contrib import admin
from django.db import DatabaseError, InterfaceError, OperationalError, connections
from django.template.response import SimpleTemplateResponse, TemplateResponse

from ..._runtime import runtime
from ...exceptions import StoreUnavailable
from ...operations import Admin
from ...operations import admin as operator_api
from ...store import bounded_connection, redact
from . import _conf

#: Seconds a browser is told to wait before trying again.
RETRY_AFTER = 10


def api() -> Admin:
    """The operator API of the configured Celery app."""
    return operator_api(_conf.lease_app())


class DjangoQueryUnavailable(StoreUnavailable):
    """A query of Django's own connection to the lease tables failed or got no answer
    (Django's connection is closed, so the next request opens a fresh one)."""


#: libpq's smallest ``connect_timeout`` (psycopg raises smaller values to it).
_MIN_CONNECT_TIMEOUT = 2


def _timeout() -> float:
    return float(runtime(_conf.lease_app()).config.db_timeout)


def _unavailable(alias: str, error: Exception, waited: float, timeout: float) -> StoreUnavailable:
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    why = (
        f"no answer within {timeout:g} s (lease_db_timeout)"
        if waited >= timeout
        else "the connection failed"
    )
    return DjangoQueryUnavailable(
        f"DATABASES[{alias!r}] (the lease tables) unavailable: {why}: {redact(first)}"
    )


@contextlib.contextmanager
def _connect_timeout(connection: Any, timeout: float) -> Iterator[None]:
    """Connections Django opens inside the block give up after ``timeout`` seconds.

    psycopg waits 130 s for a server that accepts and never answers, and libpq for
    ever. The entry's own ``OPTIONS["connect_timeout"]`` wins. Only this thread's
    connection object sees the change (Django keeps one per thread), and only for
    the block: the rest of the site connects as configured."""
    options = dict(connection.settings_dict.get("OPTIONS") or {})
    if connection.vendor != "postgresql" or "connect_timeout" in options:
        yield
        return
    saved = connection.settings_dict
    options["connect_timeout"] = max(_MIN_CONNECT_TIMEOUT, math.ceil(timeout))
    connection.settings_dict = {**saved, "OPTIONS": options}
    try:
        yield
    finally:
        connection.settings_dict = saved


@contextlib.contextmanager
def bounded_queries(alias: str, timeout: float) -> Iterator[None]:
    """Every connect and query of Django's on ``alias`` inside the block ends within
    ``timeout`` seconds; a lost or silent connection raises :class:`DjangoQueryUnavailable`."""
    connection = connections[alias]

    def wrapper(
        execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any
    ) -> Any:
        started = time.monotonic()
        raw = context["connection"].connection
        try:
            if connection.vendor == "postgresql" and raw is not None:
                with bounded_connection(raw, timeout):
                    return execute(sql, params, many, context)
            return execute(sql, params, many, context)
        except (OperationalError, InterfaceError) as error:
            raise _unavailable(alias, error, time.monotonic() - started, timeout) from error

    with _connect_timeout(connection, timeout), connection.execute_wrapper(wrapper):
        if connection.connection is None:
            # opened here rather than by the view's first query, whose errors would
            # not say which database failed (a connect is outside the wrapper)
            started = time.monotonic()
            try:
                connection.ensure_connection()
            except (OperationalError, InterfaceError) as error:
                raise _unavailable(alias, error, time.monotonic() - started, timeout) from error
        yield


def _forget_connection(alias: str) -> None:
    """Close Django's connection after the database failed: a socket the watchdog shut
    down cannot be used again, and the next request should open a fresh one."""
    with contextlib.suppress(DatabaseError):
        connections[alias].close()


def unavailable_response(
    request: Any, model_admin: admin.ModelAdmin, error: StoreUnavailable
) -> TemplateResponse:
    """The 503 page. Its context is built without a query (not ``each_context``, whose
    app list reads permissions): the database may be the one that does not answer."""
    site = model_admin.admin_site
    context = {
        "title": "The lease store is unavailable",
        "site_title": site.site_title,
        "site_header": site.site_header,
        "site_url": site.site_url,
        "has_permission": True,
        "is_popup": False,
        "is_nav_sidebar_enabled": False,
        "available_apps": [],
        "opts": model_admin.opts,
        "error": str(error),
        "retry_url": request.get_full_path() if request.method == "GET" else "",
    }
    response = TemplateResponse(request, "admin/celery_lease/unavailable.html", context, status=503)
    response["Retry-After"] = str(RETRY_AFTER)
    return response


def guarded(
    request: Any, model_admin: admin.ModelAdmin, view: Callable[..., Any], *args: Any, **kw: Any
) -> Any:
    """Run an admin view of the lease tables within ``lease_db_timeout`` (see the module
    docstring); its template is rendered inside too, since the changelist's rows are read
    while it renders."""
    alias = _conf.database_alias()
    try:
        api().store.ping()
        with bounded_queries(alias, _timeout()):
            response = view(request, *args, **kw)
            if isinstance(response, SimpleTemplateResponse) and not response.is_rendered:
                response.render()
            return response
    except StoreUnavailable as error:
        # Django's connection to the tables is suspect too (a persistent one would fail
        # the first request after the outage): the next request opens a fresh one
        _forget_connection(alias)
        return unavailable_response(request, model_admin, error).render()


def guard(model_admin: admin.ModelAdmin, view: Callable[..., Any]) -> Callable[..., Any]:
    """``view`` (a custom URL's view of ``model_admin``) run through :func:`guarded`."""

    @functools.wraps(view)
    def wrapped(request: Any, *args: Any, **kwargs: Any) -> Any:
        return guarded(request, model_admin, view, *args, **kwargs)

    return wrapped


class GuardedAdmin(admin.ModelAdmin):
    """A model admin of the lease tables whose pages end within ``lease_db_timeout``.

    Read-only as a Django form: the rows change only through the operator API (the
    actions and pages that call ``celery_lease.admin(app)``)."""

    def has_add_permission(self, request: Any) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def changelist_view(self, request: Any, extra_context: dict[str, Any] | None = None) -> Any:
        return guarded(request, self, super().changelist_view, extra_context)

    def change_view(
        self,
        request: Any,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> Any:
        return guarded(request, self, super().change_view, object_id, form_url, extra_context)

    def history_view(
        self, request: Any, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> Any:
        return guarded(request, self, super().history_view, object_id, extra_context)
