"""The parity suite's tasks, defined twice on a generated project's app: once as plain
Celery tasks (names ``p.<task>``) and once as leased tasks (``l.<task>``), with the
same bodies, so each scenario runs side by side on both.

Every body counts itself in the external stub (:class:`tests.helpers.ExternalSystem`)
under ``<task name>:<tag>:start`` when it begins and ``<task name>:<tag>:done`` when
it returns, with what Celery's request said (its id, parent and root ids, retries,
custom header, time limits, wall time) as the JSON payload of the start effect. The
``tag`` names the scenario, so each scenario's runs are counted apart.

A gated task (``gate``, the head of the crash scenarios) waits while the test holds the
gate file ``<task name>:<tag>`` in ``LEASE_TEST_GATES``.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from celery import Celery, Task
from celery.exceptions import SoftTimeLimitExceeded

from celery_lease import LeasedTask

from ..helpers import ExternalSystem

#: Environment variable naming the directory of gate files (as in tests.crash.support).
GATES_ENV = "LEASE_TEST_GATES"
#: The two sides of every scenario: prefix of the task names and base class.
SIDES: dict[str, type[Task]] = {"p": Task, "l": LeasedTask}  # type: ignore[type-arg]
#: The custom message header the scenarios set and the bodies report.
HEADER = "x_trace"


class Flaky(Exception):
    """What ``auto_once`` raises on its first attempt (``autoretry_for``)."""


def _external() -> ExternalSystem:
    return ExternalSystem.from_env()


def _start(task: Any, tag: str, **extra: Any) -> None:
    req = task.request
    headers = getattr(req, "headers", None) or {}
    info = {
        "id": req.id,
        "parent": req.parent_id,
        "root": req.root_id,
        "retries": req.retries,
        "trace": headers.get(HEADER, getattr(req, HEADER, None)),
        "limits": list(req.timelimit) if req.timelimit else None,
        "at": time.time(),
        **extra,
    }
    _external().call(f"{task.name}:{tag}:start", payload=json.dumps(info, sort_keys=True))


def _done(task: Any, tag: str) -> None:
    _external().call(f"{task.name}:{tag}:done", payload=task.request.id)


def _hold(name: str) -> None:
    path = os.path.join(os.environ[GATES_ENV], name)
    while os.path.exists(path):
        time.sleep(0.02)


def define(app: Celery) -> dict[str, Any]:
    """Register every parity task on ``app``, both sides; returns them by name."""
    tasks: dict[str, Any] = {}
    for prefix, base in SIDES.items():
        tasks.update(_define_side(app, prefix, base))
    return tasks


def _define_side(app: Celery, prefix: str, base: type[Task]) -> dict[str, Any]:  # type: ignore[type-arg]
    def task(name: str, **options: Any) -> Any:
        return app.task(base=base, bind=True, name=f"{prefix}.{name}", shared=False, **options)

    @task("add")
    def add(self: Any, x: int, y: int, tag: str) -> int:
        _start(self, tag)
        _done(self, tag)
        return x + y

    @task("tsum")
    def tsum(self: Any, values: list[int], tag: str) -> int:
        _start(self, tag)
        _done(self, tag)
        return sum(values)

    @task("collect")
    def collect(self: Any, value: Any, tag: str) -> Any:
        """A ``link=`` callback: gets the parent's result."""
        _start(self, tag, value=value)
        _done(self, tag)
        return value

    @task("on_error")
    def on_error(self: Any, task_id: str, tag: str) -> str:
        """A ``link_error=`` errback (old style: Celery publishes it with the task id)."""
        _start(self, tag, failed=task_id)
        _done(self, tag)
        return task_id

    @task("boom")
    def boom(self: Any, tag: str) -> None:
        _start(self, tag)
        raise ValueError(f"boom {tag}")

    @task("retry_once", max_retries=3)
    def retry_once(self: Any, x: int, tag: str, eta: str | None = None) -> int:
        """``self.retry()`` once (countdown 0.5 s, or an ETA: ``"naive"`` or ``"aware"``)."""
        _start(self, tag)
        if self.request.retries == 0:
            if eta is None:
                raise self.retry(countdown=0.5)
            when = datetime.now(timezone.utc) + timedelta(seconds=0.5)
            raise self.retry(eta=when.replace(tzinfo=None) if eta == "naive" else when)
        _done(self, tag)
        return x

    @task(
        "auto_once",
        autoretry_for=(Flaky,),
        max_retries=3,
        default_retry_delay=0.5,
        retry_backoff=False,
        retry_jitter=False,
    )
    def auto_once(self: Any, x: int, tag: str) -> int:
        _start(self, tag)
        if self.request.retries == 0:
            raise Flaky(tag)
        _done(self, tag)
        return x

    @task("soft")
    def soft(self: Any, tag: str) -> str:
        """Waits for its soft time limit (given at call) and returns ``"soft"``."""
        _start(self, tag)
        try:
            time.sleep(30)
        except SoftTimeLimitExceeded:
            _done(self, tag)
            return "soft"
        return "no soft limit"

    @task("noresult", ignore_result=True)
    def noresult(self: Any, tag: str) -> str:
        _start(self, tag)
        _done(self, tag)
        return "ignored"

    @task("odd")
    def odd(self: Any, tag: str) -> Any:
        """A result the JSON serializer cannot encode."""
        _start(self, tag)
        _done(self, tag)
        return {1, 2}

    @task("gate")
    def gate(self: Any, x: int, tag: str) -> int:
        """Waits at its gate between start and done (the crash scenarios' head)."""
        _start(self, tag)
        _hold(f"{self.name}:{tag}")
        _done(self, tag)
        return x

    @task("slow_first")
    def slow_first(self: Any, x: int, tag: str) -> int:
        """Overruns any hard time limit on its first run only (counted in the stub)."""
        _start(self, tag)
        if _external().count(f"{self.name}:{tag}:start") == 1:
            time.sleep(60)
        _done(self, tag)
        return x

    @task("charge")
    def charge(self: Any, x: int, tag: str) -> int:
        """Its gate is inside a non-idempotent step on the leased side: a kill there
        leaves the outcome unknown (WAIT_MANUAL)."""
        _start(self, tag)
        self_step = getattr(self, "step", None)
        if self_step is not None:
            self_step("charge", _hold, f"{self.name}:{tag}")
        else:
            _hold(f"{self.name}:{tag}")
        _done(self, tag)
        return x

    @task("barrier")
    def barrier(self: Any, n: int, tag: str) -> int:
        """Returns once ``n`` barrier tasks of ``tag`` started: with ``n`` = the pool's
        size, every slot ran one, so nothing submitted earlier is still running."""
        _start(self, tag)
        ext = _external()
        deadline = time.monotonic() + 30
        while ext.count(f"{self.name}:{tag}:start") < n and time.monotonic() < deadline:
            time.sleep(0.02)
        _done(self, tag)
        return n

    return {
        t.name: t
        for t in (
            add,
            tsum,
            collect,
            on_error,
            boom,
            retry_once,
            auto_once,
            soft,
            noresult,
            odd,
            gate,
            slow_first,
            charge,
            barrier,
        )
    }
