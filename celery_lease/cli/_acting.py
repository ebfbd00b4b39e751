"""The acting commands: retry, fail, resolve, cancel (each a call to the operator API)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable
from typing import Any

import click

from ..exceptions import IllegalTransition, TaskNotFound
from ..states import State
from ._common import (
    F,
    _admin,
    _color,
    _flush,
    actor_option,
    exit_code,
    handle_errors,
    json_option,
    lease,
    worst,
)
from ._incident import with_filters
from ._render import _print_json


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
@click.argument("task_ids", nargs=-1)
@actor_option
@_reason_option(False)
@json_option
@with_filters("retry")
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
@click.argument("task_ids", nargs=-1)
@actor_option
@_reason_option(True)
@json_option
@with_filters("fail")
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
@click.argument("task_ids", nargs=-1)
@actor_option
@_reason_option(True)
@click.option("--result", "result_json", help="The task's result, as JSON (default: null).")
@json_option
@with_filters("resolve")
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
@click.argument("task_ids", nargs=-1)
@actor_option
@_reason_option(False)
@click.option("--terminate", is_flag=True, help="Also kill the process of a RUNNING task.")
@json_option
@with_filters("cancel")
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
