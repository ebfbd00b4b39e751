"""How a store URL is shown: the hosts of a multi-host URL as written, secrets masked."""

from __future__ import annotations

from sqlalchemy.engine import make_url

from celery_lease.store._db import safe_url


def test_the_hosts_of_a_multi_host_url_are_shown_as_written() -> None:
    for url in (
        "postgresql+psycopg://app:Pw-4417@/app?host=db1:5432&host=db2:5433"
        "&target_session_attrs=read-write",
        "postgresql+psycopg://app:Pw-4417@/app?host=db1,db2&port=5432,5433"
        "&target_session_attrs=read-write",
    ):
        shown = safe_url(url)
        assert shown == url.replace("Pw-4417", "***"), shown
        assert make_url(shown).query == make_url(url).query


def test_other_parameters_stay_encoded_and_secrets_masked() -> None:
    shown = safe_url("postgresql://u@h/d?application_name=a%3Ab&host=h1:1&password=Pw-4417")
    assert shown == "postgresql://u@h/d?application_name=a%3Ab&host=h1:1&password=***", shown
