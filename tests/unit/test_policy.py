"""Pure policy decisions: what an expired lease becomes, how long a retry waits."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_lease import states
from celery_lease.policy import after_timeout
from celery_lease.states import State


def decide(**overrides):
    values = {
        "on_timeout": "retry",
        "recoveries": 1,
        "max_recoveries": 5,
        "age": 10.0,
        "max_age": None,
        "inflight_step": None,
        "cancel_requested": False,
    }
    values.update(overrides)
    return after_timeout(**values)


# -- after_timeout ------------------------------------------------------------------------


def test_safe_expiry_is_retried():
    to, reason = decide()
    assert to is State.RETRY_WAIT
    assert "retry" in reason


def test_inflight_non_idempotent_step_goes_to_a_person_naming_the_step():
    to, reason = decide(inflight_step="charge_card")
    assert to is State.WAIT_MANUAL
    assert "'charge_card'" in reason and "unknown" in reason


def test_inflight_step_wins_over_every_other_reason():
    to, reason = decide(
        inflight_step="send_mail",
        on_timeout="manual",
        recoveries=99,
        max_recoveries=1,
        age=1e6,
        max_age=1.0,
        cancel_requested=True,
    )
    assert to is State.WAIT_MANUAL
    assert "send_mail" in reason


def test_a_requested_cancel_is_honoured_when_no_step_outcome_is_unknown():
    to, reason = decide(cancel_requested=True, on_timeout="manual", recoveries=99, max_recoveries=1)
    assert to is State.CANCELLED
    assert "cancel" in reason


def test_cancel_requested_defaults_to_false():
    values = {
        "on_timeout": "retry",
        "recoveries": 1,
        "max_recoveries": 5,
        "age": 1.0,
        "max_age": None,
    }
    assert after_timeout(**values, inflight_step=None)[0] is State.RETRY_WAIT


def test_on_timeout_manual_is_never_retried():
    to, reason = decide(on_timeout="manual")
    assert to is State.WAIT_MANUAL
    assert "manual" in reason


@pytest.mark.parametrize(
    ("recoveries", "max_recoveries", "expected"),
    [
        (0, 0, State.RETRY_WAIT),
        (1, 0, State.WAIT_MANUAL),
        (5, 5, State.RETRY_WAIT),  # recoveries counts this expiry: the 5th is still allowed
        (6, 5, State.WAIT_MANUAL),
    ],
)
def test_poison_cap_on_recoveries(recoveries, max_recoveries, expected):
    to, reason = decide(recoveries=recoveries, max_recoveries=max_recoveries)
    assert to is expected
    if expected is State.WAIT_MANUAL:
        assert "poison" in reason and str(recoveries) in reason and str(max_recoveries) in reason


@pytest.mark.parametrize(
    ("age", "max_age", "expected"),
    [
        (1e9, None, State.RETRY_WAIT),
        (59.5, 60.0, State.RETRY_WAIT),
        (60.0, 60.0, State.RETRY_WAIT),
        (60.5, 60.0, State.WAIT_MANUAL),
    ],
)
def test_age_cap(age, max_age, expected):
    to, reason = decide(age=age, max_age=max_age)
    assert to is expected
    if expected is State.WAIT_MANUAL:
        assert "too old" in reason


@given(
    on_timeout=st.sampled_from(["retry", "manual"]),
    recoveries=st.integers(0, 50),
    max_recoveries=st.integers(0, 50),
    age=st.floats(0, 1e7, allow_nan=False),
    max_age=st.none() | st.floats(0.001, 1e7, allow_nan=False),
    inflight_step=st.none() | st.text(min_size=1, max_size=20),
    cancel_requested=st.booleans(),
)
def test_retry_only_when_every_condition_is_safe(
    on_timeout, recoveries, max_recoveries, age, max_age, inflight_step, cancel_requested
):
    to, reason = after_timeout(
        on_timeout=on_timeout,
        recoveries=recoveries,
        max_recoveries=max_recoveries,
        age=age,
        max_age=max_age,
        inflight_step=inflight_step,
        cancel_requested=cancel_requested,
    )
    safe = (
        on_timeout != "manual"
        and recoveries <= max_recoveries
        and (max_age is None or age <= max_age)
    )
    if inflight_step is not None:
        expected = State.WAIT_MANUAL
    elif cancel_requested:
        expected = State.CANCELLED
    else:
        expected = State.RETRY_WAIT if safe else State.WAIT_MANUAL
    assert to is expected
    assert states.is_legal(State.TIMEOUT, to)  # the policy only picks moves the table allows
    assert reason.strip()


# -- retry_delay --------------------------------------------------------------------------
# Celery's own semantics of a retry's delay (``self.retry()`` goes through Celery, which
# computes it): the model the docs' "Celery's own options keep their meaning" states.


def retry_delay(
    *,
    retries: int,
    countdown: float | None,
    default_delay: float,
    backoff: bool | float,
    backoff_max: float,
    jitter: bool,
    rng: random.Random | None = None,
) -> float:
    """Seconds to wait before retry number ``retries + 1``.

    An explicit ``countdown`` wins; with ``retry_backoff`` the delay grows as
    ``factor * 2**retries`` capped at ``retry_backoff_max``, with full jitter
    when ``retry_jitter`` is set (Celery's own semantics); otherwise
    ``default_retry_delay``.
    """
    if countdown is not None:
        return max(0.0, float(countdown))
    if backoff:
        factor = 1.0 if backoff is True else float(backoff)
        delay: float = min(float(backoff_max), factor * float(2**retries))
        if jitter:
            delay = float((rng or random).uniform(0, delay))
        return max(0.0, delay)
    return max(0.0, float(default_delay))


def delay(**overrides):
    values = {
        "retries": 0,
        "countdown": None,
        "default_delay": 180.0,
        "backoff": False,
        "backoff_max": 600.0,
        "jitter": False,
    }
    values.update(overrides)
    return retry_delay(**values)


def test_default_delay_without_backoff():
    assert delay(retries=7, default_delay=12.5) == 12.5


def test_explicit_countdown_wins_over_backoff_and_default():
    assert delay(countdown=3.25, backoff=True, jitter=True, retries=5) == 3.25
    assert delay(countdown=0, default_delay=99) == 0.0


def test_negative_values_become_zero():
    assert delay(countdown=-5) == 0.0
    assert delay(default_delay=-1) == 0.0


def test_backoff_doubles_and_is_capped():
    got = [delay(retries=n, backoff=True, backoff_max=10.0) for n in range(6)]
    assert got == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_backoff_factor():
    assert [delay(retries=n, backoff=3, backoff_max=1000) for n in range(4)] == [
        3.0,
        6.0,
        12.0,
        24.0,
    ]
    assert delay(retries=2, backoff=0.5, backoff_max=1000) == 2.0


def test_jitter_is_reproducible_with_a_seeded_rng():
    a = [delay(retries=n, backoff=True, jitter=True, rng=random.Random(7)) for n in range(5)]
    b = [delay(retries=n, backoff=True, jitter=True, rng=random.Random(7)) for n in range(5)]
    assert a == b
    assert a != [delay(retries=n, backoff=True) for n in range(5)]


@given(
    retries=st.integers(0, 40),
    factor=st.one_of(st.just(True), st.floats(0.01, 100, allow_nan=False)),
    backoff_max=st.floats(0.0, 3600, allow_nan=False),
    seed=st.integers(0, 2**32),
)
def test_jittered_backoff_stays_within_zero_and_the_capped_delay(
    retries, factor, backoff_max, seed
):
    unjittered = delay(retries=retries, backoff=factor, backoff_max=backoff_max)
    jittered = delay(
        retries=retries,
        backoff=factor,
        backoff_max=backoff_max,
        jitter=True,
        rng=random.Random(seed),
    )
    assert 0.0 <= jittered <= unjittered <= backoff_max
    base = 1.0 if factor is True else factor
    assert unjittered == pytest.approx(min(backoff_max, base * 2**retries))


@given(
    retries=st.integers(0, 40),
    countdown=st.none() | st.floats(-1e6, 1e6, allow_nan=False),
    default_delay=st.floats(-1e6, 1e6, allow_nan=False),
    backoff=st.booleans() | st.floats(0.01, 10, allow_nan=False),
    jitter=st.booleans(),
)
def test_delay_is_never_negative(retries, countdown, default_delay, backoff, jitter):
    value = retry_delay(
        retries=retries,
        countdown=countdown,
        default_delay=default_delay,
        backoff=backoff,
        backoff_max=600.0,
        jitter=jitter,
        rng=random.Random(0),
    )
    assert value >= 0.0
