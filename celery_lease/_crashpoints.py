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
"""

from __future__ import annotations

import os

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
