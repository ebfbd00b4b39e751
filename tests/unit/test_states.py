"""The transition table is exactly the design's table, and ``check`` enforces it."""

from __future__ import annotations

import os
import re
from collections import deque
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_lease import states
from celery_lease.exceptions import CeleryLeaseError, IllegalTransition, LeaseError
from celery_lease.states import State

S = State

#: DESIGN.md "States and transitions", transcribed pair by pair (plus row creation).
DESIGN_TABLE: set[tuple[State | None, State]] = {
    (None, S.PENDING),  # a row is created PENDING (submit, or adoption at claim)
    (S.PENDING, S.RUNNING),
    (S.PENDING, S.CANCELLED),
    (S.RETRY_WAIT, S.CANCELLED),
    (S.TIMEOUT, S.CANCELLED),
    (S.WAIT_MANUAL, S.CANCELLED),
    (S.FAILED, S.CANCELLED),
    (S.RUNNING, S.SUCCEEDED),
    (S.RUNNING, S.FAILED),
    (S.RUNNING, S.RETRY_WAIT),
    (S.RUNNING, S.CANCELLED),
    (S.RUNNING, S.TIMEOUT),
    (S.RUNNING, S.WAIT_MANUAL),
    (S.TIMEOUT, S.RETRY_WAIT),
    (S.TIMEOUT, S.WAIT_MANUAL),
    (S.RETRY_WAIT, S.PENDING),
    (S.WAIT_MANUAL, S.PENDING),
    (S.FAILED, S.PENDING),
    (S.TIMEOUT, S.PENDING),
    (S.WAIT_MANUAL, S.FAILED),
    (S.WAIT_MANUAL, S.SUCCEEDED),
}


def _design_md() -> Path | None:
    candidates = [
        os.environ.get("CELERY_LEASE_DESIGN_MD"),
        Path(__file__).resolve().parents[3] / "shared" / "DESIGN.md",
    ]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def _parse_design_table(text: str) -> set[tuple[State | None, State]]:
    section = text.split("## States and transitions", 1)[1].split("\n## ", 1)[0]
    pairs: set[tuple[State | None, State]] = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("from", "") or set(cells[0]) <= {"-"}:
            continue
        sources = [State(s.strip()) for s in cells[0].split(",")]
        targets = [State(s.strip()) for s in re.split(r"[/,]", cells[1])]
        pairs.update((a, b) for a in sources for b in targets)
    return pairs


def test_table_is_exactly_the_design_table():
    assert set(states.TRANSITIONS) == DESIGN_TABLE


def test_transcription_matches_design_md_when_available():
    path = _design_md()
    if path is None:
        pytest.skip("DESIGN.md not found beside the repository (set CELERY_LEASE_DESIGN_MD)")
    parsed = _parse_design_table(path.read_text())
    assert len(parsed) > 15
    assert parsed | {(None, S.PENDING)} == DESIGN_TABLE


def test_every_transition_says_who_makes_it():
    assert all(isinstance(who, str) and who.strip() for who in states.TRANSITIONS.values())


def test_terminal_states_have_no_outgoing_transitions():
    assert {S.SUCCEEDED, S.CANCELLED} == states.TERMINAL
    for terminal in states.TERMINAL:
        assert [to for (frm, to) in states.TRANSITIONS if frm is terminal] == []
        for target in State:
            assert not states.is_legal(terminal, target)


def test_only_creation_enters_pending_from_nothing():
    assert [to for (frm, to) in states.TRANSITIONS if frm is None] == [S.PENDING]


def test_no_state_transitions_to_itself():
    assert all(frm is not to for (frm, to) in states.TRANSITIONS)


def test_cancellable_and_retryable_sets_follow_the_table():
    operator_cancel = {frm for (frm, to) in states.TRANSITIONS if to is S.CANCELLED} - {S.RUNNING}
    assert operator_cancel == states.CANCELLABLE
    operator_retry = {frm for (frm, to) in states.TRANSITIONS if to is S.PENDING} - {
        None,
        S.RETRY_WAIT,
    }
    assert operator_retry == states.RETRYABLE


