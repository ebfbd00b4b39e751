"""``celery -A proj lease ...`` against a real database (SQLite and PostgreSQL).

Most tests invoke the click group in-process (fast); those marked "real command" run
``python -m celery -A <project> lease ...`` as a subprocess, on a pipe or a terminal.
"""

from __future__ import annotations

import getpass
import json
import os
import pty
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import pytest
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_lease import State
from celery_lease.cli import lease, parse_duration
from celery_lease.store.schema import SCHEMA_VERSION

from .test_cli_support import Ops, ops_fixture  # noqa: F401  (the ops fixture)


def run(ops: Ops, *args: str) -> Result:
    """The lease command group in-process, as ``celery -A proj`` would call it."""
    obj = CLIContext(app=ops.app, no_color=False, workdir=None)
    return CliRunner().invoke(lease, list(args), obj=obj, catch_exceptions=False)


def one_line_error(result: Result, code: int, *needles: str) -> str:
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ")
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


def real(
    project: Any, args: Sequence[str], *, tty: bool = False, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """Run the real ``celery -A <module> lease ...``; returns (code, stdout, stderr).
    With ``tty`` both streams are one terminal (a pty) and come back as stdout."""
    argv = [sys.executable, "-m", "celery", "-A", project.module, *args]
    environ = project.process_env({"COLUMNS": "200"})
    environ.pop("NO_COLOR", None)
    environ.update(env or {})
    if not tty:
        proc = subprocess.run(
            argv,
            cwd=project.directory,
            env=environ,
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        return proc.returncode, proc.stdout, proc.stderr
    master, slave = pty.openpty()
    child = subprocess.Popen(
        argv, cwd=project.directory, env=environ, stdin=slave, stdout=slave, stderr=slave
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the terminal's other side is closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return child.wait(60), b"".join(chunks).decode(errors="replace"), ""


# -- reading ------------------------------------------------------------------------------


def test_list_prints_a_table_json_and_ids(ops: Ops) -> None:
    waiting = ops.wait_manual()
    pending = ops.submit()

    table = run(ops, "list")
    assert table.exit_code == 0, table.output
    header, *rows = table.stdout.splitlines()
    assert header.split() == ["ID", "NAME", "STATE", "ATTEMPT", "CREATED", "WORKER", "REASON"]
    assert [r.split()[0] for r in rows] == [pending, waiting]
    assert "WAIT_MANUAL" in rows[1] and "outcome of step 'charge' unknown" in rows[1]
    assert "\x1b[" not in table.stdout  # not a terminal: no colour
    assert table.stderr.strip() == "2 tasks"

    as_json = json.loads(run(ops, "list", "--state", "wait_manual", "--json").stdout)
    assert [(t["id"], t["state"], t["name"]) for t in as_json] == [
        (waiting, "WAIT_MANUAL", "ops.charge")
    ]
    assert run(ops, "list", "-q", "--name", "ops.add").stdout.split() == [pending]
    empty = run(ops, "list", "--older-than", "1h")
    assert (empty.exit_code, empty.stdout, empty.stderr.strip()) == (0, "", "No tasks match.")


def test_list_scheduled_shows_the_held_tasks_soonest_first(ops: Ops) -> None:
    add = ops.app.tasks["ops.add"]
    assert ops.store.config.hold_eta_after == 60.0  # the default: an hour ahead is held
    later = str(add.apply_async((1, 2), countdown=7200).id)
    sooner = str(add.apply_async((3, 4), countdown=3600).id)
    ops.submit()  # PENDING, published: not held

    table = run(ops, "list", "--scheduled")
    assert table.exit_code == 0, table.output
    header, *rows = table.stdout.splitlines()
    assert header.split() == ["ID", "NAME", "ETA", "DUE", "IN", "CREATED"]
    assert [r.split()[0] for r in rows] == [sooner, later]
    eta = ops.store.get(sooner).eta
    assert eta is not None and eta.isoformat(timespec="seconds") in rows[0]
    assert table.stderr.strip() == "2 held tasks"

    as_json = json.loads(run(ops, "list", "--scheduled", "--json").stdout)
    assert [(t["id"], t["name"]) for t in as_json] == [(sooner, "ops.add"), (later, "ops.add")]
    assert as_json[0]["eta"] == eta.isoformat()
    assert run(ops, "list", "--scheduled", "-q", "--limit", "1").stdout.split() == [sooner]
    assert run(ops, "list", "--scheduled", "--name", "ops.charge").stderr.strip() == (
        "No tasks held until their ETA."
    )
    ops.admin.cancel(sooner, reason="not wanted")
    assert run(ops, "list", "--scheduled", "-q").stdout.split() == [later]
    refused = run(ops, "list", "--scheduled", "--state", "PENDING")
    assert refused.exit_code == 2 and "--scheduled" in refused.stderr


def test_show_wait_manual_explains_why_and_spells_out_each_decision(ops: Ops) -> None:
    task_id = ops.wait_manual()

    shown = run(ops, "show", task_id)

    assert shown.exit_code == 0, shown.output
    out = shown.stdout
    assert f"Task {task_id}  ops.charge" in out
    assert "outcome of step 'charge' unknown" in out
    # steps: the done one with its result, the one in flight as unknown
    assert any(
        line.split()[:2] == ["reserve", "DONE"] and '"r-1"' in line for line in out.splitlines()
    )
    assert any(
        line.split()[:2] == ["charge", "STARTED"] and "(outcome unknown)" in line
        for line in out.splitlines()
    )
    # the full audit trail, oldest first
    history = [r.to_state.value for r in ops.store.history(task_id)]
    assert history == ["PENDING", "RUNNING", "TIMEOUT", "WAIT_MANUAL"]
    trail = out.split("History (4)")[1].split("Waiting for a person")[0]
    assert [line.split()[2] for line in trail.strip().splitlines()[1:]] == history
    assert "reaper:ops-test" in trail
    # what a person can do, as commands to copy
    assert "Waiting for a person" in out
    assert "step 'charge' started in attempt 1" in out
    for command in ("retry", "resolve", "fail", "cancel"):
        assert f"celery -A proj lease {command} {task_id} --reason" in out

    as_json = json.loads(run(ops, "show", task_id, "--json").stdout)
    assert as_json["task"]["state"] == "WAIT_MANUAL"
    assert [s["name"] for s in as_json["steps"]] == ["reserve", "charge"]
    assert [h["to_state"] for h in as_json["history"]] == history
    assert [a["action"] for a in as_json["actions"]] == ["retry", "resolve", "fail", "cancel"]


def test_show_of_a_finished_task_offers_nothing(ops: Ops) -> None:
    task_id = ops.finished(State.SUCCEEDED)
    out = run(ops, "show", task_id).stdout
    assert "What you can do" not in out and "Waiting for a person" not in out
    assert "result        3" in out


def test_unknown_id_is_a_one_line_error_with_exit_4(ops: Ops) -> None:
    one_line_error(run(ops, "show", "no-such-task"), 4, "no-such-task")
    one_line_error(run(ops, "retry", "no-such-task"), 4, "no-such-task")


def test_stats_and_workers(ops: Ops) -> None:
    ops.finished(State.SUCCEEDED)
    ops.running(nodename="busy@ops-test")
    ops.wait_manual()

    stats = run(ops, "stats", "--window", "10m")
    assert stats.exit_code == 0, stats.output
    counts = dict(line.split() for line in stats.stdout.split("\n\n")[0].splitlines()[1:])
    assert counts["WAIT_MANUAL"] == "1" and counts["RUNNING"] == "1"
    assert "run time p50" in stats.stdout
    as_json = json.loads(run(ops, "stats", "--json").stdout)
    assert as_json["counts"]["SUCCEEDED"] == 1 and as_json["window"] == 3600

    workers = run(ops, "workers")
    assert workers.exit_code == 0, workers.output
    busy = next(line for line in workers.stdout.splitlines() if line.startswith("busy@"))
    assert busy.split()[3:4] == ["alive"] and busy.split()[-4] == "1"
    rows = json.loads(run(ops, "workers", "--json").stdout)
    assert {w["nodename"] for w in rows} >= {"busy@ops-test"}


def test_the_worker_filter_and_stopped_workers(ops: Ops) -> None:
    # reference-cli.md: --worker is a node name or the incarnation id of the latest
    # attempt's owner, on list and on the bulk actions; workers --all adds the stopped
    on_w1 = ops.wait_manual(nodename="w1@ops-test")
    on_w2 = ops.wait_manual(nodename="w2@ops-test")
    w1 = ops.store.get(on_w1)
    assert w1 is not None and w1.owner is not None
    assert run(ops, "list", "-q", "--worker", "w1@ops-test").stdout.split() == [on_w1]
    assert run(ops, "list", "-q", "-w", w1.owner).stdout.split() == [on_w1]

    dry = run(ops, "retry", "--worker", "w2@ops-test", "--reason", "relay up", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert on_w2 in dry.stdout and on_w1 not in dry.stdout
    assert ops.state(on_w2) is State.WAIT_MANUAL
    done = run(ops, "retry", "-w", "w2@ops-test", "--reason", "relay up", "--json")
    assert done.exit_code == 0, done.output
    assert [t["id"] for t in json.loads(done.stdout)["changed"]] == [on_w2]
    assert (ops.state(on_w1), ops.state(on_w2)) == (State.WAIT_MANUAL, State.PENDING)

    ops.store.stop_worker(w1.owner, "shut down")
    nodes = [line.split()[0] for line in run(ops, "workers").stdout.splitlines()[1:]]
    assert "w2@ops-test" in nodes and "w1@ops-test" not in nodes
    every = run(ops, "workers", "--all")
    assert every.exit_code == 0, every.output
    stopped = next(line for line in every.stdout.splitlines() if line.startswith("w1@ops-test"))
    assert stopped.split()[3] == "stopped"


# -- acting -------------------------------------------------------------------------------


def test_retry_fail_resolve_cancel_record_actor_and_reason(ops: Ops) -> None:
    to_retry, to_fail, to_resolve, to_cancel = (ops.wait_manual() for _ in range(4))

    done = run(ops, "retry", to_retry, "--actor", "alice", "--reason", "PSP: not charged")
    assert done.exit_code == 0 and done.stdout.strip() == (
        f"{to_retry}: WAIT_MANUAL -> PENDING, re-published"
    )
    assert run(ops, "fail", to_fail, "-r", "customer gave up").exit_code == 0
    resolved = run(
        ops,
        "resolve",
        to_resolve,
        "--reason",
        "charged by hand",
        "--result",
        '{"ref": 7}',
        "--json",
    )
    assert json.loads(resolved.stdout) == [
        {"id": to_resolve, "ok": True, "from": "WAIT_MANUAL", "to": "SUCCEEDED"}
    ]
    assert run(ops, "cancel", to_cancel, "--actor", "dan").exit_code == 0

    audit = {t: ops.store.history(t)[-1] for t in (to_retry, to_fail, to_resolve, to_cancel)}
    assert (audit[to_retry].actor, audit[to_retry].reason) == ("alice", "PSP: not charged")
    assert (audit[to_fail].actor, audit[to_fail].reason) == (getpass.getuser(), "customer gave up")
    assert audit[to_cancel].to_state is State.CANCELLED and audit[to_cancel].actor == "dan"
    resolved_row = ops.store.get(to_resolve)
    assert resolved_row is not None and resolved_row.result == {"ref": 7}
    assert ops.state(to_retry) is State.PENDING
    assert ops.state(to_fail) is State.FAILED


def test_cancel_of_a_running_task_is_a_request(ops: Ops) -> None:
    task_id = ops.running()
    result = run(ops, "cancel", task_id, "--reason", "wrong customer")
    assert result.exit_code == 0
    assert result.stdout.strip() == (
        f"{task_id}: RUNNING, cancel requested (stops at its next step boundary)"
    )
    record = ops.store.get(task_id)
    assert record is not None and record.cancel_reason == "wrong customer"


def test_illegal_transition_is_a_one_line_error_and_changes_nothing(ops: Ops) -> None:
    task_id = ops.finished(State.SUCCEEDED)
    before = ops.store.history(task_id)

    line = one_line_error(run(ops, "retry", task_id), 1, "SUCCEEDED -> PENDING")
    assert "not an allowed transition" in line
    one_line_error(run(ops, "resolve", ops.running(), "--reason", "x"), 1, "RUNNING -> SUCCEEDED")
    assert ops.store.history(task_id) == before


def test_several_ids_each_get_a_line_and_the_worst_exit_code(ops: Ops) -> None:
    a, b = ops.wait_manual(), ops.wait_manual()
    result = run(ops, "fail", a, "missing-id", b, "--reason", "bulk")
    assert result.exit_code == 4
    assert result.stdout.splitlines() == [
        f"{a}: WAIT_MANUAL -> FAILED",
        f"{b}: WAIT_MANUAL -> FAILED",
    ]
    assert result.stderr.strip() == "Error: no leased task with id 'missing-id'"
    assert ops.state(a) is ops.state(b) is State.FAILED


def test_the_exit_code_is_the_worst_error_not_the_first(ops: Ops) -> None:
    done = ops.finished(State.SUCCEEDED)  # refused (1), met first
    manual = ops.wait_manual()
    result = run(ops, "retry", done, "missing-id", manual)  # then not found (4)
    assert result.exit_code == 4, result.output
    assert result.stdout.splitlines() == [f"{manual}: WAIT_MANUAL -> PENDING, re-published"]
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 2 and "SUCCEEDED -> PENDING" in errors[0] and "missing-id" in errors[1]
    # the order of the ids does not change the code
    again = run(ops, "cancel", "missing-id", done)
    assert again.exit_code == 4, again.output


@pytest.mark.parametrize(
    "args",
    [
        ["list", "--state", "STUCK"],
        ["list", "--older-than", "3 fortnights"],
        ["fail", "some-id"],  # --reason is required
        ["resolve", "some-id", "--reason", "x", "--result", "{not json"],
        ["purge"],  # --older-than is required
        ["purge", "--older-than", "1d", "--state", "RUNNING"],
        ["list", "--limit", "0"],
        ["retry", "--state", "BOGUS", "--reason", "x"],
        ["fail", "--state", "BOGUS", "--reason", "x"],
        ["resolve", "--state", "BOGUS", "--reason", "x"],
        ["cancel", "--state", "BOGUS", "--reason", "x"],
        ["cancel", "--terminate", "--state", "PENDING", "--reason", "x"],
    ],
)
def test_bad_input_exits_2_without_a_traceback(ops: Ops, args: list[str]) -> None:
    result = run(ops, *args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "Error" in result.stderr


@pytest.mark.parametrize("action", ["retry", "fail", "resolve", "cancel"])
def test_an_acting_command_with_no_such_state_says_so_in_one_line(ops: Ops, action: str) -> None:
    one_line_error(run(ops, action, "--state", "BOGUS", "--reason", "x"), 2, "BOGUS")


def test_terminate_with_filters_is_refused_and_changes_nothing(ops: Ops) -> None:
    task_id = ops.submit()
    result = run(ops, "cancel", "--terminate", "--state", "PENDING", "--reason", "x")
    assert result.exit_code == 2, result.output
    assert "--terminate goes with task ids only" in result.output
    assert ops.store.get(task_id).state is State.PENDING


@pytest.mark.postgres
@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_value_the_database_refuses_exits_2_saying_what_is_wrong(ops: Ops) -> None:
    # a queue name over the column's 255 characters: bad input, not an outage (exit 3)
    line = one_line_error(
        run(ops, "pause", "--queue", "q" * 10_000, "--reason", "x"), 2, "refused a value"
    )
    assert "too long" in line and "unavailable" not in line


def test_purge_counts_shows_progress_and_deletes(ops: Ops) -> None:
    for _ in range(5):
        ops.finished(State.SUCCEEDED)
    keep = ops.finished(State.FAILED)

    dry = run(ops, "purge", "--older-than", "0", "--dry-run", "--json")
    assert json.loads(dry.stdout) == {"would_delete": 5, "states": ["SUCCEEDED", "CANCELLED"]}
    assert len(ops.store.list_tasks()) == 6

    result = run(ops, "purge", "--older-than", "0s", "--batch", "2")
    assert result.exit_code == 0, result.output
    assert "purging" in result.stderr  # the progress bar's label (off a terminal: label only)
    assert result.stdout.strip() == "deleted 5 tasks (SUCCEEDED, CANCELLED)"
    assert [r.id for r in ops.store.list_tasks()] == [keep]
    assert json.loads(run(ops, "purge", "--older-than", "0", "-s", "failed", "--json").stdout) == {
        "deleted": 1,
        "states": ["failed"],
    }


def test_reap_moves_a_zombie(ops: Ops) -> None:
    task_id = ops.running()
    record = ops.store.get(task_id)
    assert record is not None and record.owner is not None
    ops.store.stop_worker(record.owner, "killed")

    result = run(ops, "reap", "--json")

    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["expired"] == 1 and report["retried"] == 1
    assert ops.state(task_id) is not State.RUNNING


def test_migrate_creates_then_reports_up_to_date(
    celery_project: Any, make_store: Any, redis_url: str
) -> None:
    fresh = make_store(migrate=False)
    project = celery_project("", config=fresh.config)
    app = project.load().app
    obj = CLIContext(app=app, no_color=True, workdir=None)
    first = CliRunner().invoke(lease, ["migrate"], obj=obj, catch_exceptions=False)
    assert first.exit_code == 0, first.output
    assert f"migrated schema from nothing to version {SCHEMA_VERSION}" in first.stdout
    again = CliRunner().invoke(lease, ["migrate"], obj=obj, catch_exceptions=False)
    assert f"schema is up to date (version {SCHEMA_VERSION})" in again.stdout
    assert fresh.schema_version() is not None


# -- the real command ---------------------------------------------------------------------


def test_real_command_database_unreachable(celery_project: Any) -> None:
    project = celery_project(
        "", settings={"lease_database_url": "postgresql://postgres@127.0.0.1:1/test"}
    )
    for args in (["lease", "list"], ["lease", "retry", "some-id"], ["lease", "stats", "--json"]):
        code, out, err = real(project, args)
        assert code == 3, (code, out, err)
        assert out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: lease store"), err
        assert "127.0.0.1:1" in lines[0] and "Traceback" not in err


#: Commands that read the store or act on rows in it: none may create a store.
NEEDS_A_STORE = [
    ["lease", "list"],
    ["lease", "show", "some-id"],
    ["lease", "stats"],
    ["lease", "workers", "--json"],
    ["lease", "pauses"],
    ["lease", "check", "--no-workers"],
    ["lease", "retry", "some-id"],
    ["lease", "cancel", "--state", "PENDING", "--reason", "r", "--dry-run"],
    ["lease", "purge", "--older-than", "1d"],
]


def test_real_commands_that_read_never_create_a_sqlite_store(celery_project: Any) -> None:
    project = celery_project("", env={"CELERY_LEASE_DATABASE_URL": ""})  # the default file
    default = project.directory / "celery-lease.sqlite3"
    for args in NEEDS_A_STORE:
        code, out, err = real(project, args)
        assert code == 2, (args, code, out, err)
        line = err.strip()
        assert line.startswith(f"Error: no lease store at {default} ") and "\n" not in line, err
        assert "lease_database_url is not set" in line and str(project.directory) in line
        assert out == "" and "Traceback" not in err
        assert not default.exists(), args

    code, out, err = real(project, ["lease", "migrate"])  # a write command creates it
    assert code == 0 and default.exists(), (out, err)
    code, out, err = real(project, ["lease", "list"])
    assert code == 0 and "No tasks match" in out + err, (out, err)


def test_real_command_names_the_setting_that_chose_a_missing_store(
    celery_project: Any, tmp_path: Any
) -> None:
    missing = tmp_path / "elsewhere" / "store.sqlite3"
    project = celery_project("", settings={"lease_database_url": f"sqlite:///{missing}"})
    code, out, err = real(project, ["lease", "list"])
    assert code == 2, (code, out, err)
    assert f"no lease store at {missing} (set by lease_database_url)" in err
    assert not missing.parent.exists()


def test_real_command_colours_a_terminal_only(ops: Ops) -> None:
    task_id = ops.wait_manual()

    code, piped, _ = real(ops.project, ["lease", "list"])
    assert code == 0 and task_id in piped and "\x1b[" not in piped

    code, on_tty, _ = real(ops.project, ["lease", "list"], tty=True)
    assert code == 0 and task_id in on_tty
    assert "\x1b[" in on_tty  # coloured states, bold headers

    code, no_color, _ = real(ops.project, ["-C", "lease", "show", task_id], tty=True)
    assert code == 0 and "Waiting for a person" in no_color and "\x1b[" not in no_color
    code, env_off, _ = real(ops.project, ["lease", "list"], tty=True, env={"NO_COLOR": "1"})
    assert code == 0 and "\x1b[" not in env_off


def test_real_command_json_is_parseable(ops: Ops) -> None:
    task_id = ops.wait_manual()
    code, out, err = real(ops.project, ["lease", "show", task_id, "--json"])
    assert code == 0, err
    assert json.loads(out)["task"]["id"] == task_id
    code, out, err = real(
        ops.project, ["lease", "retry", task_id, "--json", "--actor", "ci", "--reason", "again"]
    )
    assert code == 0, err
    assert json.loads(out) == [{"id": task_id, "ok": True, "from": "WAIT_MANUAL", "to": "PENDING"}]
    assert ops.store.history(task_id)[-1].actor == "ci"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90), ("90s", 90), ("1.5m", 90), ("2h", 7200), ("7d", 604800), ("1w", 604800)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_parse_duration_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("soon")


def test_list_waiting_stats_and_metrics_show_the_slots_of_limited_tasks(ops: Ops) -> None:
    import uuid

    from celery_lease import metrics as lease_metrics
    from celery_lease.store import Claim, Slot

    owner = uuid.uuid4().hex
    ops.store.register_worker(owner, "w@host", "host", os.getpid())
    first, second, third = (ops.submit() for _ in range(3))
    slot = Slot("ops.add", "tenant=1", 1)
    assert isinstance(ops.store.claim(first, owner, "w", slot=slot), Claim)
    for task_id in (second, third):
        assert not isinstance(ops.store.claim(task_id, owner, "w", slot=slot), Claim)

    table = run(ops, "list", "--waiting")
    assert table.exit_code == 0, table.output
    header, *rows = table.stdout.splitlines()
    assert header.split() == ["ID", "NAME", "KEY", "SUBMITTED", "REASON"]
    # submission order (two rows of one millisecond on SQLite: either way)
    assert sorted(r.split()[0] for r in rows) == sorted([second, third])
    assert "tenant=1" in rows[0] and "waiting for a slot of ops.add[tenant=1]" in rows[0]
    assert table.stderr.strip() == "2 waiting tasks"
    as_json = json.loads(run(ops, "list", "--waiting", "--json").stdout)
    assert sorted((t["id"], t["key"]) for t in as_json) == sorted(
        [(second, "tenant=1"), (third, "tenant=1")]
    )
    refused = run(ops, "list", "--waiting", "--state", "PENDING")
    assert refused.exit_code == 2 and "--waiting" in refused.stderr

    stats = run(ops, "stats")
    assert stats.exit_code == 0, stats.output
    out = stats.stdout.splitlines()
    limits = next(i for i, x in enumerate(out) if x.startswith("LIMITED TASK"))
    assert out[limits].split() == [
        "LIMITED",
        "TASK",
        "KEY",
        "LIMIT",
        "IN",
        "USE",
        "WAITING",
        "OLDEST",
        "WAITING",
    ]
    line = out[limits + 1]
    assert line.split()[:5] == ["ops.add", "tenant=1", "1", "1", "2"]
    (slots,) = json.loads(run(ops, "stats", "--json").stdout)["slots"]
    assert {k: slots[k] for k in ("task", "key", "limit", "in_use", "waiting")} == {
        "task": "ops.add",
        "key": "tenant=1",
        "limit": 1,
        "in_use": 1,
        "waiting": 2,
    }
    assert slots["oldest_waiting_age"] >= 0

    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in lease_metrics.LeaseCollector(ops.app, store=ops.store).collect()
        for s in family.samples
    }
    labels = (("key", "tenant=1"), ("task", "ops.add"))
    assert samples[("celery_lease_concurrency_slots_in_use", labels)] == 1
    assert samples[("celery_lease_concurrency_limit", labels)] == 1
    assert samples[("celery_lease_concurrency_waiting", labels)] == 2
