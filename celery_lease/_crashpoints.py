"""Named crash points for the crash suite: inert unless an environment variable names them.

``crash_point("after_insert")`` does nothing in normal operation. When the process
runs with ``CELERY_LEASE_CRASH_AT=after_insert`` it ends at once with
``os._exit(137)`` (the exit status of a SIGKILL as a shell reports it): no
``finally`` blocks, no ``atexit`` handlers, no flushing, exactly like a process the
kernel killed at that line. The crash suite uses it to stop a producer or a reaper
between two writes that no signal sent from outside could reliably separate.

Points (where they are called):

* ``after_insert``: ``LeasedTask.apply_async``, the row is committed, nothing published.
* ``after_publish``: ``LeasedTask._publish``, the message is published, the row is not
  yet marked published.
* ``reaper_mid_sweep``: ``Reaper.sweep``, between two full batches of one sweep.
* ``reaper_took_held``: ``Reaper.publish_held``, a batch of held rows taken (no longer
  held, reserved for publishing), none of them published yet.
* ``beat_slot_rows``: ``celery_lease.beat``, the transaction that decided a leased
  entry's slots committed its tasks' rows, none of them published yet.
* ``outcome_buffered``: the worker's outcome writer (its main process) has read an
  outcome a pool process handed over and not written it yet: the whole worker dies
  with the outcome buffered.
* ``before_follow_ups``: a pool process wrote a task's SUCCEEDED outcome with its
  follow-ups recorded (chain, ``link`` callbacks, chord part-return) and has published
  none of them: :func:`worker_crash_point` ends the whole worker (its main process
  first), as a node lost at that line.
* ``after_retry_recorded``: a retry's row is PENDING with its message, and the message
  is not published yet: in the worker's outcome writer (a retry handed over by a pool
  process), or in the pool process that wrote it itself (``LeasedTask._publish_retry``).

Points aimed at one task's steps (:func:`step_crash_point`), armed by the testing kit
(:mod:`celery_lease.testing`) rather than named by the environment, each fires once:

* ``before_step``: ``Execution.step``, a step about to run (nothing of it recorded).
* ``after_step``: ``Execution.step``, the step's function returned, its result is not
  yet recorded.
* ``before_outcome``: ``LeasedTask._run``, the task's function returned, its outcome is
  not yet written.

A test arms one by creating a file in the directory ``CELERY_LEASE_CRASH_DIR`` names
(see :func:`armed_name`); the first process to reach the point renames the file (so it
fires once, in one process) and exits. Without the variable a call costs one lookup
in ``os.environ``: these points sit on every step's path.
"""

from __future__ import annotations

import hashlib
import os
import signal

#: The environment variable naming the one crash point to fire in this process.
ENV = "CELERY_LEASE_CRASH_AT"

#: Exit status of a fired crash point (128 + SIGKILL).
EXIT_STATUS = 137


def crash_point(name: str) -> None:
    """End the process at once if ``CELERY_LEASE_CRASH_AT`` equals ``name``.

    Read on every call (not cached at import) so that a test can set the variable for
    a subprocess it starts, or in a process after the module was imported.
    """
    if os.environ.get(ENV) == name:
        os._exit(EXIT_STATUS)


def worker_crash_point(name: str, worker_pid: int) -> None:
    """:func:`crash_point` that ends the whole worker: in a pool process, its worker's
    main process (``worker_pid``) is SIGKILLed first, then this process ends."""
    if os.environ.get(ENV) == name:
        if worker_pid != os.getpid():
            os.kill(worker_pid, signal.SIGKILL)
        os._exit(EXIT_STATUS)


#: The environment variable naming the directory of armed step crash points.
ARMED_DIR_ENV = "CELERY_LEASE_CRASH_DIR"

#: The places :func:`step_crash_point` is called from.
STEP_POINTS = ("before_step", "after_step", "before_outcome")


def armed_name(where: str, task: str, step: str | None = None) -> str:
    """The file name that arms ``where`` for ``task`` (and ``step``) in the armed directory.

    A digest, not the names themselves: task and step names may hold any character.
    """
    digest = hashlib.sha256(f"{where}\x00{task}\x00{step or ''}".encode()).hexdigest()[:24]
    return f"{where}-{digest}"


def armed() -> bool:
    """Whether this process may have armed step crash points (the kit started it)."""
    return ARMED_DIR_ENV in os.environ


def step_crash_point(where: str, task: str | None, step: str | None = None) -> None:
    """End the process at once if a test armed ``where`` for ``task``/``step``.

    Fires once: the file that armed it is renamed to ``<name>.fired`` (holding this
    process's pid) by the one process that gets there first.
    """
    directory = os.environ.get(ARMED_DIR_ENV)
    if directory is None or task is None:
        return
    path = os.path.join(directory, armed_name(where, task, step))
    try:
        os.rename(path, path + ".fired")
    except OSError:
        return
    fd = os.open(path + ".fired", os.O_WRONLY | os.O_TRUNC)
    os.write(fd, str(os.getpid()).encode())
    os._exit(EXIT_STATUS)