def test_running_can_only_be_entered_by_a_claim():
    assert [frm for (frm, to) in states.TRANSITIONS if to is S.RUNNING] == [S.PENDING]


def test_every_state_is_reachable_and_can_reach_a_terminal_state():
    edges: dict[State | None, set[State]] = {}
    for frm, to in states.TRANSITIONS:
        edges.setdefault(frm, set()).add(to)

    seen: set[State] = set()
    todo: deque[State | None] = deque([None])
    while todo:
        for nxt in edges.get(todo.popleft(), set()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert seen == set(State)

    for start in State:
        reach, todo2 = {start}, deque([start])
        while todo2:
            for nxt in edges.get(todo2.popleft(), set()) - reach:
                reach.add(nxt)
                todo2.append(nxt)
        assert reach & states.TERMINAL, f"{start} can never finish"


@given(st.sampled_from([None, *State]), st.sampled_from(list(State)))
def test_is_legal_is_table_membership(frm, to):
    assert states.is_legal(frm, to) == ((frm, to) in DESIGN_TABLE)


@given(st.sampled_from([None, *State]), st.sampled_from(list(State)))
def test_check_raises_exactly_for_illegal_pairs(frm, to):
    if (frm, to) in DESIGN_TABLE:
        assert states.check(frm, to, "t-1") is None
    else:
        with pytest.raises(IllegalTransition) as info:
            states.check(frm, to, "t-1")
        assert info.value.from_state is frm
        assert info.value.to_state is to
        assert info.value.task_id == "t-1"


def test_illegal_transition_error_details():
    with pytest.raises(IllegalTransition) as info:
        states.check(S.SUCCEEDED, S.PENDING, "abc")
    err = info.value
    assert isinstance(err, LeaseError) and isinstance(err, CeleryLeaseError)
    assert isinstance(err, Exception)
    assert (err.from_state, err.to_state, err.task_id) == (S.SUCCEEDED, S.PENDING, "abc")
    assert "SUCCEEDED -> PENDING" in str(err)

    with pytest.raises(IllegalTransition) as created:
        states.check(None, S.RUNNING)
    assert created.value.from_state is None and created.value.task_id is None
    assert "(new) -> RUNNING" in str(created.value)


def test_state_values_are_their_names():
    for state in State:
        assert state.value == state.name
        assert str(state) == state.name
        assert State(state.name) is state
    assert len(State) == 8


def test_every_rule_names_who_may_take_it():
    assert all(rule.actors and rule.note.strip() for rule in states.RULES.values())
    assert {pair: rule.note for pair, rule in states.RULES.items()} == states.TRANSITIONS


def test_operator_actions_are_derived_from_the_table():
    assert states.action_sources("retry") == {S.WAIT_MANUAL, S.FAILED, S.TIMEOUT}
    assert states.action_sources("fail") == {S.WAIT_MANUAL}
    assert states.action_sources("resolve") == {S.WAIT_MANUAL}
    # a RUNNING task is asked to stop; the task itself makes RUNNING -> CANCELLED
    assert states.action_sources("cancel") == states.CANCELLABLE | {S.RUNNING}
    assert S.RUNNING not in states.sources(S.CANCELLED, states.Actor.OPERATOR)
    assert states.sources(S.CANCELLED, states.Actor.TASK) == {S.RUNNING}


def test_a_tasks_own_outcome_may_come_from_running_or_an_overrun():
    for outcome in (S.SUCCEEDED, S.FAILED):
        assert states.sources(outcome, states.Actor.TASK) == {S.RUNNING, S.WAIT_MANUAL}
    assert states.sources(S.WAIT_MANUAL, states.Actor.TASK) == {S.RUNNING}


def test_celery_reports_the_tasks_own_outcomes_but_not_expiry_or_operators():
    reports = states.CELERY_REPORTS
    assert (S.RUNNING, S.SUCCEEDED) in reports
    assert (S.RUNNING, S.TIMEOUT) not in reports
    assert not any(states.Actor.OPERATOR in states.RULES[pair].actors for pair in reports)
