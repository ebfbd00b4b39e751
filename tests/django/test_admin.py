"""The Django admin of leased tasks, through Django's test client on PostgreSQL.

Actions go through the operator API: each test checks the row, the audit trail
(actor = the Django user, reason) and what the page said.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.postgres

CHANGELIST = "/admin/celery_lease/task/"
ALL_PERMS = ("view_task", "retry_task", "fail_task", "resolve_task", "cancel_task")


def change_url(task_id: str) -> str:
    from django.contrib.admin.utils import quote

    return f"{CHANGELIST}{quote(task_id)}/change/"


def action_url(task_id: str, action: str) -> str:
    from django.contrib.admin.utils import quote

    return f"{CHANGELIST}{quote(task_id)}/lease/{action}/"


def page_messages(response: Any) -> list[tuple[str, str]]:
    """(level tag, text) of the messages the response carries or rendered."""
    from django.contrib.messages import get_messages

    return [(m.level_tag, str(m)) for m in get_messages(response.wsgi_request)]


def changelist_action(client: Any, action: str, ids: list[str], **form: str) -> Any:
    """Choose ``action`` for ``ids`` on the changelist, then confirm with ``form``."""
    first = client.post(
        CHANGELIST,
        {"action": f"lease_{action}", "_selected_action": ids, "index": "0"},
    )
    assert first.status_code == 200, first
    assert b'name="lease_confirm"' in first.content
    return client.post(
        CHANGELIST,
        {"action": f"lease_{action}", "_selected_action": ids, "lease_confirm": "yes", **form},
        follow=True,
    )


# -- list, filters, search ----------------------------------------------------------------


def test_changelist_lists_tasks_with_state_and_worker(lease: Any, make_user: Any, client_for: Any):
    running = lease.make("RUNNING", nodename="alpha@host")
    manual = lease.make("WAIT_MANUAL", nodename="beta@host")
    pending = lease.make("PENDING")
    client = client_for(make_user("viewer", "view_task"))

    response = client.get(CHANGELIST)

    assert response.status_code == 200
    body = response.content.decode()
    for task_id in (running, manual, pending):
        assert task_id in body
    assert "WAIT_MANUAL" in body and "RUNNING" in body
    assert "alpha@host" in body and "beta@host" in body
    assert "outcome of step" in body  # the reason column


def test_user_without_view_permission_is_refused(lease: Any, make_user: Any, client_for: Any):
    lease.make("PENDING")
    client = client_for(make_user("nobody"))
    assert client.get(CHANGELIST).status_code == 403


def listed_ids(response: Any) -> set[str]:
    return {str(task.pk) for task in response.context["cl"].result_list}


def test_filters_by_state_name_and_worker(lease: Any, make_user: Any, client_for: Any):
    a = lease.make("WAIT_MANUAL", name="proj.tasks.charge", nodename="alpha@host")
    b = lease.make("RUNNING", name="proj.tasks.charge", nodename="beta@host")
    c = lease.make("SUCCEEDED", name="proj.tasks.email", nodename="alpha@host")
    d = lease.make("PENDING", name="proj.tasks.email")
    client = client_for(make_user("viewer", "view_task"))

    assert listed_ids(client.get(CHANGELIST)) == {a, b, c, d}
    assert listed_ids(client.get(CHANGELIST, {"state__exact": "WAIT_MANUAL"})) == {a}
    assert listed_ids(client.get(CHANGELIST, {"name": "proj.tasks.email"})) == {c, d}
    assert listed_ids(client.get(CHANGELIST, {"worker": "alpha@host"})) == {a, c}
    assert listed_ids(
        client.get(CHANGELIST, {"worker": "beta@host", "state__exact": "RUNNING"})
    ) == {b}
    # the filter sidebar offers the worker node names
    body = client.get(CHANGELIST).content.decode()
    assert "?worker=alpha%40host" in body and "?worker=beta%40host" in body


def test_search_by_id_and_dedup_key(lease: Any, make_user: Any, client_for: Any):
    a = lease.make("PENDING", dedup_key="order-17", task_id="7f3a9c1e-0001")
    b = lease.make("PENDING", dedup_key="order-18", task_id="b04d2e6f-0002")
    client = client_for(make_user("viewer", "view_task"))

    assert listed_ids(client.get(CHANGELIST, {"q": a})) == {a}
    assert listed_ids(client.get(CHANGELIST, {"q": "b04d2e"})) == {b}  # the start of an id
    assert listed_ids(client.get(CHANGELIST, {"q": "order-18"})) == {b}
    assert listed_ids(client.get(CHANGELIST, {"q": "order-1"})) == set()


def test_detail_shows_audit_trail_and_steps(lease: Any, make_user: Any, client_for: Any):
    task_id = lease.make("WAIT_MANUAL", nodename="alpha@host")
    client = client_for(make_user("viewer", "view_task"))

    response = client.get(change_url(task_id))

    assert response.status_code == 200
    body = response.content.decode()
    trail = lease.trail(task_id)
    assert [t.to_state.value for t in trail] == ["PENDING", "RUNNING", "TIMEOUT", "WAIT_MANUAL"]
    inline = next(
        f
        for f in response.context["inline_admin_formsets"]
        if f.opts.model.__name__ == "Transition"
    )
    assert len(list(inline)) == len(trail)
    for row in trail:
        assert row.actor in body
    assert "reaper:lease-test" in body
    steps = next(
        f for f in response.context["inline_admin_formsets"] if f.opts.model.__name__ == "Step"
    )
    assert len(list(steps)) == 2
    assert "reserve stock" in body and "charge card" in body
    assert "outcome of step &#x27;charge card&#x27; unknown" in body
    # read-only: no save button, no editable inputs for the task
    assert 'name="_save"' not in body
    # a viewer sees no action buttons
    assert "/lease/retry/" not in body


def test_detail_offers_the_actions_the_user_may_take(lease: Any, make_user: Any, client_for: Any):
    manual = lease.make("WAIT_MANUAL")
    done = lease.make("SUCCEEDED")
    client = client_for(make_user("operator", "view_task", "retry_task", "cancel_task"))

    body = client.get(change_url(manual)).content.decode()
    assert action_url(manual, "retry") in body and action_url(manual, "cancel") in body
    assert action_url(manual, "fail") not in body  # no permission
    body = client.get(change_url(done)).content.decode()
    assert "/lease/" not in body  # nothing applies to a SUCCEEDED task


def test_workers_list_shows_liveness(lease: Any, make_user: Any, client_for: Any):
    lease.make("RUNNING", nodename="alpha@host")
    client = client_for(make_user("admin", superuser=True))
    response = client.get("/admin/celery_lease/worker/")
    assert response.status_code == 200
    body = response.content.decode()
    assert "alpha@host" in body
    assert 'alt="True"' in body  # alive, judged by the store


# -- actions ------------------------------------------------------------------------------

#: action -> (a state it applies to, the confirmation form, the state it leads to)
ACTION_CASES = {
    "retry": ("WAIT_MANUAL", {"reason": "card provider says no charge happened"}, "PENDING"),
    "fail": ("WAIT_MANUAL", {"reason": "customer cancelled the order"}, "FAILED"),
    "resolve": (
        "WAIT_MANUAL",
        {"reason": "charged by hand in the provider's console", "result": '{"charge": "ch_1"}'},
        "SUCCEEDED",
    ),
    "cancel": ("PENDING", {"reason": "duplicate order"}, "CANCELLED"),
}


def assert_acted(lease: Any, task_id: str, before: int, *, to: str, actor: str, reason: str):
    trail = lease.trail(task_id)
    assert lease.state(task_id) == to
    assert len(trail) == before + 1
    assert trail[-1].to_state.value == to
    assert trail[-1].actor == actor
    assert trail[-1].reason == reason


@pytest.mark.parametrize("action", sorted(ACTION_CASES))
def test_changelist_action_with_permission(
    action: str, lease: Any, make_user: Any, client_for: Any
):
    start, form, to = ACTION_CASES[action]
    task_id = lease.make(start)
    before = len(lease.trail(task_id))
    client = client_for(make_user("olivia", "view_task", f"{action}_task"))

    response = changelist_action(client, action, [task_id], **form)

    assert response.status_code == 200
    assert_acted(lease, task_id, before, to=to, actor="olivia", reason=form["reason"])
    assert any(level == "success" and task_id in text for level, text in page_messages(response))
    if action == "resolve":
        record = lease.store.get(task_id)
        assert record.result == {"charge": "ch_1"}


@pytest.mark.parametrize("action", sorted(ACTION_CASES))
def test_detail_action_with_permission(action: str, lease: Any, make_user: Any, client_for: Any):
    start, form, to = ACTION_CASES[action]
    task_id = lease.make(start)
    before = len(lease.trail(task_id))
    client = client_for(make_user("olivia", "view_task", f"{action}_task"))

    page = client.get(action_url(task_id, action))
    assert page.status_code == 200 and b'name="lease_confirm"' in page.content
    response = client.post(action_url(task_id, action), {"lease_confirm": "yes", **form})

    assert response.status_code == 302 and response["Location"] == change_url(task_id)
    assert_acted(lease, task_id, before, to=to, actor="olivia", reason=form["reason"])


@pytest.mark.parametrize("action", sorted(ACTION_CASES))
def test_action_without_permission_changes_nothing(
    action: str, lease: Any, make_user: Any, client_for: Any
):
    start, form, _ = ACTION_CASES[action]
    task_id = lease.make(start)
    before = lease.trail(task_id)
    others = [p for p in ALL_PERMS if p != f"{action}_task"]
    client = client_for(make_user("victor", *others))

    # not offered on the changelist ...
    choices = dict(client.get(CHANGELIST).context["action_form"].fields["action"].choices)
    assert f"lease_{action}" not in choices
    # ... and refused when posted anyway
    response = client.post(
        CHANGELIST,
        {
            "action": f"lease_{action}",
            "_selected_action": [task_id],
            "lease_confirm": "yes",
            **form,
        },
        follow=True,
    )
    assert ("warning", "No action selected.") in page_messages(response)
    # the detail page's action URL answers 403
    assert client.get(action_url(task_id, action)).status_code == 403
    assert (
        client.post(action_url(task_id, action), {"lease_confirm": "yes", **form}).status_code
        == 403
    )

    assert lease.state(task_id) == start
    assert lease.trail(task_id) == before


def test_retry_republishes_the_message(
    lease: Any, make_user: Any, client_for: Any, django_project: Any
):
    task_id = lease.make("WAIT_MANUAL")
    client = client_for(make_user("olivia", "view_task", "retry_task"))
    queue = django_project.conf.task_default_queue
    with django_project.connection_for_read() as conn:
        simple = conn.SimpleQueue(queue)
        simple.clear()

        changelist_action(client, "retry", [task_id], reason="")

        message = simple.get(timeout=10)
        message.ack()
        simple.close()
    assert message.headers["id"] == task_id
    assert message.headers["task"] == "proj.tasks.charge"
    record = lease.store.get(task_id)
    assert record.state.value == "PENDING" and record.published_at is not None
    # completed steps are kept (the re-run resumes); the one with an unknown outcome goes
    assert [s.name for s in lease.store.steps(task_id)] == ["reserve stock"]
    # an empty reason gets the operator API's default, naming the user
    assert lease.trail(task_id)[-1].reason == "retried by olivia"


def test_cancel_running_task_requests_a_cooperative_stop(
    lease: Any, make_user: Any, client_for: Any
):
    task_id = lease.make("RUNNING")
    before = lease.trail(task_id)
    client = client_for(make_user("olivia", "view_task", "cancel_task"))

    response = changelist_action(client, "cancel", [task_id], reason="stop it")

    record = lease.store.get(task_id)
    assert record.state.value == "RUNNING"
    assert record.cancel_requested_at is not None
    assert (record.cancel_actor, record.cancel_reason) == ("olivia", "stop it")
    assert lease.trail(task_id) == before  # no transition until the task stops
    assert any("next step boundary" in text for _, text in page_messages(response))


@pytest.mark.parametrize(
    ("action", "state"),
    [
        ("resolve", "PENDING"),
        ("resolve", "RUNNING"),
        ("retry", "SUCCEEDED"),
        ("fail", "FAILED"),
        ("cancel", "SUCCEEDED"),
        ("retry", "RETRY_WAIT"),
    ],
)
def test_illegal_action_shows_an_error_and_changes_nothing(
    action: str, state: str, lease: Any, make_user: Any, client_for: Any
):
    task_id = lease.make(state)
    before = lease.trail(task_id)
    record_before = lease.store.get(task_id)
    client = client_for(make_user("olivia", *ALL_PERMS))
    form = dict(ACTION_CASES[action][1])

    response = changelist_action(client, action, [task_id], **form)

    errors = [text for level, text in page_messages(response) if level == "error"]
    assert len(errors) == 1, page_messages(response)
    assert (
        task_id in errors[0]
        and f"it is {state}" in errors[0]
        and "Nothing was changed" in errors[0]
    )
    assert not any(level == "success" for level, _ in page_messages(response))
    assert lease.trail(task_id) == before
    assert lease.store.get(task_id) == record_before


def test_mixed_selection_acts_on_legal_tasks_and_reports_the_rest(
    lease: Any, make_user: Any, client_for: Any
):
    manual = lease.make("WAIT_MANUAL")
    done = lease.make("SUCCEEDED")
    client = client_for(make_user("olivia", "view_task", "fail_task"))

    response = changelist_action(client, "fail", [manual, done], reason="given up")

    assert lease.state(manual) == "FAILED"
    assert lease.state(done) == "SUCCEEDED"
    msgs = page_messages(response)
    assert any(level == "success" and manual in text for level, text in msgs)
    assert any(level == "error" and done in text for level, text in msgs)


def test_reason_required_for_fail_and_resolve(lease: Any, make_user: Any, client_for: Any):
    task_id = lease.make("WAIT_MANUAL")
    before = lease.trail(task_id)
    client = client_for(make_user("olivia", *ALL_PERMS))

    for action in ("fail", "resolve"):
        response = client.post(action_url(task_id, action), {"lease_confirm": "yes", "reason": ""})
        assert response.status_code == 200  # the form again, with its error
        assert response.context["form"].errors["reason"]
    response = client.post(
        action_url(task_id, "resolve"),
        {"lease_confirm": "yes", "reason": "by hand", "result": "{not json"},
    )
    assert "not valid JSON" in str(response.context["form"].errors["result"])
    assert lease.trail(task_id) == before


def test_action_on_a_task_that_no_longer_exists(lease: Any, make_user: Any, client_for: Any):
    client = client_for(make_user("olivia", *ALL_PERMS))
    response = client.post(
        action_url("no-such-task", "retry"), {"lease_confirm": "yes"}, follow=True
    )
    assert response.status_code == 200
    # Django's own "... with ID "no-such-task" doesn't exist" warning; nothing to act on
    assert any("no-such-task" in text for level, text in page_messages(response)), page_messages(
        response
    )
    assert not any(level == "success" for level, _ in page_messages(response))
