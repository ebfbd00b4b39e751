"""The pauses page and the pause history in the Django admin, through Django's test
client on PostgreSQL: pausing and resuming go through the operator API, so each test
checks the store's pauses and their audit log (actor = the Django user, reason)."""

from __future__ import annotations

from typing import Any

import pytest

from .test_admin import page_messages

pytestmark = pytest.mark.postgres

PAUSES = "/admin/celery_lease/pause/"
HISTORY = "/admin/celery_lease/pauseevent/"
OPERATOR = ("view_pause", "view_pauseevent", "pause_task", "resume_task")


def pause(client: Any, kind: str, target: str, reason: str) -> Any:
    return client.post(PAUSES, {"op": "pause", "kind": kind, "target": target, "reason": reason})


def resume(client: Any, kind: str, target: str, reason: str) -> Any:
    return client.post(PAUSES, {"op": "resume", "kind": kind, "target": target, "reason": reason})


def test_pauses_page_lists_current_pauses_with_who_why_and_when(
    lease: Any, make_user: Any, client_for: Any, django_project: Any
):
    from celery_lease import admin as operator_api

    api = operator_api(django_project)
    api.pause(queue="exports", reason="partner API down (INC-4711)", actor="alice")
    api.pause(task="proj.tasks.email", reason="mail relay broken", actor="bob")
    client = client_for(make_user("viewer", "view_pause"))

    response = client.get(PAUSES)

    assert response.status_code == 200
    shown = [(p.kind, p.target, p.actor, p.reason) for p, _ in response.context["pauses"]]
    assert shown == [
        ("queue", "exports", "alice", "partner API down (INC-4711)"),
        ("task", "proj.tasks.email", "bob", "mail relay broken"),
    ]
    body = response.content.decode()
    assert "partner API down (INC-4711)" in body and "alice" in body
    since = response.context["pauses"][0][1]
    assert since in body  # when, to the millisecond, with the zone
    # the history is on the page too
    assert [(e.action, e.target) for e, _ in response.context["history"]] == [
        ("pause", "proj.tasks.email"),
        ("pause", "exports"),
    ]
    # a viewer may not pause or resume: no form, no buttons
    assert 'value="pause"' not in body and 'value="resume"' not in body
    assert "Nothing is paused" not in body


def test_pause_records_the_user_and_reason(lease: Any, make_user: Any, client_for: Any):
    client = client_for(make_user("olivia", *OPERATOR))

    response = pause(client, "task", "proj.tasks.charge", "  card provider down  ")

    assert response.status_code == 302 and response["Location"] == PAUSES
    [found] = lease.store.pauses()
    assert (found.kind, found.target, found.actor, found.reason) == (
        "task",
        "proj.tasks.charge",
        "olivia",
        "card provider down",
    )
    [event] = lease.store.pause_history()
    assert (event.action, event.kind, event.target, event.actor, event.reason) == (
        "pause",
        "task",
        "proj.tasks.charge",
        "olivia",
        "card provider down",
    )
    page = client.get(PAUSES)
    assert any(
        level == "success" and "Task name proj.tasks.charge paused" in text
        for level, text in page_messages(page)
    )
    # pausing it again changes nothing and says so
    again = pause(client, "task", "proj.tasks.charge", "again")
    assert again.status_code == 302
    assert len(lease.store.pause_history()) == 1
    assert any("already paused" in text for _, text in page_messages(client.get(PAUSES)))


