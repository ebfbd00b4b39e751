"""celery-lease's crash-testing kit: kill real workers of your own app at chosen points.

The pytest plugin (:mod:`celery_lease.testing.plugin`, registered as ``celery_lease``)
gives each test a store of its own, real ``celery worker`` subprocesses of your app on
it (``lease_worker``), a counter of real side effects (``lease_effects``) and crash
points to arm (``lease_crash``). This package holds what those fixtures return, and
the assertions that read as celery-lease's guarantees. It does not need pytest itself:
task code imports :func:`side_effects` from here.

See docs/testing.md ("Testing your tasks").
"""

from ._assertions import assert_audit_trail, assert_check_clean, assert_finished, assert_steps
from ._crash import CrashPoint, CrashPoints, crash_points
from ._effects import EFFECTS_ENV, Effect, SideEffects, side_effects
from ._matrix import CrashMatrix, CrashRun, assert_crash_safe
from ._polling import wait_until
from ._procs import WorkerProcess, child_pids, group_pids, pid_alive, pid_state
from ._worker import SETTLED, LeaseWorker

__all__ = [
    "EFFECTS_ENV",
    "SETTLED",
    "CrashMatrix",
    "CrashPoint",
    "CrashPoints",
    "CrashRun",
    "Effect",
    "LeaseWorker",
    "SideEffects",
    "WorkerProcess",
    "assert_audit_trail",
    "assert_check_clean",
    "assert_crash_safe",
    "assert_finished",
    "assert_steps",
    "child_pids",
    "crash_points",
    "group_pids",
    "pid_alive",
    "pid_state",
    "side_effects",
    "wait_until",
]
