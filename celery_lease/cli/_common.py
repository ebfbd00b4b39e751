"""What every ``celery lease`` command shares: the group, the app, errors and exit
codes, options, and the operator API."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar, cast

import click

from ..exceptions import (
    CeleryLeaseError,
    ConfigurationError,
    StoreDataError,
    StoreError,
    TaskNotFound,
)
from ._render import color_of

F = TypeVar("F", bound=Callable[..., Any])

EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_STORE = 3
EXIT_NOT_FOUND = 4

#: Seconds an operator command waits for the result backend and Flower to be told.
NOTIFY_TIMEOUT = 5.0

#: Exit code of ``lease check`` when it found a broken invariant.
EXIT_VIOLATIONS = 5

#: Exit codes from the mildest to the worst: a command on several ids exits with the
#: worst one met (a refusal is often expected, e.g. retrying a task already retried; a
#: missing id is a typo; bad input is a wrong command; an unreachable store is an outage).
SEVERITY = (EXIT_REFUSED, EXIT_NOT_FOUND, EXIT_USAGE, EXIT_STORE)


def worst(*codes: int) -> int:
    """The most severe of exit ``codes`` (0 when all are 0)."""
    found = [c for c in codes if c]
    if not found:
        return 0
    return max(found, key=lambda c: SEVERITY.index(c) if c in SEVERITY else len(SEVERITY))


@click.group(name="lease")
def lease() -> None:
    """Inspect and operate crash-safe leased tasks (celery-lease)."""


#: Key of click's ``Context.meta`` (shared by the command's contexts) that says the
#: app's modules were imported: kept there, not on Celery's CLI object.
_MODULES_IMPORTED = "celery_lease.modules_imported"


def _app(ctx: click.Context) -> Any:
    root = ctx.find_root()
    app = getattr(root.obj, "app", None)
    if app is None:
        raise click.UsageError("no Celery app: run as `celery -A proj lease ...`")
    if not root.meta.get(_MODULES_IMPORTED, False):
        # as `celery shell` does: fixups run (Django's sets Django up, so the Django app
        # points the store at DATABASES) and the app's task modules are registered
        app.loader.import_default_modules()
        root.meta[_MODULES_IMPORTED] = True
    return app


def _existing_store_app(ctx: click.Context) -> Any:
    """The app, for a command that reads the store or acts on rows in it: such a command
    never creates a SQLite store. Run in another folder than the workers', it would
    otherwise create an empty file there and report nothing, as if all were well.

    Raises:
        ConfigurationError: the SQLite file the settings name does not exist (the
            message says which file, and how that path was chosen).
    """
    from .._runtime import runtime
    from ..config import database_url_origin, sqlite_file

    app = _app(ctx)
    path = sqlite_file(runtime(app).config.database_url)
    if path is not None and not os.path.exists(path):
        raise ConfigurationError(
            f"no lease store at {path} ({database_url_origin(app.conf)}). Run the "
            "command where the workers run, or point lease_database_url at their store; "
            "`celery -A proj lease migrate` creates a new one"
        )
    return app


def _app_option(ctx: click.Context) -> str:
    """What the user passed as ``-A`` (for the commands ``lease show`` suggests)."""
    given = ctx.find_root().params.get("app")
    if isinstance(given, str) and given:
        return given
    main = getattr(_app(ctx), "main", None)
    return main if main and main != "__main__" else "proj"


def _color(ctx: click.Context) -> bool | None:
    """``None``: colour when the stream is a terminal (click strips it otherwise)."""
    return color_of(ctx)


def _fail(message: str, code: int, ctx: click.Context | None = None) -> None:
    color = _color(ctx) if ctx is not None else None
    click.echo(click.style(f"Error: {message}", fg="red"), err=True, color=color)
    sys.exit(code)


def exit_code(error: BaseException) -> int:
    """The exit code for an error the user can act on (see the module docstring)."""
    if isinstance(error, TaskNotFound):
        return EXIT_NOT_FOUND
    if isinstance(error, StoreDataError):  # the command's input, not an outage
        return EXIT_USAGE
    if isinstance(error, StoreError):
        return EXIT_STORE
    if isinstance(error, (ConfigurationError, ValueError)):
        return EXIT_USAGE
    return EXIT_REFUSED


def handle_errors(fn: F) -> F:
    """Turn the library's errors into one-line messages and a non-zero exit code."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context(silent=True)
        try:
            return fn(*args, **kwargs)
        except (CeleryLeaseError, ValueError) as error:
            _fail(str(error), exit_code(error), ctx)
        except OSError as error:  # a SQLite directory that cannot be made, a dead broker...
            _fail(str(error) or type(error).__name__, EXIT_STORE, ctx)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return cast(F, wrapper)


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``15m``, ``2h``, ``7d`` or ``1w`` (``ValueError``)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text.lower())
    if match is None:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90, 90s, 15m, 2h, 7d, 1w)")
    unit = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[match.group(2)]
    return float(match.group(1)) * unit


def _duration(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError as error:
        raise click.BadParameter(str(error)) from None


def _admin(ctx: click.Context, *, creates: bool = False) -> Any:
    """The operator API of the app; ``creates``: the command may create the store (it
    writes something that needs no task rows: a pause, a sweep), else the store must
    exist (:func:`_existing_store_app`)."""
    from ..operations import admin

    return admin(_app(ctx) if creates else _existing_store_app(ctx))


def _flush(api: Any) -> None:
    from ..notify import flush

    if not flush(api.store, NOTIFY_TIMEOUT):
        click.echo(
            "warning: the result backend or broker did not answer in time; "
            "Flower and AsyncResult may not show this change",
            err=True,
        )


def json_option(fn: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(fn)


def actor_option(fn: F) -> F:
    return click.option(
        "--actor", default=None, help="Who acts, for the audit trail (default: the OS user)."
    )(fn)
