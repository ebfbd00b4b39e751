"""Screenshots of the Django admin for docs/img (run by hand, not by pytest).

``python -m tests.django.screenshots [OUTDIR]`` (default ``docs/img``):

1. creates the PostgreSQL database ``celery_lease_django_screens`` and migrates it with
   ``manage.py migrate`` (the app's migration creates the lease tables);
2. puts a day of a small shop's tasks into it through the lease store's real
   operations: claims, steps, a worker that died, reaper sweeps, a retry;
3. serves the test project with ``manage.py runserver`` on loopback and photographs
   the task list and one WAIT_MANUAL task's page with headless Chromium, logged in as
   a superuser through a screenshot-only URL (``proj/urls_screens.py``);
4. stops the server and drops the database.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.helpers import REPO_ROOT, wait_until

DB_NAME = "celery_lease_django_screens"
SETTINGS = "tests.django.proj.settings_screens"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("CELERY_LEASE_DATABASE_URL", None)
    env.update(
        DJANGO_SETTINGS_MODULE=SETTINGS,
        CELERY_LEASE_DJANGO_DB=DB_NAME,
        PYTHONPATH=str(REPO_ROOT),
    )
    return env


def _pg_admin(*statements: str) -> None:
    import psycopg
    from sqlalchemy.engine import make_url

    url = make_url(
        os.environ.get(
            "CELERY_LEASE_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/test"
        )
    )
    dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)  # type: ignore[arg-type]


def populate() -> dict[str, Any]:
    """Runs inside the screenshot settings: tasks, workers and a superuser's session."""
    import django

    django.setup()
    from django.contrib.auth.models import User

    from celery_lease._runtime import runtime
    from celery_lease.contrib.django import lease_app
    from celery_lease.store import Lease, NewTask

    store = runtime(lease_app()).store

    def worker(node: str, pid: int) -> str:
        wid = uuid.uuid4().hex[:16]
        store.register_worker(wid, node, node.split("@")[1], pid)
        return wid

    w1 = worker("celery@worker-1", 3121)
    w2 = worker("celery@worker-2", 3187)

    def submit(name: str, args: list[Any], dedup: str | None = None) -> str:
        tid = str(uuid.uuid4())
        store.submit(
            NewTask(
                id=tid,
                name=name,
                args=json.dumps(args),
                kwargs="{}",
                options="{}",
                lease_ttl=30.0,
                max_recoveries=5,
                dedup_key=dedup,
            )
        )
        return tid

    def claim(tid: str, owner: str, node: str) -> Lease:
        got = store.claim(tid, owner, f"worker:{node}")
        return got.lease  # type: ignore[union-attr]

    for n in range(4):  # receipts sent
        tid = submit("shop.tasks.send_receipt", [1040 + n], dedup=f"receipt-{1040 + n}")
        lease = claim(tid, w1, "celery@worker-1")
        store.step_done(lease, "render", '"ok"', idempotent=True)
        store.finish(
            lease,
            _state("SUCCEEDED"),
            actor="worker:celery@worker-1",
            reason="succeeded",
            result='{"sent": true}',
        )
    failed = submit("shop.tasks.sync_inventory", ["warehouse-b"])
    lease = claim(failed, w1, "celery@worker-1")
    store.finish(
        lease,
        _state("FAILED"),
        actor="worker:celery@worker-1",
        reason="ConnectionError: inventory API unreachable",
        error="ConnectionError",
    )
    running = submit("shop.tasks.export_orders", ["2024-05"])
    lease = claim(running, w1, "celery@worker-1")
    store.save_progress(lease, '{"rows": 18000}')
    waiting = submit("shop.tasks.send_receipt", [1045], dedup="receipt-1045")
    # the order whose card charge is in doubt: worker-2 died in the middle of it, twice
    charge = submit("shop.tasks.charge_card", [1046, 129.9], dedup="order-1046")
    lease = claim(charge, w2, "celery@worker-2")
    store.step_done(lease, "reserve stock", '{"reserved": 3}', idempotent=True)
    store.expire(
        actor="reaper:web-1",
        reason="worker celery@worker-2 lost (WorkerLostError)",
        task_ids=[charge],
        only_expired=False,
    )
    store.take_due_retries(actor="reaper:web-1")
    w2b = worker("celery@worker-2", 3302)  # restarted
    lease = claim(charge, w2b, "celery@worker-2")
    store.step_started(lease, "charge card", checkable=False)
    store.stop_worker(w2b, "SIGKILL (out of memory)")
    store.expire(actor="reaper:web-1", reason="lease expired: owner's heartbeat older than the TTL")
    other = submit("shop.tasks.charge_card", [1047, 42.0], dedup="order-1047")
    lease = claim(other, w1, "celery@worker-1")
    store.step_done(lease, "reserve stock", '{"reserved": 1}', idempotent=True)
    store.step_done(lease, "charge card", '{"charge": "ch_3PqL"}', idempotent=False)
    store.finish(
        lease,
        _state("SUCCEEDED"),
        actor="worker:celery@worker-1",
        reason="succeeded",
        result='{"charge": "ch_3PqL"}',
    )
    cancelled = submit("shop.tasks.send_newsletter", ["spring"])
    store.request_cancel(cancelled, actor="maria", reason="campaign postponed")
    retry = submit("shop.tasks.sync_inventory", ["warehouse-a"])
    lease = claim(retry, w1, "celery@worker-1")
    store.expire(
        actor="reaper:web-1",
        reason="worker celery@worker-1 lost while calling the inventory API",
        task_ids=[lease.task_id],
        only_expired=False,
    )

    user, _ = User.objects.get_or_create(username="maria", defaults={"email": "maria@example.com"})
    user.is_staff = user.is_superuser = True
    user.set_password(uuid.uuid4().hex)
    user.save()
    runtime(lease_app()).reset()
    return {"charge": charge, "pending": waiting}


