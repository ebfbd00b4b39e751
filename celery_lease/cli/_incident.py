"""The commands an incident needs: ``pause``, ``resume``, ``pauses``, and the filters
of ``retry`` / ``fail`` / ``resolve`` / ``cancel`` (:func:`with_filters`)."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any, cast

import click

from . import _common as _cli
from ._common import F
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
    api = _cli._admin(ctx, creates=True)
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
    api = _cli._admin(ctx, creates=True)
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


# -- filters on retry / fail / resolve / cancel -------------------------------------------


def with_filters(action: str) -> Callable[[F], F]:
    """Filters for an acting command: with any of them, the command acts on every task
    they select (the operator API's ``bulk``) instead of on the ids given."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(**kwargs: Any) -> Any:
            filters = {k: kwargs.pop(k) for k in _FILTERS}
            dry_run, batch, limit = kwargs.pop("dry_run"), kwargs.pop("batch"), kwargs.pop("limit")
            given = {k: v for k, v in filters.items() if v is not None}
            if not given:
                if not kwargs.get("task_ids"):
                    raise click.UsageError(
                        "give task ids, or filters (--state, --name, --reason-contains, "
                        "--worker, --older-than) to act on every task they select"
                    )
                if dry_run:
                    raise click.UsageError("--dry-run goes with filters")
                return fn(**kwargs)
            if kwargs.get("task_ids"):
                raise click.UsageError("give task ids or filters, not both")
            if not kwargs.get("reason"):
                raise click.UsageError("--reason is required with filters")
            if kwargs.get("terminate"):
                raise click.UsageError(
                    "--terminate goes with task ids only: list the RUNNING tasks with "
                    "`lease list --state RUNNING` and give the ids of those to kill"
                )
            ctx = click.get_current_context()
            # the errors of a bulk action are reported as those of one (exit 2 for a
            # --state that is no state, 3 for a store that does not answer)
            return _cli.handle_errors(_bulk)(
                ctx, action, given, kwargs, dry_run=dry_run, batch=batch, limit=limit
            )

        options = [
            click.option("--state", "-s", "state", help="Only tasks in this state."),
            click.option("--name", "-n", "name", help="Only tasks with this task name."),
            click.option(
                "--reason-contains",
                "reason_contains",
                help="Only tasks whose reason has this.",
            ),
            click.option("--worker", "-w", "worker", help="Only tasks of this worker."),
            click.option(
                "--older-than",
                "older_than",
                callback=_cli._duration,
                help="Only tasks submitted longer ago (e.g. 2h).",
            ),
            click.option("--dry-run", is_flag=True, help="Show what would change; change nothing."),
            click.option(
                "--batch",
                type=click.IntRange(min=1),
                default=100,
                show_default=True,
                help="Tasks per transaction.",
            ),
            click.option("--limit", type=click.IntRange(min=1), help="At most this many tasks."),
        ]
        for option in reversed(options):
            wrapper = option(wrapper)
        return cast(F, wrapper)

    return decorate


_FILTERS = ("state", "name", "reason_contains", "worker", "older_than")


@_cli.handle_errors  # the filters' path leaves the command's own handler out
def _bulk(
    ctx: click.Context,
    action: str,
    filters: dict[str, Any],
    kwargs: dict[str, Any],
    *,
    dry_run: bool,
    batch: int,
    limit: int | None,
) -> None:
    result = None
    if kwargs.get("result_json") is not None:
        try:
            result = json.loads(kwargs["result_json"])
        except json.JSONDecodeError as error:
            raise ValueError(f"--result is not valid JSON: {error}") from None
    api = _cli._admin(ctx)
    done = api.bulk(
        action,
        reason=kwargs["reason"],
        actor=kwargs.get("actor"),
        result=result,
        dry_run=dry_run,
        batch=batch,
        limit=limit,
        **filters,
    )
    if kwargs.get("as_json"):
        _print_json(done.as_dict())
    else:
        color = _cli._color(ctx)
        table = Table(["ID", "TASK", "FROM", "TO"], {})
        for c in done.changed:
            to = f"{c.to_state.value} (cancel requested)" if c.requested else c.to_state.value
            table.add(c.id, c.name, c.from_state.value, to)
        if done.changed:
            table.render(color)
        verb = "would change" if dry_run else "changed"
        tail = "" if dry_run else f" in {done.batches} transaction(s)"
        click.echo(f"{action}: {verb} {len(done.changed)} task(s){tail}", err=True)
        if done.refused is not None:
            r = done.refused
            state = r.state.value if r.state is not None else "missing"
            click.echo(
                click.style(
                    f"{'would stop' if dry_run else 'stopped'} at {r.id} ({r.name}, {state}): "
                    f"{r.why}; it and the tasks after it were left as they are",
                    fg="red",
                ),
                err=True,
                color=color,
            )
    if not dry_run:
        _cli._flush(api)
    if done.refused is not None:
        sys.exit(_cli.EXIT_REFUSED)
