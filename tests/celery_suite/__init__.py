"""Celery's own integration suite with every task leased (``scripts/celery_suite.py``).

This module holds the two lists the comparison is judged by, reviewed like code:

* :data:`REVIEWED`: the tests that cannot give the same outcome leased, by design,
  each with its reason. A test that passes plain and fails leased and is not here is
  a defect of celery-lease until shown otherwise. The list stays short.
* :data:`CI_SUBSET`: the tests CI runs (the whole suite takes about 20 minutes plain):
  at least one per area where a leased run differed, plus a few plain canvas shapes.
"""

from __future__ import annotations

#: The suite's files the script runs by default (Celery's canvas, tasks and inspect
#: tests: every task shape and the worker's remote control).
SUITE_FILES = (
    "t/integration/test_canvas.py",
    "t/integration/test_tasks.py",
    "t/integration/test_inspect.py",
)

#: Test id (as ``scripts/celery_suite.py`` prints it) -> why its outcome differs by design.
REVIEWED: dict[str, str] = {
    "t/integration/test_tasks.py::test_tasks::test_task_retried_priority": (
        "passes alone, plain and leased, on both stores (a retry keeps priority 7: "
        "tests/integration/test_retry_priority.py). In the whole file it waits behind an "
        "earlier test's canvases (test_revoked_by_headers_complex_canvas, which fails plain "
        "too): the suite's Manager purges the broker between tests, which ends a plain task "
        "for good, while a leased task's row is still PENDING and its message, lost to the "
        "lease, is published again by the reaper after lease_republish_after (60 s). That "
        "backlog of sleeping(2) tasks reaches the queue as this test runs, and Redis serves "
        "the queue's own list before its priority-7 list, so the result does not come within "
        "the test's 10 s. A purge does not cancel a leased task, by design: the row, not the "
        "broker, holds the task (docs/what-stays-the-same.md)."
    ),
    "t/integration/test_canvas.py::test_chain::"
    "test_chord_header_id_duplicated_on_rabbitmq_msg_duplication[redis-group-ids]": (
        "RabbitMQ only (an expected failure on Redis, plain and leased). The test publishes "
        "the chain's first task a second time, as a broker that duplicates a message "
        "would, and expects the chain, chord header included, to run twice. A leased task "
        "runs once per task id: the second copy is dropped at claim (crash-point matrix "
        "row 15), so the header runs once and the test's list holds one group id, not two."
    ),
}

#: Test ids CI runs, plain and leased (pytest node ids inside the unpacked sdist). The
#: first four and the last five failed leased before their fix (measured with the script).
CI_SUBSET = (
    # arguments Celery's JSON serializer accepts: pydantic models passed by the caller
    "t/integration/test_tasks.py::test_tasks::test_pydantic_model_arguments",
    # a group whose app is the current_app proxy: led by an empty chain, or rebuilt
    # from a deserialised chain
    "t/integration/test_canvas.py::test_group::test_group_with_empty_chain_members",
    "t/integration/test_canvas.py::test_chain::test_chain_with_a_deserialised_chain_led_by_a_group",
    # a group containing a chord (the batch's producer given back to the pool)
    "t/integration/test_canvas.py::test_chain::test_header_failure_fails_the_chords_after_a_group_body",
    # plain shapes around them: chords in a chain, a group body's link, a rebuilt chord
    "t/integration/test_canvas.py::test_chain::test_chain_of_chords_with_two_tasks",
    "t/integration/test_canvas.py::test_chord::test_link_option_on_group_body_runs_once",
    "t/integration/test_canvas.py::test_signature_serialization::test_rebuild_nested_group_chord",
    # Task.replace(): the replacement runs under the replaced task's id
    "t/integration/test_canvas.py::test_chain::test_second_order_replace",
    "t/integration/test_canvas.py::test_chain::test_chain_with_cb_replaced_with_chain_with_cb",
    # a task id sent again after it finished runs again (a frozen chord applied twice)
    "t/integration/test_canvas.py::test_chord::test_reapplying_frozen_chord_dispatches_body_again",
    # a generator chord header is streamed member by member
    "t/integration/test_canvas.py::test_chord::test_generator[3]",
    # what Celery refuses while building a message (arguments that do not fit the
    # task's signature) is raised as Celery raises it
    "t/integration/test_tasks.py::test_tasks::test_wrong_arguments",
    # a chord in a group body: its errback runs once
    "t/integration/test_canvas.py::test_chord::test_link_error_option_runs_once_for_chord_in_group_body_with_link_error",
    # a retry keeps the priority the task was sent with (alone it passes leased; the
    # whole file's outcome is in REVIEWED)
    "t/integration/test_tasks.py::test_tasks::test_task_retried_priority",
)
