"""A producer under load in a process of its own (crash matrix row 31, the failover).

``python -m tests.crash.producer MODULE TASK OUT STOP`` imports the project module
``MODULE`` and submits ``TASK(key)`` with keys ``p0``, ``p1``, ... one after the other
until the file ``STOP`` exists. A submission the store refuses
(:class:`~celery_lease.CeleryLeaseError`: the database unreachable, its outcome
unknown) is tried again with the same task id, as the docs tell a producer to: a row
already written answers the retry as a duplicate, so the task runs once either way.
Each acknowledged submission is one JSON line in ``OUT``: key, task id, when it was
first tried and when it was acknowledged (``time.time()``), and the tries that failed;
each refused try is a line too (``refused``: the key, the error's class, when).
"""

from __future__ import annotations

import importlib
import json
import sys
import time
import uuid
from pathlib import Path

from celery_lease import CeleryLeaseError

#: Seconds between two submissions (the load: at most ~30 a second, enough to have
#: submissions, claims and outcomes in flight whenever the database is lost).
PACE = 0.03
#: Seconds between two tries of a refused submission.
RETRY_PAUSE = 0.05


def main(argv: list[str]) -> int:
    module_name, task_name, out, stop = argv
    module = importlib.import_module(module_name)
    task = module.app.tasks[task_name]
    stop_file = Path(stop)
    with open(out, "a", encoding="utf-8") as log:
        index = 0
        while not stop_file.exists():
            key = f"p{index}"
            task_id = str(uuid.uuid4())
            first = time.time()
            failed: list[str] = []
            while True:
                try:
                    task.apply_async((key,), task_id=task_id)
                    break
                except CeleryLeaseError as error:
                    failed.append(type(error).__name__)
                    refused = {"refused": key, "error": failed[-1], "at": time.time()}
                    log.write(json.dumps(refused) + "\n")
                    log.flush()
                    time.sleep(RETRY_PAUSE)
            line = {"key": key, "id": task_id, "first": first, "acked": time.time()}
            line["failed"] = failed  # type: ignore[assignment]
            log.write(json.dumps(line) + "\n")
            log.flush()
            index += 1
            time.sleep(PACE)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
