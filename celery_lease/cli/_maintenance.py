"""The maintenance commands: migrate, reap, check, purge, metrics."""

from __future__ import annotations

import json
import sys
import time

import click

from .._runtime import runtime
from ._common import (
    EXIT_VIOLATIONS,
    _admin,
    _app,
    _duration,
    _existing_store_app,
    _flush,
    handle_errors,
    json_option,
    lease,
)
from ._render import _print_json


@lease.command()
@click.pass_context
@handle_errors
def migrate(ctx: click.Context) -> None:
    """Create or upgrade the lease tables."""
    from ..store import Store

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
    api = _admin(ctx, creates=True)
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

    from ..check import check as run_check
    from ..check import summarize, workers_on_other_stores

    app = _existing_store_app(ctx)
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
    from ..operations import PURGEABLE_DEFAULT

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
    from ..metrics import serve

    server = serve(_existing_store_app(ctx), port=port, addr=addr, window=window)
    host, bound = server.server_address[:2]
    click.echo(f"serving celery-lease metrics on http://{host}:{bound}/metrics", err=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
