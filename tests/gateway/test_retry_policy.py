"""The pure retry decision: each status path, the order of the checks, exact jitter draws."""
from __future__ import annotations

import random

import pytest

from services.gateway import config as gateway_config
from services.gateway.retry import RetryConfig, decide, hint_state
from services.gateway.retry_alerts import ks_distance_uniform
from shared import errors
from shared.config import ConfigError
from shared.errors import (
    Cancelled,
    DeadlineExpired,
    Fatal,
    InvalidInput,
    NotFound,
    NotReady,
    NumericalInstability,
    Overloaded,
    PermissionDenied,
    PreconditionFailed,
    Unauthenticated,
)

CFG = RetryConfig()


def run(err, *, attempt=1, max_attempts=3, idempotent=True, early=False, budget_ok=True,
        remaining=10.0, expected=0.0, cfg=CFG, seed=1):
    return decide(err, attempt=attempt, max_attempts=max_attempts, idempotent=idempotent,
                  attempt_timed_out_early=early, budget_ok=budget_ok, remaining_s=remaining,
                  expected_latency_s=expected, cfg=cfg, rng=random.Random(seed))


@pytest.mark.parametrize("attempt,bound", [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (7, 1.0)])
def test_unavailable_full_jitter_bound_and_exact_draw(attempt, bound):
    cfg = RetryConfig(unavailable_max_attempts=10, max_attempts_per_request=10)
    d = run(NotReady("down"), attempt=attempt, max_attempts=10, cfg=cfg, seed=42)
    assert d.retry and d.reason is None
    assert d.delay_source == "exponential_jitter"
    assert d.delay_s == random.Random(42).uniform(0.0, bound)
    assert (d.low_s, d.high_s, d.current_backoff_ms) == (0.0, bound, bound * 1000.0)


def test_unavailable_jitter_is_uniform_over_the_whole_range():
    rng = random.Random(2024)
    delays = [decide(NotReady("down"), attempt=2, max_attempts=3, idempotent=True,
                     attempt_timed_out_early=False, budget_ok=True, remaining_s=10.0,
                     expected_latency_s=0.0, cfg=CFG, rng=rng).delay_s for _ in range(2000)]
    assert all(0.0 <= d <= 0.2 for d in delays)
    # 1% critical KS value for n=2000 is ~0.036; a fixed or half-range delay would be >= 0.5.
    assert ks_distance_uniform(d / 0.2 for d in delays) < 0.036


def test_unavailable_stops_at_three_attempts():
    assert run(NotReady("down"), attempt=2).retry
    d = run(NotReady("down"), attempt=3)
    assert (d.retry, d.reason) == (False, "max_attempts")


def test_request_cap_applies_below_the_code_cap():
    d = run(NotReady("down"), attempt=1, max_attempts=1)
    assert (d.retry, d.reason) == (False, "max_attempts")


def test_a_deadline_inference_cannot_meet_is_not_retried_within_it():
    # The engine's estimate says the call cannot finish by its deadline: a retry has less time left.
    d = run(Overloaded("too long for its deadline", reason=errors.DEADLINE_UNREACHABLE, retry_after_ms=250))
    assert (d.retry, d.reason) == (False, "deadline")


def test_resource_exhausted_waits_the_hint_times_jitter():
    d = run(Overloaded("queue full", retry_after_ms=250), seed=9)
    assert d.retry and d.delay_source == "pushback"
    assert d.delay_s == 0.25 * random.Random(9).uniform(1.0, 1.5)
    assert (d.low_s, d.high_s) == (0.25, 0.375)


def test_resource_exhausted_hint_is_clamped_to_30_s():
    d = run(Overloaded("queue full", retry_after_ms=600_000), remaining=100.0, seed=3)
    assert d.delay_s == 30.0 * random.Random(3).uniform(1.0, 1.5)
    assert 30.0 <= d.delay_s <= 45.0


def test_resource_exhausted_hint_of_zero_retries_at_once():
    d = run(Overloaded("queue full", retry_after_ms=0))
    assert d.retry and d.delay_s == 0.0


def test_resource_exhausted_at_most_two_attempts():
    d = run(Overloaded("queue full", retry_after_ms=10), attempt=2)
    assert (d.retry, d.reason) == (False, "max_attempts")


@pytest.mark.parametrize("err,reason", [
    (Overloaded("no hint"), "non_retryable"),
    (Overloaded("bad hint", metadata={"retry_hint": "invalid"}), "pushback_stop"),
    (Overloaded("negative", retry_after_ms=-1), "pushback_stop"),
    (Overloaded("too big", retry_after_ms=100, metadata={"message_size": "1", "retry_hint": "valid"}),
     "non_retryable"),
])
def test_resource_exhausted_without_a_usable_hint_is_not_retried(err, reason):
    d = run(err)
    assert (d.retry, d.reason) == (False, reason)


