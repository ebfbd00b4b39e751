"""Submit one export and follow its row until it finishes (a worker must be running)."""

import sys
import time

from proj import app, export_report

from celery_lease import State, admin

FINAL = {State.SUCCEEDED, State.FAILED, State.WAIT_MANUAL, State.CANCELLED}

user_id = int(sys.argv[1]) if len(sys.argv) > 1 else 1001
# a second submission with the same dedup_key returns the first task, publishes nothing
result = export_report.apply_async((user_id,), dedup_key=f"export:{user_id}:2026-11")
print(f"task {result.id}")

api = admin(app)
deadline = time.monotonic() + 60
record = api.get(result.id)
while record is None or record.state not in FINAL:
    if time.monotonic() > deadline:
        sys.exit("not finished after 60 s: is `celery -A proj worker` running here?")
    time.sleep(0.2)
    record = api.get(result.id)

print(f"state {record.state}, attempt {record.attempt}, result {record.result!r}")
for row in api.history(result.id):
    print(f"  {row.at:%H:%M:%S}  {row.from_state} -> {row.to_state}: {row.reason} ({row.actor})")
for step in api.steps(result.id):
    print(f"  step {step.name}: {step.state}, result {step.result!r}")
