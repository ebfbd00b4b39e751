"""``celery lease pause / resume / pauses``: the commands an incident needs."""

from __future__ import annotations

from typing import Any

import click

from . import _common as _cli
from ._render import Table, _print_json, ago


def _target_options(fn: Any) -> Any:
    fn = click.option("--task", "-t", "task", help="A task name to pause (e.g. app.export).")(fn)
    return click.option("--queue", "-q", "queue", help="A queue to pause.")(fn)


def _check_target(queue: str | None, task: str | None) -> None:
    if (queue is None) == (task is None):
        raise click.UsageError("name exactly one of --queue or --task")


@_cli.lease.command()
@_target_options
@click.option("--reason", "-r", required=True, help="Why, for the audit trail (required).")
@_cli.actor_option
@_cli.json_option
@click.pass_context
@_cli.handle_errors
def pause(
    ctx: click.Context,
    queue: str | None,
    task: str | None,
    reason: str,
    actor: str | None,
    as_json: bool,
) -> None:
    """Pause a queue (workers stop consuming it) or a task name (its deliveries wait,
    PENDING, and are published again on resume), until `lease resume`."""
    _check_target(queue, task)
    api = _cli._admin(ctx)
    changed = api.pause(queue=queue, task=task, reason=reason, actor=actor)
    kind, target = ("queue", queue) if queue is not None else ("task", task)
    if as_json:
        _print_json({"kind": kind, "target": target, "paused": True, "changed": changed})
        return
    if changed:
        click.echo(f"{kind} {target} paused (workers follow within a heartbeat interval)")
    else:
        click.echo(f"{kind} {target} was already paused: nothing changed")


@_cli.lease.command()
@_target_options
@click.option("--reason", "-r", required=True, help="Why, for the audit trail (required).")
@_cli.actor_option
@_cli.json_option
@click.pass_context
@_cli.handle_errors
def resume(
    ctx: click.Context,
    queue: str | None,
    task: str | None,
    reason: str,
    actor: str | None,
    as_json: bool,
) -> None:
    """End a pause made with `lease pause`."""
    _check_target(queue, task)
    api = _cli._admin(ctx)
    changed = api.resume(queue=queue, task=task, reason=reason, actor=actor)
    kind, target = ("queue", queue) if queue is not None else ("task", task)
    if as_json:
        _print_json({"kind": kind, "target": target, "paused": False, "changed": changed})
        return
    if changed:
        click.echo(f"{kind} {target} resumed")
    else:
        click.echo(f"{kind} {target} was not paused: nothing changed")


@_cli.lease.command()
@click.option("--history", is_flag=True, help="Every pause and resume, newest first.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@_cli.json_option
@click.pass_context
@_cli.handle_errors
def pauses(ctx: click.Context, history: bool, limit: int, as_json: bool) -> None:
    """What is paused now, by whom and why (`--history`: the pauses' audit log)."""
    api = _cli._admin(ctx)
    color = _cli._color(ctx)
    now = api.store.now()
    if history:
        events = api.pause_history(limit=limit)
        if as_json:
            _print_json(events)
            return
        log = Table(["WHEN", "ACTION", "KIND", "TARGET", "ACTOR", "REASON"], {})
        for e in events:
            log.add(ago(e.at, now), e.action, e.kind, e.target, e.actor, e.reason)
        log.render(color)
        return
    rows = api.pauses()
    if as_json:
        _print_json(rows)
        return
    if not rows:
        click.echo("Nothing is paused.", err=True)
        return
    table = Table(["KIND", "TARGET", "SINCE", "ACTOR", "REASON"], {})
    for p in rows:
        table.add(p.kind, p.target, ago(p.paused_at, now), p.actor, p.reason)
    table.render(color)