def test_unavailable_honours_a_server_hint():
    d = run(NotReady("warming up", retry_after_ms=400), seed=5)
    assert d.delay_source == "pushback" and d.delay_s == 0.4 * random.Random(5).uniform(1.0, 1.5)
    bad = run(NotReady("warming up", metadata={"retry_hint": "invalid"}))
    assert (bad.retry, bad.reason) == (False, "pushback_stop")


def test_deadline_exceeded_linear_backoff_for_idempotent_per_attempt_timeout():
    first = run(DeadlineExpired("slow"), attempt=1, early=True)
    second = run(DeadlineExpired("slow"), attempt=2, early=True)
    assert (first.delay_source, first.delay_s, second.delay_s) == ("linear", 0.05, 0.1)
    assert first.low_s == first.high_s == 0.05


def test_deadline_exceeded_not_retried_when_not_idempotent_or_out_of_overall_time():
    assert run(DeadlineExpired("slow"), idempotent=False, early=True).reason == "non_retryable"
    assert run(DeadlineExpired("slow"), idempotent=True, early=False).reason == "deadline"


@pytest.mark.parametrize("err", [
    InvalidInput("bad"), PreconditionFailed("too big"), Unauthenticated("who"),
    PermissionDenied("no"), NotFound("none"), NumericalInstability("nan"), Fatal("bug"),
    Cancelled("gone"),
])
def test_other_codes_are_never_retried(err):
    d = run(err)
    assert (d.retry, d.reason) == (False, "non_retryable")


@pytest.mark.parametrize("reason", ["NO_HEALTHY_UPSTREAM"])
def test_local_no_upstream_stops_with_circuit_open(reason):
    d = run(NotReady("all down", reason=reason, retry_after_ms=100))
    assert (d.retry, d.reason) == (False, "circuit_open")


def test_budget_is_checked_after_attempt_cap_and_before_deadline():
    assert run(NotReady("down"), attempt=3, budget_ok=False).reason == "max_attempts"
    assert run(NotReady("down"), budget_ok=False, remaining=0.0).reason == "budget"


def test_retry_that_cannot_fit_before_the_deadline_is_refused():
    d = run(NotReady("down"), remaining=0.5, expected=0.5, seed=8)
    assert (d.retry, d.reason) == (False, "deadline")
    assert d.delay_s == random.Random(8).uniform(0.0, 0.1)  # the refused delay is still logged
    fits = run(NotReady("down"), remaining=0.7, expected=0.5)
    assert fits.retry


def test_pushback_longer_than_the_time_left_is_refused():
    d = run(Overloaded("full", retry_after_ms=5000), remaining=4.0)
    assert (d.retry, d.reason) == (False, "deadline")


def test_rng_is_not_drawn_when_stopping_early():
    rng = random.Random(11)
    state = rng.getstate()
    for err in (InvalidInput("bad"), Overloaded("no hint"), NotReady("down")):
        decide(err, attempt=3, max_attempts=3, idempotent=True, attempt_timed_out_early=False,
               budget_ok=True, remaining_s=10.0, expected_latency_s=0.0, cfg=CFG, rng=rng)
    assert rng.getstate() == state


@pytest.mark.parametrize("err,state", [
    (Overloaded("x"), "absent"),
    (Overloaded("x", retry_after_ms=5), "valid"),
    (Overloaded("x", retry_after_ms=-5), "invalid"),
    (Overloaded("x", metadata={"retry_hint": "invalid"}), "invalid"),
    (Overloaded("x", metadata={"retry_hint": "absent"}), "absent"),
])
def test_hint_state(err, state):
    assert hint_state(err) == state


@pytest.mark.parametrize("key,value", [
    ("unavailable_max_attempts", "0"), ("max_attempts_per_request", "0"), ("base_s", "0.0"),
    ("pushback_jitter_max", "0.9"), ("deadline_margin_s", "-1.0"),
])
def test_config_rejects_nonsense(key, value):
    """Each field's bounds are the config schema's: the gateway's config load refuses the value."""
    with pytest.raises(ConfigError, match=f"field 'retry.{key}' breaks rule"):
        gateway_config.load(environ={f"KEEL_GATEWAY_RETRY__{key.upper()}": value})


def test_a_cap_below_the_base_is_rejected():
    with pytest.raises(ValueError, match="cap_s >= base_s"):
        RetryConfig(cap_s=0.01)
