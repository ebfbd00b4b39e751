"""Submission limits: one set, the same on SQLite and PostgreSQL, checked before anything
is written or published, each refusal a ValueError/TypeError that names the argument.

Before these checks, SQLite stored a 256-character or NUL-containing ``dedup_key`` that
PostgreSQL refused with ``StoreError``, ``eta=12345`` failed as
``StoreError: 'int' object has no attribute 'timestamp'``, and arguments of any size
were stored and published.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from celery_lease import (
    ArgumentsTooLarge,
    CeleryLeaseError,
    InvalidSubmission,
    InvalidSubmissionType,
    InvalidSubmissionValue,
    State,
)

from ..crash.support import LeaseEnv, queue_depth
from ..helpers import wait_until

LIMIT = 2000


#: (apply_async keyword arguments, exception class, argument named, message fragment)
REFUSED: list[tuple[dict[str, Any], type[InvalidSubmission], str, str]] = [
    ({"dedup_key": "k" * 256}, InvalidSubmissionValue, "dedup_key", "256 characters"),
    ({"dedup_key": "a\x00b"}, InvalidSubmissionValue, "dedup_key", "NUL"),
    ({"dedup_key": "\ud800"}, InvalidSubmissionValue, "dedup_key", "Unicode"),
    ({"dedup_key": ""}, InvalidSubmissionValue, "dedup_key", "non-empty"),
    ({"dedup_key": 42}, InvalidSubmissionType, "dedup_key", "must be a string"),
    ({"task_id": "i" * 256}, InvalidSubmissionValue, "task_id", "256 characters"),
    ({"task_id": "a\x00b"}, InvalidSubmissionValue, "task_id", "NUL"),
    ({"eta": 12345}, InvalidSubmissionType, "eta", "countdown="),
    ({"eta": "next tuesday"}, InvalidSubmissionValue, "eta", "ISO 8601"),
    ({"countdown": "5"}, InvalidSubmissionType, "countdown", "number of seconds"),
    ({"countdown": float("inf")}, InvalidSubmissionValue, "countdown", "finite"),
    ({"countdown": True}, InvalidSubmissionType, "countdown", "number of seconds"),
    # past any datetime: a bare OverflowError / ValueError from Celery before
    ({"countdown": 1e12}, InvalidSubmissionValue, "countdown", "ten years"),
    ({"countdown": 10**20}, InvalidSubmissionValue, "countdown", "ten years"),
    ({"countdown": 10**400}, InvalidSubmissionValue, "countdown", "ten years"),
    ({"countdown": -1e12}, InvalidSubmissionValue, "countdown", "ten years"),
]


def test_submissions_outside_the_limits_are_refused_alike_on_every_store(
    lease_env: LeaseEnv, redis_url: str, queue_name: str
) -> None:
    p = lease_env.project(broker_url=redis_url, args_max_bytes=LIMIT)
    work = p.module.app.tasks["t.work"]
    for options, kind, argument, fragment in REFUSED:
        with pytest.raises(kind) as caught:
            work.apply_async(("k",), **options)
        error = caught.value
        assert isinstance(error, CeleryLeaseError)
        assert isinstance(error, ValueError if kind is InvalidSubmissionValue else TypeError)
        assert error.argument == argument, options
        assert argument in str(error) and fragment in str(error), str(error)

    # arguments: args and kwargs together, as the row stores them (compact JSON)
    over = "x" * LIMIT
    with pytest.raises(ArgumentsTooLarge) as too_large:
        work.apply_async((over,))
    assert too_large.value.argument == "args"
    assert too_large.value.limit == LIMIT and too_large.value.size == LIMIT + len('[""]{}')
    assert "lease_args_max_bytes" in str(too_large.value)
    with pytest.raises(ArgumentsTooLarge) as too_large:
        work.apply_async((), {"gate": None, "key": over})
    assert too_large.value.argument == "kwargs"
    # nested deeper than the encoder goes: a RecursionError before
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    for args, kwargs, argument in (((deep,), None, "args"), (("k",), {"gate": deep}, "kwargs")):
        with pytest.raises(InvalidSubmissionValue) as nested:
            work.apply_async(args, kwargs)
        assert nested.value.argument == argument and "nested deeper" in str(nested.value)

    # nothing of the above was written or published
    assert p.store.list_tasks() == []
    assert queue_depth(redis_url, queue_name) == 0

    # the limits themselves are accepted, on both stores, and the tasks run
    edge_key = "é" * 255  # characters, not bytes: PostgreSQL's varchar(255) counts these
    at_limit = "x" * (LIMIT - len('["",null]') - len("{}"))
    accepted = [
        str(work.apply_async(("edge",), dedup_key=edge_key, task_id="i" * 255).id),
        str(work.apply_async((at_limit, None)).id),
        str(work.apply_async(("eta",), eta=datetime.now(timezone.utc) - timedelta(seconds=1)).id),
        str(work.apply_async(("iso",), eta=datetime.now(timezone.utc).isoformat()).id),
        str(work.apply_async(("cd",), countdown=0).id),
    ]
    assert accepted[0] == "i" * 255
    assert p.get(accepted[0]).dedup_key == edge_key
    # the same key again is a duplicate submission, not an error
    assert str(work.apply_async(("again",), dedup_key=edge_key).id) == accepted[0]
    p.worker()
    for task_id in accepted:
        p.wait_state(task_id, State.SUCCEEDED, timeout=60)
    wait_until(lambda: queue_depth(redis_url, queue_name) == 0, message="queue drained")