def test_resume_records_the_user_and_reason(
    lease: Any, make_user: Any, client_for: Any, django_project: Any
):
    from celery_lease import admin as operator_api

    operator_api(django_project).pause(queue="exports", reason="incident", actor="alice")
    client = client_for(make_user("olivia", *OPERATOR))
    body = client.get(PAUSES).content.decode()
    assert 'name="op" value="resume"' in body  # a resume button for the pause

    response = resume(client, "queue", "exports", "partner API back")

    assert response.status_code == 302
    assert lease.store.pauses() == []
    latest = lease.store.pause_history()[0]
    assert (latest.action, latest.kind, latest.target, latest.actor, latest.reason) == (
        "resume",
        "queue",
        "exports",
        "olivia",
        "partner API back",
    )
    page = client.get(PAUSES)
    assert "Nothing is paused" in page.content.decode()
    assert any(
        level == "success" and "Queue exports resumed" in t for level, t in page_messages(page)
    )
    # resuming what is not paused changes nothing and says so
    resume(client, "queue", "exports", "again")
    assert len(lease.store.pause_history()) == 2
    assert any("was not paused" in text for _, text in page_messages(client.get(PAUSES)))


def test_pause_and_resume_need_a_reason(
    lease: Any, make_user: Any, client_for: Any, django_project: Any
):
    client = client_for(make_user("olivia", *OPERATOR))

    response = pause(client, "queue", "exports", "   ")
    assert response.status_code == 200  # the form again, with its error
    assert response.context["form"].errors["reason"]
    assert lease.store.pauses() == [] and lease.store.pause_history() == []

    from celery_lease import admin as operator_api

    operator_api(django_project).pause(queue="exports", reason="incident", actor="alice")
    response = resume(client, "queue", "exports", "")
    assert any(level == "error" and "Not resumed" in t for level, t in page_messages(response))
    assert [p.target for p in lease.store.pauses()] == ["exports"]
    assert len(lease.store.pause_history()) == 1


def test_pause_and_resume_need_their_permissions(
    lease: Any, make_user: Any, client_for: Any, django_project: Any
):
    from celery_lease import admin as operator_api

    operator_api(django_project).pause(queue="exports", reason="incident", actor="alice")
    before = lease.store.pause_history()
    viewer = client_for(make_user("viewer", "view_pause"))
    assert pause(viewer, "task", "proj.tasks.charge", "why").status_code == 403
    assert resume(viewer, "queue", "exports", "why").status_code == 403

    pauser = client_for(make_user("pauser", "view_pause", "pause_task"))
    body = pauser.get(PAUSES).content.decode()
    assert 'value="pause"' in body and 'value="resume"' not in body
    assert resume(pauser, "queue", "exports", "why").status_code == 403

    # pausing needs to see the page, too
    blind = client_for(make_user("blind", "pause_task", "resume_task"))
    assert blind.get(PAUSES).status_code == 403
    assert pause(blind, "task", "proj.tasks.charge", "why").status_code == 403

    assert [p.target for p in lease.store.pauses()] == ["exports"]
    assert lease.store.pause_history() == before


def test_pause_history_lists_every_pause_and_resume(lease: Any, make_user: Any, client_for: Any):
    client = client_for(make_user("olivia", *OPERATOR))
    pause(client, "queue", "exports", "partner API down")
    resume(client, "queue", "exports", "partner API back")
    pause(client, "task", "proj.tasks.email", "relay down")

    response = client.get(HISTORY)

    assert response.status_code == 200
    listed = [(e.action, e.kind, e.target, e.actor) for e in response.context["cl"].result_list]
    assert listed == [
        ("pause", "task", "proj.tasks.email", "olivia"),
        ("resume", "queue", "exports", "olivia"),
        ("pause", "queue", "exports", "olivia"),
    ]
    body = response.content.decode()
    assert "partner API back" in body and "relay down" in body
    resumed = client.get(HISTORY, {"action__exact": "resume"}).context["cl"].result_list
    assert [e.reason for e in resumed] == ["partner API back"]
    # read-only: nothing to add, and no history without its permission
    assert client.get(f"{HISTORY}add/").status_code == 403
    other = client_for(make_user("viewer", "view_pause"))
    assert other.get(HISTORY).status_code == 403
    # the pauses page links to it for whoever may see it
    assert HISTORY in client.get(PAUSES).content.decode()
