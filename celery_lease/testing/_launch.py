"""``python -m celery_lease.testing._launch -A app worker ...``: ``celery`` for the kit.

Takes the same arguments as ``celery``. Before Celery starts, it applies the settings
of ``CELERY_LEASE_TESTING_CONF`` (a JSON object) to the app, so the worker uses the
test's store, broker and queue whatever the project's own configuration says, and it
connects two signal handlers that record, in ``CELERY_LEASE_TESTING_RUNNING``, which
pool process runs which task (``LeaseWorker.kill_task`` reads them).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any

from celery import signals

from ._procs import CONF_ENV, RUNNING_ENV


def _running_path(task_id: Any) -> str | None:
    directory = os.environ.get(RUNNING_ENV)
    if not directory or not isinstance(task_id, str) or "/" in task_id:
        return None
    return os.path.join(directory, task_id)


def _prerun(task_id: Any = None, **_: Any) -> None:
    path = _running_path(task_id)
    if path is not None:
        # written whole, then renamed: a reader never sees half a pid
        with open(path + ".tmp", "w") as fh:
            fh.write(str(os.getpid()))
        os.replace(path + ".tmp", path)


def _postrun(task_id: Any = None, **_: Any) -> None:
    path = _running_path(task_id)
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def main(argv: list[str] | None = None) -> None:
    """Apply the test's settings to the app named by ``-A``, then run ``celery``."""
    from celery.app.utils import find_app
    from celery.bin.celery import main as celery_main

    from .._runtime import runtime

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        name = args[args.index("-A") + 1]
    except (ValueError, IndexError):
        raise SystemExit(
            "usage: python -m celery_lease.testing._launch -A APP worker ..."
        ) from None
    app = find_app(name)
    app.conf.update(json.loads(os.environ.get(CONF_ENV) or "{}"))
    runtime(app).reset()
    signals.task_prerun.connect(_prerun, weak=False)
    signals.task_postrun.connect(_postrun, weak=False)
    sys.argv = ["celery", *args]
    celery_main()


if __name__ == "__main__":
    main()
