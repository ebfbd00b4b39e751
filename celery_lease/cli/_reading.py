"""The reading commands: list, show (with what an operator can do), stats, workers."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import click

from ..exceptions import TaskNotFound
from ..states import STEP_DONE, State, action_sources
from ._common import _admin, _app_option, _color, _duration, handle_errors, json_option, lease
from ._render import TASK_HEADERS, Table, _paint_state, _print_json, ago, rate, span, task_rows


@lease.command("list")
@click.option("--state", "-s", help="Only tasks in this state (e.g. WAIT_MANUAL).")
@click.option("--name", "-n", help="Only tasks with this task name.")
@click.option(
    "--older-than", callback=_duration, help="Only tasks submitted longer ago (90s, 15m, 2h, 7d)."
)
@click.option("--worker", "-w", help="Only tasks owned by this worker (node name or id).")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--ids", "-q", "ids_only", is_flag=True, help="Print task ids only.")
@click.option(
    "--scheduled",
    is_flag=True,
    help="Only the tasks held in the store until their ETA (lease_hold_eta_after), soonest first.",
)
@click.option(
    "--waiting",
    is_flag=True,
    help="Only the tasks waiting for a concurrency slot, oldest first per task and key.",
)
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
    scheduled: bool,
    waiting: bool,
    as_json: bool,
) -> None:
    """List tasks, newest first (with --scheduled: the held ones, soonest ETA first;
    with --waiting: those waiting for a concurrency slot, oldest first)."""
    api = _admin(ctx)
    if waiting:
        if scheduled or state is not None or older_than is not None or worker is not None:
            raise click.UsageError(
                "--waiting lists PENDING tasks waiting for a concurrency slot: it takes "
                "--name and --limit, not --scheduled, --state, --older-than or --worker"
            )
        _list_waiting(ctx, api, name, limit, ids_only, as_json)
        return
    if scheduled:
        if state is not None or older_than is not None or worker is not None:
            raise click.UsageError(
                "--scheduled lists PENDING tasks held until their ETA: it takes --name and "
                "--limit, not --state, --older-than or --worker"
            )
        _list_held(ctx, api, name, limit, ids_only, as_json)
        return
    rows = api.tasks(state=state, name=name, older_than=older_than, worker=worker, limit=limit)
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


def _list_held(
    ctx: click.Context, api: Any, name: str | None, limit: int, ids_only: bool, as_json: bool
) -> None:
    """``lease list --scheduled``: the held rows, each with its ETA."""
    rows = api.held(name=name, limit=limit)
    if as_json:
        _print_json([dataclasses.asdict(r) for r in rows])
        return
    if ids_only:
        for r in rows:
            click.echo(r.id)
        return
    if not rows:
        click.echo("No tasks held until their ETA.", err=True)
        return
    now = api.store.now()
    table = Table(["ID", "NAME", "ETA", "DUE IN", "CREATED"], {})
    for r in rows:
        due = None if r.eta is None else (r.eta - now).total_seconds()
        eta = "-" if r.eta is None else r.eta.isoformat(timespec="seconds")
        table.add(r.id, r.name, eta, span(due), ago(r.created_at, now))
    table.render(_color(ctx))
    more = " (limit reached: --limit to see more)" if len(rows) == limit else ""
    click.echo(f"{len(rows)} held task{'s' if len(rows) != 1 else ''}{more}", err=True)


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


def _list_waiting(
    ctx: click.Context, api: Any, name: str | None, limit: int, ids_only: bool, as_json: bool
) -> None:
    """``lease list --waiting``: the rows waiting for a slot, each with its key."""
    rows = api.waiting(name=name, limit=limit)
    if as_json:
        _print_json([dataclasses.asdict(r) for r in rows])
        return
    if ids_only:
        for r in rows:
            click.echo(r.id)
        return
    if not rows:
        click.echo("No tasks waiting for a concurrency slot.", err=True)
        return
    now = api.store.now()
    table = Table(["ID", "NAME", "KEY", "SUBMITTED", "REASON"], {})
    for r in rows:
        table.add(r.id, r.name, r.key or "(global)", ago(r.created_at, now), r.reason)
    table.render(_color(ctx))
    more = " (limit reached: --limit to see more)" if len(rows) == limit else ""
    click.echo(f"{len(rows)} waiting task{'s' if len(rows) != 1 else ''}{more}", err=True)


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
        click.echo("")
        per_task = Table(TASK_HEADERS, {})
        for row in task_rows(snapshot.tasks):
            per_task.add(*row)
        per_task.render(color)
    if snapshot.slots:
        click.echo("")
        limits = Table(["LIMITED TASK", "KEY", "LIMIT", "IN USE", "WAITING", "OLDEST WAITING"], {})
        for u in snapshot.slots:
            limits.add(
                u.name,
                u.key or "(global)",
                u.limit,
                u.running + u.granted,
                u.waiting,
                span(u.oldest_waiting_age),
            )
        limits.render(color)


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


@lease.command()
@json_option
@click.pass_context
@handle_errors
def schedules(ctx: click.Context, as_json: bool) -> None:
    """Beat's leased entries (sent in slots, once each whatever the number of beats):
    the last slot run and its task, the next slot, the slots missed and skipped, and
    the beats seen in the last 5 minutes."""
    from ..beat import report

    now, entries, beats = report(_admin(ctx).app)
    if as_json:
        _print_json({"entries": entries, "beats": beats})
        return
    if not entries:
        click.echo("No leased beat entries recorded (no LeaseScheduler beat ran).", err=True)
    else:
        table = Table(
            ["ENTRY", "TASK", "LAST SLOT", "LAST TASK", "STATE", "NEXT SLOT", "MISSED", "SKIPPED"],
            {},
        )
        for e in entries:
            table.add(
                e.name,
                e.task,
                e.last_run_slot.isoformat(timespec="seconds") if e.last_run_slot else "-",
                e.last_task_id or "-",
                e.last_task_state or "-",
                e.next_slot.isoformat(timespec="seconds") if e.next_slot else "-",
                e.missed,
                e.skipped,
            )
        table.render(_color(ctx))
        for e in entries:
            if e.last_reason:
                click.echo(f"{e.name}: {e.last_reason}", err=True)
    if not beats:
        click.echo("No beat seen in the last 5 minutes.", err=True)
        return
    seen = Table(["BEAT", "HOST", "PID", "STARTED", "SEEN"], {})
    for b in beats:
        seen.add(b.id, b.host, b.pid, ago(b.started_at, now), ago(b.seen_at, now))
    seen.render(_color(ctx))
