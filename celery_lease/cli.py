"""``celery -A proj lease ...``: registered through the ``celery.commands`` entry point.

Readable tables on a terminal (colour only there; ``-C``/``NO_COLOR`` turn it off),
``--json`` for scripts, one-line errors and distinct exit codes:

====  ==========================================================================
0     done
1     refused: the transition table does not allow it (or another library error)
2     bad input: unknown option or state, malformed duration or JSON, bad settings
3     the lease database (or the broker) is unreachable, or the schema is out of date
4     no task with this id
====  ==========================================================================

A command on several ids tries every id and exits with the worst code met (3, then 2,
then 4, then 1), not the first; an unreachable store stops it at once (3).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from enum import Enum
from functools import wraps
from typing import Any, TypeVar

import click

from ._runtime import runtime
from .exceptions import (
    CeleryLeaseError,
    ConfigurationError,
    IllegalTransition,
    StoreError,
    TaskNotFound,
)
from .states import STEP_DONE, State, action_sources

F = TypeVar("F", bound=Callable[..., Any])

EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_STORE = 3
EXIT_NOT_FOUND = 4

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


#: Seconds an operator command waits for the result backend and Flower to be told.
NOTIFY_TIMEOUT = 5.0

STATE_COLORS: dict[State, str] = {
    State.PENDING: "blue",
    State.RUNNING: "cyan",
    State.SUCCEEDED: "green",
    State.FAILED: "red",
    State.RETRY_WAIT: "yellow",
    State.TIMEOUT: "magenta",
    State.WAIT_MANUAL: "red",
    State.CANCELLED: "white",
}


# -- plumbing -----------------------------------------------------------------------------


def _app(ctx: click.Context) -> Any:
    obj = ctx.find_root().obj
    app = getattr(obj, "app", None)
    if app is None:
        raise click.UsageError("no Celery app: run as `celery -A proj lease ...`")
    if not getattr(obj, "_lease_modules_imported", False):
        # as `celery shell` does: fixups run (Django's sets Django up, so the Django app
        # points the store at DATABASES) and the app's task modules are registered
        app.loader.import_default_modules()
        obj._lease_modules_imported = True
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
    return False if getattr(ctx.find_root().obj, "no_color", False) else None


def _fail(message: str, code: int, ctx: click.Context | None = None) -> None:
    color = _color(ctx) if ctx is not None else None
    click.echo(click.style(f"Error: {message}", fg="red"), err=True, color=color)
    sys.exit(code)


def exit_code(error: BaseException) -> int:
    """The exit code for an error the user can act on (see the module docstring)."""
    if isinstance(error, TaskNotFound):
        return EXIT_NOT_FOUND
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

    return wrapper  # type: ignore[return-value]


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


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(_jsonable(k)): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Enum):
        return value.value
    return value


def _print_json(value: Any) -> None:
    click.echo(json.dumps(_jsonable(value), indent=2, sort_keys=False))


def ago(then: datetime | None, now: datetime) -> str:
    """``"12s ago"``, ``"5m ago"``, ``"3h ago"``, ``"2d ago"`` (``"-"`` for none)."""
    if then is None:
        return "-"
    return f"{span((now - then).total_seconds())} ago"


def span(seconds: float | None) -> str:
    """A short human duration: ``0.4s``, ``12s``, ``5m``, ``3h05m``, ``2d4h``."""
    if seconds is None:
        return "-"
    s = max(0.0, seconds)
    if s < 10:
        return f"{s:.1f}s"
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    if s < 172800:
        return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
    return f"{int(s // 86400)}d{int(s % 86400 // 3600)}h"


class Table:
    """Columns padded to width; the last column is cut to the terminal width on a tty."""

    def __init__(
        self, headers: Sequence[str], paint: dict[int, Callable[[str], str]], indent: int = 0
    ) -> None:
        self.headers = list(headers)
        self.rows: list[list[str]] = []
        self.paint = paint
        self.indent = indent

    def add(self, *cells: Any) -> None:
        self.rows.append(["-" if c is None or c == "" else str(c) for c in cells])

    def render(self, color: bool | None) -> None:
        widths = [len(h) for h in self.headers]
        for row in self.rows:
            widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
        last = None
        if sys.stdout.isatty():
            room = (
                shutil.get_terminal_size((120, 24)).columns
                - self.indent
                - sum(widths[:-1])
                - 2 * (len(widths) - 1)
            )
            last = max(room, len(self.headers[-1]), 12)

        def line(cells: list[str], header: bool) -> str:
            out = []
            for i, cell in enumerate(cells):
                if i == len(cells) - 1:
                    text = cell if last is None or len(cell) <= last else cell[: last - 1] + "…"
                else:
                    text = cell.ljust(widths[i])
                if header:
                    text = click.style(text, bold=True)
                elif i in self.paint:
                    text = self.paint[i](text)
                out.append(text)
            return " " * self.indent + "  ".join(out).rstrip()

        click.echo(line(self.headers, True), color=color)
        for row in self.rows:
            click.echo(line(row, False), color=color)


def _paint_state(text: str) -> str:
    try:
        state = State(text.strip())
    except ValueError:
        return text
    return click.style(text, fg=STATE_COLORS[state], bold=state is State.WAIT_MANUAL)


def _admin(ctx: click.Context) -> Any:
    from .admin import admin

    return admin(_app(ctx))


def _flush(api: Any) -> None:
    from .notify import flush

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


# -- the group ----------------------------------------------------------------------------


@click.group(name="lease")
def lease() -> None:
    """Inspect and operate crash-safe leased tasks (celery-lease)."""


@lease.command()
@click.pass_context
@handle_errors
def migrate(ctx: click.Context) -> None:
    """Create or upgrade the lease tables."""
    from .store import Store

    s = Store(runtime(_app(ctx)).config)
    try:
        before, after = s.migrate()
    finally:
        s.dispose()
    if before == after:
        click.echo(f"{s.url}: schema is up to date (version {after})")
    else:
        click.echo(f"{s.url}: migrated schema from {before or 'nothing'} to version {after}")


@lease.command()
@click.option("--loop", is_flag=True, help="Keep sweeping every lease_reaper_interval seconds.")
@json_option
@click.pass_context
@handle_errors
def reap(ctx: click.Context, loop: bool, as_json: bool) -> None:
    """Run the reaper: expire dead leases, retry or hand over, re-publish lost messages."""
    app = _app(ctx)
    api = _admin(ctx)
    interval = runtime(app).config.reaper_interval
    while True:
        report = api.reap()
        if as_json:
            click.echo(json.dumps(report.as_dict()))
        elif report.total or not loop:
            click.echo(" ".join(f"{k}={v}" for k, v in report.as_dict().items()))
        if not loop:
            _flush(api)
            return
        time.sleep(interval)


EXIT_VIOLATIONS = 5


@lease.command()
@click.option(
    "--no-liveness",
    is_flag=True,
    help="Check safety invariants only (skip what a running reaper would have fixed).",
)
@click.option("--grace", type=float, help="Seconds allowed beyond each liveness deadline.")
@click.option(
    "--no-workers",
    is_flag=True,
    help="Do not ask the live workers (through the broker) which store they use.",
)
@click.option(
    "--workers-timeout",
    type=float,
    default=1.0,
    show_default=True,
    help="Seconds to wait for the workers' answers.",
)
@json_option
@click.pass_context
@handle_errors
def check(
    ctx: click.Context,
    no_liveness: bool,
    grace: float | None,
    no_workers: bool,
    workers_timeout: float,
    as_json: bool,
) -> None:
    """Scan the store for broken invariants, and ask the live workers whether they use
    this store; exit 5 if anything is found."""
    from kombu.exceptions import OperationalError as BrokerError

    from .check import check as run_check
    from .check import summarize, workers_on_other_stores

    app = _app(ctx)
    violations = run_check(app, liveness=not no_liveness, grace=grace)
    if not no_workers:
        try:
            violations += workers_on_other_stores(app, timeout=workers_timeout)
        except (BrokerError, OSError) as error:
            click.echo(
                f"warning: workers not asked which store they use (broker: {error})", err=True
            )
    if not as_json:
        click.echo(f"store: {runtime(app).store.url}", err=True)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "counts": summarize(violations),
                    "violations": [v.as_dict() for v in violations],
                }
            )
        )
    elif not violations:
        click.echo("no violations")
    else:
        for violation in violations:
            click.echo(str(violation))
        click.echo(f"{len(violations)} violations")
    if violations:
        ctx.exit(EXIT_VIOLATIONS)


# -- reading ------------------------------------------------------------------------------


@lease.command("list")
@click.option("--state", "-s", help="Only tasks in this state (e.g. WAIT_MANUAL).")
@click.option("--name", "-n", help="Only tasks with this task name.")
@click.option(
    "--older-than", callback=_duration, help="Only tasks submitted longer ago (90s, 15m, 2h, 7d)."
)
@click.option("--worker", "-w", help="Only tasks owned by this worker (node name or id).")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--ids", "-q", "ids_only", is_flag=True, help="Print task ids only.")
@json_option
@click.pass_context
@handle_errors
def list_(
    ctx: click.Context,
    state: str | None,
    name: str | None,
    older_than: float | None,
    worker: str | None,
    limit: int,
    ids_only: bool,
    as_json: bool,
) -> None:
    """List tasks, newest first."""
    api = _admin(ctx)
    rows = api.list(state=state, name=name, older_than=older_than, worker=worker, limit=limit)
    if as_json:
        _print_json([r.as_dict() for r in rows])
        return
    if ids_only:
        for r in rows:
            click.echo(r.id)
        return
    if not rows:
        click.echo("No tasks match.", err=True)
        return
    now = api.store.now()
    table = Table(
        ["ID", "NAME", "STATE", "ATTEMPT", "CREATED", "WORKER", "REASON"], {2: _paint_state}
    )
    for r in rows:
        table.add(
            r.id, r.name, r.state.value, r.attempt, ago(r.created_at, now), r.owner_node, r.reason
        )
    table.render(_color(ctx))
    more = " (limit reached: --limit to see more)" if len(rows) == limit else ""
    click.echo(f"{len(rows)} task{'s' if len(rows) != 1 else ''}{more}", err=True)


def actions(record: Any, steps: Sequence[Any], app_option: str) -> list[dict[str, str]]:
    """What an operator can do with a task in its current state, as commands."""
    base = f"celery -A {app_option} lease"
    tid = record.id
    out: list[dict[str, str]] = []
    unknown = [s.name for s in steps if s.state != STEP_DONE and not s.idempotent]
    if record.state in action_sources("retry"):
        what = "run it again; completed steps are kept and not re-run"
        if unknown:
            what += f"; step {', '.join(map(repr, unknown))} runs again"
        out.append(
            {"action": "retry", "what": what, "command": f'{base} retry {tid} --reason "..."'}
        )
    if record.state in action_sources("resolve"):
        out.append(
            {
                "action": "resolve",
                "what": "the work was finished by hand: record it as SUCCEEDED",
                "command": f"{base} resolve {tid} --reason \"...\" [--result '<json>']",
            }
        )
    if record.state in action_sources("fail"):
        out.append(
            {
                "action": "fail",
                "what": "it will not be completed: record it as FAILED",
                "command": f'{base} fail {tid} --reason "..."',
            }
        )
    if record.state in action_sources("cancel"):
        what = "stop it for good"
        if record.state is State.RUNNING:
            what = "ask it to stop at its next step boundary (--terminate also kills it)"
        out.append(
            {"action": "cancel", "what": what, "command": f'{base} cancel {tid} --reason "..."'}
        )
    return out


@lease.command()
@click.argument("task_id")
@json_option
@click.pass_context
@handle_errors
def show(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """Show one task: its row, steps, full audit trail and what you can do with it."""
    api = _admin(ctx)
    record = api.get(task_id)
    if record is None:
        raise TaskNotFound(task_id)
    steps = api.steps(task_id)
    history = api.history(task_id)
    todo = actions(record, steps, _app_option(ctx))
    if as_json:
        _print_json({"task": record.as_dict(), "steps": steps, "history": history, "actions": todo})
        return
    color = _color(ctx)
    now = api.store.now()

    def field(label: str, value: Any) -> None:
        if value is None or value == "":
            return
        click.echo(f"  {label:<14}{value}", color=color)

    def when(dt: datetime | None) -> str | None:
        return None if dt is None else f"{dt.isoformat(timespec='seconds')} ({ago(dt, now)})"

    def heading(text: str) -> None:
        click.echo("\n" + click.style(text, bold=True), color=color)

    click.echo(click.style(f"Task {record.id}", bold=True) + f"  {record.name}", color=color)
    field("state", _paint_state(record.state.value))
    field("reason", record.reason)
    field(
        "attempt", f"{record.attempt}   recoveries {record.recoveries}   retries {record.retries}"
    )
    if record.owner:
        owner = f"{record.owner_node or '?'} (incarnation {record.owner})"
        if record.heartbeat_at is not None:
            owner += f", heartbeat {ago(record.heartbeat_at, now)}"
        field("worker", owner)
    field("created", when(record.created_at))
    field("published", when(record.published_at))
    field("started", when(record.started_at))
    field("progress at", when(record.progress_at))
    field("finished", when(record.finished_at))
    field("next retry", when(record.next_retry_at))
    field("eta", when(record.eta))
    field("dedup key", record.dedup_key)
    field("args", json.dumps(record.args) if record.args is not None else None)
    field("kwargs", json.dumps(record.kwargs) if record.kwargs else None)
    field(
        "lease",
        f"ttl {record.lease_ttl:g}s, max_runtime "
        f"{'-' if record.max_runtime is None else f'{record.max_runtime:g}s'}, "
        f"on_timeout {record.on_timeout}, max_recoveries {record.max_recoveries}",
    )
    if record.cancel_requested_at is not None:
        field(
            "cancel",
            f"requested by {record.cancel_actor} {ago(record.cancel_requested_at, now)}: "
            f"{record.cancel_reason}",
        )
    field("progress", json.dumps(record.progress) if record.progress is not None else None)
    field("result", json.dumps(record.result) if record.result is not None else None)
    field("error", record.error)

    heading(f"Steps ({len(steps)})")
    if steps:
        table = Table(["NAME", "STATE", "IDEMPOTENT", "ATTEMPT", "STARTED", "RESULT"], {}, 2)
        for s in steps:
            if s.state == STEP_DONE:
                result = json.dumps(s.result)
            else:
                result = "(not finished)" if s.idempotent else "(outcome unknown)"
            table.add(
                s.name,
                s.state,
                "yes" if s.idempotent else "no",
                s.attempt,
                ago(s.started_at, now),
                result,
            )
        table.render(color)
    else:
        click.echo("  none recorded")

    heading(f"History ({len(history)})")
    table = Table(
        ["AT", "FROM", "TO", "ATTEMPT", "ACTOR", "REASON"], {1: _paint_state, 2: _paint_state}, 2
    )
    for h in history:
        table.add(
            h.at.isoformat(timespec="milliseconds"),
            h.from_state.value if h.from_state else "(new)",
            h.to_state.value,
            h.attempt,
            h.actor,
            h.reason,
        )
    table.render(color)

    if record.state is State.WAIT_MANUAL:
        heading("Waiting for a person")
        click.echo(f"  why: {record.reason or 'no reason recorded'}")
        unknown = [s for s in steps if s.state != STEP_DONE and not s.idempotent]
        for s in unknown:
            click.echo(
                f"  step {s.name!r} started in attempt {s.attempt} but its outcome is not "
                "recorded: check the external system before you decide."
            )
    if todo:
        heading("What you can do")
        for a in todo:
            click.echo(f"  {a['action']:<8}{a['what']}")
            click.echo(f"          {a['command']}")


@lease.command()
@click.option(
    "--window",
    callback=_duration,
    default="1h",
    show_default=True,
    help="History summarized by durations and rates.",
)
@json_option
@click.pass_context
@handle_errors
def stats(ctx: click.Context, window: float, as_json: bool) -> None:
    """Counts per state and health figures."""
    snapshot = _admin(ctx).stats(window=window)
    if as_json:
        _print_json(snapshot.as_dict())
        return
    color = _color(ctx)
    table = Table(["STATE", "TASKS"], {0: _paint_state})
    for state, n in snapshot.counts.items():
        table.add(state.value, n)
    table.render(color)

    def rate(value: float | None) -> str:
        return "-" if value is None else f"{value:.1%}"

    expired = str(snapshot.expired_unreaped)
    if snapshot.expired_unreaped:
        expired = click.style(expired + "  (is a reaper running?)", fg="red")
    if snapshot.counts_estimated:
        click.echo("(finished counts past 100,000 are PostgreSQL's estimates)")
    click.echo("")
    for label, value in (
        ("expired, not reaped", expired),
        ("oldest PENDING", span(snapshot.oldest_pending_age)),
        (f"finished in {span(snapshot.window)}", str(snapshot.finished)),
        ("run time p50", span(snapshot.run_p50)),
        ("run time p95", span(snapshot.run_p95)),
        ("run time p99", span(snapshot.run_p99)),
        ("failure rate", rate(snapshot.failure_rate)),
        ("cancel rate", rate(snapshot.cancel_rate)),
        ("re-published (total)", str(snapshot.republished)),
        ("duplicates dropped", str(snapshot.duplicates_dropped)),
        ("purged (total)", str(snapshot.purged)),
    ):
        click.echo(f"{label:<22}{value}", color=color)
    if snapshot.tasks:
        from ._cli_ops import TASK_HEADERS, task_rows

        click.echo("")
        per_task = Table(TASK_HEADERS, {})
        for row in task_rows(snapshot.tasks):
            per_task.add(*row)
        per_task.render(color)


@lease.command()
@click.option("--all", "show_all", is_flag=True, help="Include stopped incarnations.")
@json_option
@click.pass_context
@handle_errors
def workers(ctx: click.Context, show_all: bool, as_json: bool) -> None:
    """Worker incarnations: host, pid, last heartbeat, alive or dead, tasks owned."""
    api = _admin(ctx)
    rows = [w for w in api.workers() if show_all or w.stopped_at is None]
    if as_json:
        _print_json(rows)
        return
    if not rows:
        click.echo(
            "No workers" + ("." if show_all else " running (--all for stopped ones)."), err=True
        )
        return
    now = api.store.now()

    def paint(text: str) -> str:
        fg = {"alive": "green", "dead": "red"}.get(text.strip(), "white")
        return click.style(text, fg=fg)

    table = Table(
        ["NODE", "HOST", "PID", "STATUS", "HEARTBEAT", "RUNNING", "STARTED", "INCARNATION"],
        {3: paint},
    )
    for w in rows:
        status = "stopped" if w.stopped_at is not None else ("alive" if w.alive else "dead")
        table.add(
            w.nodename,
            w.hostname,
            w.pid,
            status,
            ago(w.heartbeat_at, now),
            w.running,
            ago(w.started_at, now),
            w.id,
        )
    table.render(_color(ctx))


# -- acting -------------------------------------------------------------------------------


def _act(
    ctx: click.Context,
    ids: Iterable[str],
    as_json: bool,
    act: Callable[[Any, str], tuple[str, dict[str, Any]]],
) -> None:
    """Apply ``act`` to each id; one line (or JSON object) per id; exit with the worst code
    met (:data:`SEVERITY`), not the first."""
    api = _admin(ctx)
    code = 0
    results = []
    color = _color(ctx)
    for task_id in ids:
        try:
            message, data = act(api, task_id)
        except (IllegalTransition, TaskNotFound, ValueError) as error:
            # a StoreError is not caught: the store is down for the next id too, and 3
            # (the worst code) is what handle_errors exits with
            code = worst(code, exit_code(error))
            results.append({"id": task_id, "ok": False, "error": str(error)})
            if not as_json:
                click.echo(click.style(f"Error: {error}", fg="red"), err=True, color=color)
            continue
        results.append({"id": task_id, "ok": True, **data})
        if not as_json:
            click.echo(message)
    if as_json:
        _print_json(results)
    _flush(api)
    if code:
        sys.exit(code)


def _reason_option(required: bool) -> Callable[[F], F]:
    return click.option(
        "--reason",
        "-r",
        required=required,
        help="Why, for the audit trail" + (" (required)." if required else "."),
    )


@lease.command()
@click.argument("task_ids", nargs=-1, required=True)
@actor_option
@_reason_option(False)
@json_option
@click.pass_context
@handle_errors
def retry(
    ctx: click.Context,
    task_ids: tuple[str, ...],
    actor: str | None,
    reason: str | None,
    as_json: bool,
) -> None:
    """Run WAIT_MANUAL / FAILED / TIMEOUT tasks again (completed steps are kept)."""

    def act(api: Any, task_id: str) -> tuple[str, dict[str, Any]]:
        frm = api.retry(task_id, actor=actor, reason=reason)
        return (
            f"{task_id}: {frm.value} -> PENDING, re-published",
            {"from": frm.value, "to": "PENDING"},
        )

    _act(ctx, task_ids, as_json, act)


@lease.command()
@click.argument("task_ids", nargs=-1, required=True)
@actor_option
@_reason_option(True)
@json_option
@click.pass_context
@handle_errors
def fail(
    ctx: click.Context, task_ids: tuple[str, ...], actor: str | None, reason: str, as_json: bool
) -> None:
    """Record WAIT_MANUAL tasks as FAILED: they will not be completed."""

    def act(api: Any, task_id: str) -> tuple[str, dict[str, Any]]:
        frm = api.fail(task_id, actor=actor, reason=reason)
        return f"{task_id}: {frm.value} -> FAILED", {"from": frm.value, "to": "FAILED"}

    _act(ctx, task_ids, as_json, act)


@lease.command()
@click.argument("task_ids", nargs=-1, required=True)
@actor_option
@_reason_option(True)
@click.option("--result", "result_json", help="The task's result, as JSON (default: null).")
@json_option
@click.pass_context
@handle_errors
def resolve(
    ctx: click.Context,
    task_ids: tuple[str, ...],
    actor: str | None,
    reason: str,
    result_json: str | None,
    as_json: bool,
) -> None:
    """Record WAIT_MANUAL tasks as SUCCEEDED: the work was finished by hand."""
    try:
        result = None if result_json is None else json.loads(result_json)
    except json.JSONDecodeError as error:
        raise ValueError(f"--result is not valid JSON: {error}") from None

    def act(api: Any, task_id: str) -> tuple[str, dict[str, Any]]:
        frm = api.resolve(task_id, actor=actor, reason=reason, result=result)
        return f"{task_id}: {frm.value} -> SUCCEEDED", {"from": frm.value, "to": "SUCCEEDED"}

    _act(ctx, task_ids, as_json, act)


@lease.command()
@click.argument("task_ids", nargs=-1, required=True)
@actor_option
@_reason_option(False)
@click.option("--terminate", is_flag=True, help="Also kill the process of a RUNNING task.")
@json_option
@click.pass_context
@handle_errors
def cancel(
    ctx: click.Context,
    task_ids: tuple[str, ...],
    actor: str | None,
    reason: str | None,
    terminate: bool,
    as_json: bool,
) -> None:
    """Cancel tasks: at once, or for a RUNNING task at its next step boundary."""

    def act(api: Any, task_id: str) -> tuple[str, dict[str, Any]]:
        frm = api.cancel(task_id, actor=actor, reason=reason, terminate=terminate)
        if frm is State.RUNNING:
            how = "killed" if terminate else "stops at its next step boundary"
            return (
                f"{task_id}: RUNNING, cancel requested ({how})",
                {"from": frm.value, "to": "RUNNING", "cancel_requested": True},
            )
        return f"{task_id}: {frm.value} -> CANCELLED", {"from": frm.value, "to": "CANCELLED"}

    _act(ctx, task_ids, as_json, act)


@lease.command()
@click.option(
    "--older-than",
    callback=_duration,
    required=True,
    help="Only tasks finished longer ago (e.g. 30d).",
)
@click.option(
    "--state",
    "-s",
    "states",
    multiple=True,
    help="States to delete (repeatable; default SUCCEEDED and CANCELLED; FAILED only when named).",
)
@click.option(
    "--batch",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="Rows deleted per transaction.",
)
@click.option("--dry-run", is_flag=True, help="Only count what would be deleted.")
@json_option
@click.pass_context
@handle_errors
def purge(
    ctx: click.Context,
    older_than: float,
    states: tuple[str, ...],
    batch: int,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Delete old finished tasks with their steps and audit rows (frees dedup keys)."""
    from .admin import PURGEABLE_DEFAULT

    api = _admin(ctx)
    chosen = list(states) or [s.value for s in PURGEABLE_DEFAULT]
    expected = api.purgeable(older_than=older_than, states=chosen)
    if dry_run:
        if as_json:
            _print_json({"would_delete": expected, "states": chosen})
        else:
            click.echo(f"would delete {expected} tasks ({', '.join(chosen)})")
        return
    if as_json or not expected:
        total = api.purge(older_than=older_than, states=chosen, batch=batch)
    else:
        # on a terminal a bar; elsewhere click prints the label once
        with click.progressbar(
            length=expected, label="purging", file=sys.stderr, show_pos=True
        ) as bar:
            total = api.purge(
                older_than=older_than, states=chosen, batch=batch, progress=bar.update
            )
    if as_json:
        _print_json({"deleted": total, "states": chosen})
    else:
        click.echo(f"deleted {total} tasks ({', '.join(chosen)})")


@lease.command()
@click.option("--port", type=click.IntRange(0, 65535), required=True, help="Port to serve on.")
@click.option("--addr", default="0.0.0.0", show_default=True, help="Address to bind.")
@click.option(
    "--window",
    callback=_duration,
    default="5m",
    show_default=True,
    help="History the per-task figures cover.",
)
@click.pass_context
@handle_errors
def metrics(ctx: click.Context, port: int, addr: str, window: float) -> None:
    """Serve Prometheus metrics over HTTP until interrupted (needs the prometheus extra)."""
    from .metrics import serve

    server = serve(_app(ctx), port=port, addr=addr, window=window)
    host, bound = server.server_address[:2]
    click.echo(f"serving celery-lease metrics on http://{host}:{bound}/metrics", err=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
