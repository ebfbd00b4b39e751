"""Operator actions over all matching tasks ("Select all N" across pages) in the Django
admin: the operator API's bulk action with the list's filters, a dry run first, a
required reason, batched transactions that stop at the first illegal task. Each test
checks the rows and their audit trails in the store."""

from __future__ import annotations

from typing import Any

import pytest

from .test_admin import CHANGELIST, listed_ids, page_messages

pytestmark = pytest.mark.postgres

EXPORT = "proj.tasks.export"


def ask_all_matching(client: Any, action: str, query: str, page_id: str) -> Any:
    """Choose ``action`` with "Select all" on the list filtered by ``query``: the dry run."""
    return client.post(
        f"{CHANGELIST}?{query}",
        {
            "action": f"lease_{action}",
            "_selected_action": [page_id],
            "select_across": "1",
            "index": "0",
        },
    )


def confirm_all_matching(client: Any, action: str, query: str, page_id: str, **form: str) -> Any:
    data = {"limit": "10000", "batch": "100", **form}
    return client.post(
        f"{CHANGELIST}?{query}",
        {
            "action": f"lease_{action}",
            "_selected_action": [page_id],
            "select_across": "1",
            "lease_confirm": "yes",
            **data,
        },
        follow=True,
    )


def test_fail_all_matching_across_pages_after_a_dry_run(
    lease: Any, make_user: Any, client_for: Any
):
    matching = [lease.make("WAIT_MANUAL", name=EXPORT) for _ in range(57)]
    other_name = lease.make("WAIT_MANUAL", name="proj.tasks.charge")
    finished = lease.make("SUCCEEDED", name=EXPORT)
    trails = {t: lease.trail(t) for t in [*matching, other_name, finished]}
    client = client_for(make_user("olivia", "view_task", "fail_task"))
    query = f"name={EXPORT}&state__exact=WAIT_MANUAL"

    listing = client.get(f"{CHANGELIST}?{query}")
    page = sorted(listed_ids(listing))
    assert len(page) == 50  # one page of the 57: "Select all" takes the others too
    dry = ask_all_matching(client, "fail", query, page[0])

    assert dry.status_code == 200
    assert dry.context["count"] == 57 and dry.context["refused"] is None
    body = dry.content.decode()
    assert "Dry run: nothing has changed yet" in body
    assert f"task name {EXPORT}, state WAIT_MANUAL" in body  # the filters, in words
    assert {c.id for c, _, _ in dry.context["changes"]} == set(matching)
    assert all(lease.trail(t) == trails[t] for t in trails)  # a dry run writes nothing

    done = confirm_all_matching(
        client, "fail", query, page[0], reason="export partner gone", batch="20"
    )

    assert done.status_code == 200
    for task_id in matching:
        last = lease.trail(task_id)[-1]
        assert (last.from_state.value, last.to_state.value) == ("WAIT_MANUAL", "FAILED")
        assert (last.actor, last.reason) == ("olivia", "export partner gone")
    for task_id in (other_name, finished):
        assert lease.trail(task_id) == trails[task_id]
    successes = [text for level, text in page_messages(done) if level == "success"]
    assert len(successes) == 1
    assert "Failed 57 tasks" in successes[0] and "in 3 transaction(s)" in successes[0]
    assert not any(level == "error" for level, _ in page_messages(done))


def test_all_matching_stops_cleanly_at_the_first_illegal_task(
    lease: Any, make_user: Any, client_for: Any
):
    # oldest first: two it may fail, one finished, then one more it never reaches
    first = lease.make("WAIT_MANUAL", name=EXPORT)
    second = lease.make("WAIT_MANUAL", name=EXPORT)
    finished = lease.make("SUCCEEDED", name=EXPORT)
    after = lease.make("WAIT_MANUAL", name=EXPORT)
    before = {t: lease.trail(t) for t in (finished, after)}
    client = client_for(make_user("olivia", "view_task", "fail_task"))
    query = f"name={EXPORT}"

    dry = ask_all_matching(client, "fail", query, first)
    assert dry.context["count"] == 2
    refused = dry.context["refused"]
    assert (refused.id, refused.state.value) == (finished, "SUCCEEDED")
    assert "It and the tasks after it would be left as they are" in dry.content.decode()
    assert lease.state(first) == "WAIT_MANUAL"

    done = confirm_all_matching(client, "fail", query, first, reason="given up", batch="1")

    assert [lease.state(t) for t in (first, second, finished, after)] == [
        "FAILED",
        "FAILED",
        "SUCCEEDED",
        "WAIT_MANUAL",
    ]
    assert all(lease.trail(t) == before[t] for t in before)
    msgs = page_messages(done)
    assert any(level == "success" and "Failed 2 tasks" in t for level, t in msgs), msgs
    [error] = [t for level, t in msgs if level == "error"]
    assert f"stopped at task {finished}" in error and "SUCCEEDED" in error
    assert "fail does not apply to a SUCCEEDED task" in error
    assert "left as they are" in error