def _state(name: str) -> Any:
    from celery_lease.states import State

    return State(name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def server(port: int) -> Iterator[str]:
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [
            sys.executable,
            "tests/django/manage.py",
            "runserver",
            f"127.0.0.1:{port}",
            "--noreload",
            "--insecure",
        ],
        cwd=REPO_ROOT,
        env=_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: _answers(base + "/admin/login/"), timeout=30, message="runserver did not answer"
        )
        yield base
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def shoot(url: str, out: Path, size: str) -> None:
    subprocess.run(
        ["chromium", *CHROMIUM_FLAGS, f"--window-size={size}", f"--screenshot={out}", url],
        check=True,
        capture_output=True,
        timeout=120,
    )
    print(f"wrote {out}")


def main(outdir: Path) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    _pg_admin(f'DROP DATABASE IF EXISTS "{DB_NAME}" WITH (FORCE)', f'CREATE DATABASE "{DB_NAME}"')
    try:
        subprocess.run(
            [sys.executable, "tests/django/manage.py", "migrate", "-v", "0"],
            cwd=REPO_ROOT,
            env=_env(),
            check=True,
        )
        ids = json.loads(
            subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import json; from tests.django.screenshots import populate; "
                    "print(json.dumps(populate()))",
                ],
                cwd=REPO_ROOT,
                env=_env(),
                check=True,
                capture_output=True,
                text=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        with server(_free_port()) as base:
            login = base + "/screenshot-login/?next="
            shoot(login + "/admin/celery_lease/task/", outdir / "django-admin-list.png", "1400,900")
            shoot(
                login + f"/admin/celery_lease/task/{ids['charge']}/change/",
                outdir / "django-admin-task.png",
                "1400,1800",
            )
    finally:
        _pg_admin(f'DROP DATABASE IF EXISTS "{DB_NAME}" WITH (FORCE)')


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT / "docs" / "img")
