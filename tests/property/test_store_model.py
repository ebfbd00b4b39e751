"""The store against its reference model (see :mod:`tests.property.store_model`), on a
SQLite file and on PostgreSQL, within a bounded example budget; and a rule with a
planted bug (an outcome written without its fence) that the machine must catch.

``CELERY_LEASE_MODEL_PROFILE`` names the Hypothesis profile (default ``model-ci``);
``scripts/model_check.py`` runs the machine for as long as one asks, with a seed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from sqlalchemy import insert, select, update

from celery_lease.states import State
from celery_lease.store import Lease
from celery_lease.store.schema import db_now

from .store_model import Database, StoreMachine, machine_for

_QUIET = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much]

#: CI's budget: about 30 s per store on two shared cores.
settings.register_profile(
    "model-ci",
    max_examples=25,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=_QUIET,
)
#: A longer look, by hand (``scripts/model_check.py`` runs for a given time instead).
settings.register_profile(
    "model-long",
    max_examples=2_000,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=_QUIET,
)
PROFILE = os.environ.get("CELERY_LEASE_MODEL_PROFILE", "model-ci")


@pytest.fixture
def database(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Database]:
    url = str(request.getfixturevalue("pg_url")) if backend == "postgresql" else None
    db = Database(url, tmp_path)
    try:
        yield db
    finally:
        db.close()


def test_the_store_follows_its_model(database: Database) -> None:
    run_state_machine_as_test(
        machine_for(database), settings=settings(settings.get_profile(PROFILE))
    )


class UnfencedOutcome(StoreMachine):
    """The outcome rule with a planted bug: its UPDATE names the task and its state but
    not the execution's attempt and token (with a correct audit row, so the trail alone
    looks legal). A stale execution's late outcome then overwrites the current one's."""

    def _write_outcome(self, lease: Lease, kind: str, batched: bool, delay: float) -> bool:
        if kind == "retry":
            return super()._write_outcome(lease, kind, batched, delay)
        to = {"success": State.SUCCEEDED, "failure": State.FAILED, "cancelled": State.CANCELLED}
        t, tr = self.store.t.tasks, self.store.t.transitions
        with self.store.engine.begin() as conn:
            attempt = conn.execute(
                select(t.c.attempt).where(t.c.id == lease.task_id, t.c.state == "RUNNING")
            ).scalar()
            if attempt is None:
                return False
            conn.execute(
                update(t)
                .where(t.c.id == lease.task_id, t.c.state == "RUNNING")
                .values(state=to[kind].value, finished_at=db_now(), updated_at=db_now())
            )
            conn.execute(
                insert(tr).values(
                    task_id=lease.task_id,
                    from_state="RUNNING",
                    to_state=to[kind].value,
                    reason=kind,
                    actor="w",
                    attempt=attempt,
                    at=db_now(),
                )
            )
        return True


@pytest.mark.violations
def test_the_model_catches_an_unfenced_outcome(database: Database) -> None:
    with pytest.raises(AssertionError, match=r"outcome \w+ answered True, the model says False"):
        run_state_machine_as_test(
            machine_for(database, UnfencedOutcome),
            settings=settings(
                max_examples=300,
                stateful_step_count=30,
                deadline=None,
                derandomize=True,
                database=None,
                phases=[Phase.generate],
                suppress_health_check=_QUIET,
            ),
        )