def test_all_matching_requires_a_reason(lease: Any, make_user: Any, client_for: Any):
    task_id = lease.make("WAIT_MANUAL", name=EXPORT)
    before = lease.trail(task_id)
    client = client_for(make_user("olivia", "view_task", "retry_task"))

    # retry's reason is optional on selected tasks, never over all matching ones
    response = confirm_all_matching(client, "retry", f"name={EXPORT}", task_id, reason=" ")

    assert response.status_code == 200
    assert response.context["form"].errors["reason"]
    assert response.context["count"] == 1  # the dry run again, with the error
    assert lease.trail(task_id) == before


def test_retry_all_matching_by_reason_text(lease: Any, make_user: Any, client_for: Any):
    declined = [lease.make("FAILED") for _ in range(3)]  # "ValueError: card declined"
    manual = lease.make("WAIT_MANUAL")  # "outcome of step 'charge card' unknown ..."
    client = client_for(make_user("olivia", "view_task", "retry_task"))
    query = "reason=card+declined"

    assert listed_ids(client.get(f"{CHANGELIST}?{query}")) == set(declined)
    assert 'name="reason"' in client.get(CHANGELIST).content.decode()  # the text filter
    done = confirm_all_matching(client, "retry", query, declined[0], reason="gateway fixed")

    for task_id in declined:
        record = lease.store.get(task_id)
        assert record.state.value == "PENDING" and record.published_at is not None
        assert lease.trail(task_id)[-1].reason == "gateway fixed"
    assert lease.state(manual) == "WAIT_MANUAL"
    assert any("Retried 3 tasks" in t for _, t in page_messages(done))


def test_cancel_all_matching_running_tasks_asks_them_to_stop(
    lease: Any, make_user: Any, client_for: Any
):
    running = [lease.make("RUNNING", nodename="alpha@host") for _ in range(2)]
    elsewhere = lease.make("RUNNING", nodename="beta@host")
    client = client_for(make_user("olivia", "view_task", "cancel_task"))
    query = "worker=alpha%40host"

    done = confirm_all_matching(client, "cancel", query, running[0], reason="node drained")

    for task_id in running:
        record = lease.store.get(task_id)
        assert record.state.value == "RUNNING" and record.cancel_requested_at is not None
        assert (record.cancel_actor, record.cancel_reason) == ("olivia", "node drained")
    assert lease.store.get(elsewhere).cancel_requested_at is None
    assert any("asked to stop" in t for level, t in page_messages(done) if level == "info")


def test_all_matching_with_nothing_old_enough_changes_nothing(
    lease: Any, make_user: Any, client_for: Any
):
    task_id = lease.make("WAIT_MANUAL")
    before = lease.trail(task_id)
    client = client_for(make_user("olivia", "view_task", "fail_task"))
    query = "older_than=86400&state__exact=WAIT_MANUAL"

    dry = ask_all_matching(client, "fail", query, task_id)
    assert dry.context["count"] == 0 and "No task would change" in dry.content.decode()
    done = confirm_all_matching(client, "fail", query, task_id, reason="too old")

    assert lease.trail(task_id) == before
    assert any(
        level == "warning" and "No task matches" in t and "1 day ago" in t
        for level, t in page_messages(done)
    )


@pytest.mark.parametrize(
    ("query", "said"),
    [
        ("q=order-17", "a search cannot select all matching tasks"),
        ("", "needs at least one filter"),
        ("state__exact=WAIT_MANUAL&attempt__gte=1", "'attempt__gte'"),
    ],
)
def test_all_matching_refuses_what_it_cannot_select_by(
    query: str, said: str, lease: Any, make_user: Any, client_for: Any
):
    task_id = lease.make("WAIT_MANUAL", dedup_key="order-17")
    before = lease.trail(task_id)
    client = client_for(make_user("olivia", "view_task", "fail_task"))

    response = confirm_all_matching(client, "fail", query, task_id, reason="why")

    errors = [t for level, t in page_messages(response) if level == "error"]
    assert len(errors) == 1 and said in errors[0] and "Nothing was changed" in errors[0], errors
    assert lease.trail(task_id) == before


def test_all_matching_keeps_the_permission_checks(lease: Any, make_user: Any, client_for: Any):
    task_id = lease.make("WAIT_MANUAL", name=EXPORT)
    before = lease.trail(task_id)
    client = client_for(make_user("victor", "view_task", "retry_task"))

    response = confirm_all_matching(client, "fail", f"name={EXPORT}", task_id, reason="why")

    assert ("warning", "No action selected.") in page_messages(response)
    assert lease.trail(task_id) == before
