"""``celery -A proj lease ...``: registered through the ``celery.commands`` entry point."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

import click

from ._runtime import runtime
from .exceptions import CeleryLeaseError

F = TypeVar("F", bound=Callable[..., Any])


def _app(ctx: click.Context) -> Any:
    obj = ctx.find_root().obj
    app = getattr(obj, "app", None)
    if app is None:
        raise click.UsageError("no Celery app: run as `celery -A proj lease ...`")
    return app


def handle_errors(fn: F) -> F:
    """Turn the library's errors into one-line messages and a non-zero exit code."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CeleryLeaseError as error:
            click.secho(f"Error: {error}", fg="red", err=True)
            sys.exit(1)
        except ValueError as error:
            click.secho(f"Error: {error}", fg="red", err=True)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]


@click.group(name="lease")
def lease() -> None:
    """Inspect and operate crash-safe leased tasks (celery-lease)."""


@lease.command()
@click.pass_context
@handle_errors
def migrate(ctx: click.Context) -> None:
    """Create or upgrade the lease tables."""
    store = runtime(_app(ctx)).config
    from .store import Store

    s = Store(store)
    before, after = s.migrate()
    if before == after:
        click.echo(f"{s.url}: schema is up to date (version {after})")
    else:
        click.echo(f"{s.url}: migrated schema from {before or 'nothing'} to version {after}")


@lease.command()
@click.option("--loop", is_flag=True, help="Keep sweeping every lease_reaper_interval seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print each report as JSON.")
@click.pass_context
@handle_errors
def reap(ctx: click.Context, loop: bool, as_json: bool) -> None:
    """Run the reaper: expire dead leases, retry or hand over, re-publish lost messages."""
    from .admin import admin

    app = _app(ctx)
    api = admin(app)
    interval = runtime(app).config.reaper_interval
    while True:
        report = api.reap()
        if as_json:
            click.echo(json.dumps(report.as_dict()))
        elif report.total or not loop:
            click.echo(" ".join(f"{k}={v}" for k, v in report.as_dict().items()))
        if not loop:
            return
        time.sleep(interval)
