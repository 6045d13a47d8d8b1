"""The executor against a scripted fake upstream: status paths, budgets, deadlines, log records."""
from __future__ import annotations

import asyncio
import logging
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.budget import KEEL_PREVIOUS_ATTEMPTS_KEY, PREVIOUS_ATTEMPTS_KEY, ThrottleConfig
from services.gateway.retry import RetryConfig, RetryExecutor
from services.gateway.retry_alerts import RetryMonitor
from shared.errors import (
    DeadlineExpired,
    InvalidInput,
    KeelError,
    NotReady,
    Overloaded,
    PermissionDenied,
    Unauthenticated,
)

SEED = 1234


def executor(clock, cfg=RetryConfig(), seed=SEED):
    return RetryExecutor(cfg, clock=clock, sleep=clock.sleep, rng=random.Random(seed))


async def call(ex, clock, upstream_fn, *, timeout=10.0, **kw):
    args = dict(method="Tokenize", upstream="tokenizer", idempotent=True,
                deadline=clock.now + timeout, trace_id="trace-1")
    args.update(kw)
    return await ex.call_with_retries(upstream_fn, **args)


def decisions(caplog):
    return [r for r in caplog.records if getattr(r, "event", None) == "retry_decision"]


@pytest.mark.asyncio
async def test_unavailable_retries_with_exact_jitter_and_attempt_metadata(clock, scripted):
    up = scripted([NotReady("down"), NotReady("down"), "ok"])
    assert await call(executor(clock), clock, up) == "ok"
    replay = random.Random(SEED)
    assert clock.sleeps == [replay.uniform(0, 0.1), replay.uniform(0, 0.2)]
    assert [md for _, md in up.calls] == [{}] + [
        {PREVIOUS_ATTEMPTS_KEY: n, KEEL_PREVIOUS_ATTEMPTS_KEY: n} for n in ("1", "2")]


@pytest.mark.asyncio
async def test_unavailable_gives_up_after_three_attempts_with_the_last_error(clock, scripted, caplog):
    caplog.set_level(logging.INFO, logger="keel.gateway.retry")
    last = NotReady("still down")
    up = scripted([NotReady("down"), NotReady("down"), last])
    with pytest.raises(NotReady) as info:
        await call(executor(clock), clock, up)
    assert info.value is last
    assert info.value.metadata["retry_stop"] == "max_attempts"
    assert info.value.metadata["attempts"] == "3"
    assert [(r.decision, r.reason) for r in decisions(caplog)] == [
        ("retry", None), ("retry", None), ("stop", "max_attempts")]


@pytest.mark.asyncio
async def test_decision_record_has_every_field(clock, scripted, caplog):
    caplog.set_level(logging.INFO, logger="keel.gateway.retry")
    up = scripted([NotReady("down"), "ok"], latency_s=0.007)
    await call(executor(clock), clock, up)
    (rec,) = decisions(caplog)
    delay = random.Random(SEED).uniform(0, 0.1)
    assert (rec.trace_id, rec.method, rec.upstream, rec.attempt, rec.code) == (
        "trace-1", "Tokenize", "tokenizer", 1, "UNAVAILABLE")
    assert (rec.decision, rec.reason, rec.delay_source) == ("retry", None, "exponential_jitter")
    assert rec.delay_ms == pytest.approx(delay * 1000)
    assert rec.retry_after_ms is None and rec.current_backoff_ms == 100.0
    assert rec.upstream_latency_ms == pytest.approx(7.0)
    assert (rec.tokens_before, rec.tokens_after) == (10.0, 9.0)


@pytest.mark.asyncio
async def test_resource_exhausted_waits_the_hint_then_succeeds(clock, scripted):
    up = scripted([Overloaded("queue full", retry_after_ms=300), "ok"])
    assert await call(executor(clock), clock, up) == "ok"
    assert clock.sleeps == [0.3 * random.Random(SEED).uniform(1.0, 1.5)]


@pytest.mark.asyncio
async def test_resource_exhausted_second_failure_stops(clock, scripted):
    up = scripted([Overloaded("full", retry_after_ms=10), Overloaded("full", retry_after_ms=10)])
    with pytest.raises(Overloaded) as info:
        await call(executor(clock), clock, up)
    assert len(up.calls) == 2 and info.value.metadata["retry_stop"] == "max_attempts"
    assert info.value.retry_after_ms == 10  # the client still gets the server's hint


@pytest.mark.asyncio
@pytest.mark.parametrize("err,reason", [
    (Overloaded("no hint"), "non_retryable"),
    (Overloaded("bad hint", metadata={"retry_hint": "invalid"}), "pushback_stop"),
    (Overloaded("too big", retry_after_ms=5, metadata={"message_size": "1"}), "non_retryable"),
    (InvalidInput("bad prompt"), "non_retryable"),
    (Unauthenticated("who"), "non_retryable"),
    (PermissionDenied("no"), "non_retryable"),
    (NotReady("all down", reason="NO_HEALTHY_UPSTREAM"), "circuit_open"),
])
async def test_single_attempt_paths(clock, scripted, err, reason):
    ex = executor(clock)
    up = scripted([err])
    with pytest.raises(KeelError) as info:
        await call(ex, clock, up)
    assert info.value is err and len(up.calls) == 1 and clock.sleeps == []
    assert err.metadata["retry_stop"] == reason


@pytest.mark.asyncio
async def test_local_no_upstream_costs_no_token_but_upstream_failures_do(clock, scripted):
    ex = executor(clock)
    with pytest.raises(NotReady):
        await call(ex, clock, scripted([NotReady("x", reason="NO_HEALTHY_UPSTREAM")]))
    assert ex.throttles.get("tokenizer").tokens == 10.0
    with pytest.raises(InvalidInput):
        await call(ex, clock, scripted([InvalidInput("bad")]))
    assert ex.throttles.get("tokenizer").tokens == 10.0
    with pytest.raises(Overloaded):
        await call(ex, clock, scripted([Overloaded("no hint")]))
    assert ex.throttles.get("tokenizer").tokens == 9.0


def timing_out(clock, outcomes):
    """An attempt_fn whose attempts use their whole timeout, then fail or return per outcomes."""
    calls = []

    async def attempt(timeout_s, md):
        calls.append(timeout_s)
        clock.advance(timeout_s)
        step = outcomes.pop(0)
        if isinstance(step, BaseException):
            raise step
        return step
    return attempt, calls


@pytest.mark.asyncio
async def test_deadline_exceeded_linear_backoff_for_per_attempt_timeouts(clock):
    attempt, calls = timing_out(clock, [DeadlineExpired("slow"), DeadlineExpired("slow"), "ok"])
    ex = executor(clock, RetryConfig(per_attempt_timeout_s=0.5))
    assert await call(ex, clock, attempt) == "ok"
    assert clock.sleeps == [0.05, 0.1] and calls == [0.5, 0.5, 0.5]


@pytest.mark.asyncio
async def test_deadline_exceeded_not_retried_for_non_idempotent_call(clock):
    attempt, calls = timing_out(clock, [DeadlineExpired("slow")])
    ex = executor(clock)
    with pytest.raises(DeadlineExpired) as info:
        await call(ex, clock, attempt, idempotent=False, attempt_timeout_s=0.5)
    assert calls == [0.5] and info.value.metadata["retry_stop"] == "non_retryable"


@pytest.mark.asyncio
async def test_deadline_exceeded_on_the_overall_deadline_is_not_retried(clock):
    attempt, calls = timing_out(clock, [DeadlineExpired("slow")])
    with pytest.raises(DeadlineExpired) as info:
        await call(executor(clock), clock, attempt, timeout=2.0)
    assert calls == [pytest.approx(1.98)] and info.value.metadata["retry_stop"] == "deadline"


@pytest.mark.asyncio
async def test_per_attempt_timeout_never_exceeds_the_time_left(clock):
    attempt, calls = timing_out(clock, [DeadlineExpired("slow"), DeadlineExpired("slow")])
    ex = executor(clock, RetryConfig(per_attempt_timeout_s=0.6))
    with pytest.raises(DeadlineExpired) as info:
        await call(ex, clock, attempt, timeout=1.0)
    # 1.0 - 0.02 margin = 0.98 left; 0.6 spent + 0.05 backoff leaves 0.33 for the second try.
    assert calls == [0.6, pytest.approx(0.33)]
    assert info.value.metadata["retry_stop"] == "deadline"


@pytest.mark.asyncio
async def test_no_attempt_when_the_deadline_has_passed(clock, scripted, caplog):
    caplog.set_level(logging.INFO, logger="keel.gateway.retry")
    up = scripted(["ok"])
    for timeout in (-1.0, 0.01):  # past, and inside the margin
        with pytest.raises(DeadlineExpired) as info:
            await call(executor(clock), clock, up, timeout=timeout)
        assert info.value.metadata["retry_stop"] == "deadline"
    assert up.calls == []
    assert [r.reason for r in decisions(caplog)] == ["deadline", "deadline"]


@pytest.mark.asyncio
async def test_retry_refused_when_delay_plus_expected_latency_does_not_fit(clock, scripted):
    ex = executor(clock)
    await call(ex, clock, scripted(["ok"], latency_s=0.1))  # expected latency is now 0.1 s
    up = scripted([NotReady("down")])
    with pytest.raises(NotReady) as info:
        await call(ex, clock, up, timeout=0.11)
    assert up.calls[0][0] == pytest.approx(0.09)
    assert info.value.metadata["retry_stop"] == "deadline" and clock.sleeps == []


@pytest.mark.asyncio
async def test_budget_exhaustion_follows_a6_token_arithmetic(clock, scripted, caplog):
    caplog.set_level(logging.INFO, logger="keel.gateway.retry")
    ex = executor(clock)
    throttle = ex.throttles.get("tokenizer")
    for _ in range(3):
        with pytest.raises(NotReady):
            await call(ex, clock, scripted([NotReady("down")] * 3))
    # tokens 10 -> 9 retry, 8 retry, 7 max_attempts | 6 retry, 5 budget | 4 budget
    assert [(r.reason, r.tokens_after) for r in decisions(caplog)] == [
        (None, 9.0), (None, 8.0), ("max_attempts", 7.0), (None, 6.0), ("budget", 5.0), ("budget", 4.0)]
    for _ in range(21):  # each success gives back 0.1 token
        await call(ex, clock, scripted(["ok"]))
    assert throttle.tokens == 6.1
    up = scripted([NotReady("down"), "ok"])  # 6.1 - 1 = 5.1 > 5: retrying is allowed again
    assert await call(ex, clock, up) == "ok" and len(up.calls) == 2
    assert throttle.tokens == 5.2
    # Another upstream has its own bucket.
    assert ex.throttles.get("inference").tokens == 10.0


@pytest.mark.asyncio
async def test_total_outage_amplification_is_bounded_by_the_budget(clock):
    ex = executor(clock)
    attempts = 0

    async def dead(timeout_s, md):
        nonlocal attempts
        attempts += 1
        raise NotReady("connection refused")
    for _ in range(500):
        with pytest.raises(NotReady):
            await call(ex, clock, dead)
    # Without the budget this would be 1500; A6 allows retries only while tokens > 5 of 10.
    assert 500 < attempts <= 500 + 5


@pytest.mark.asyncio
@pytest.mark.parametrize("key", [PREVIOUS_ATTEMPTS_KEY, KEEL_PREVIOUS_ATTEMPTS_KEY])
async def test_a_request_that_is_itself_a_retry_gets_one_attempt(clock, scripted, key):
    up = scripted([NotReady("down")])
    with pytest.raises(NotReady) as info:
        await call(executor(clock), clock, up, inbound_metadata=((key, "1"),))
    assert len(up.calls) == 1 and info.value.metadata["retry_stop"] == "max_attempts"


@pytest.mark.asyncio
async def test_unexpected_exceptions_are_not_retried(clock):
    calls = []

    async def broken(timeout_s, md):
        calls.append(timeout_s)
        raise RuntimeError("bug")
    with pytest.raises(RuntimeError):
        await call(executor(clock), clock, broken)
    assert len(calls) == 1


@pytest.mark.asyncio
async def test_retries_reach_the_monitor_and_its_exporter(clock, scripted):
    seen = []
    ex = RetryExecutor(RetryConfig(), clock=clock, sleep=clock.sleep, rng=random.Random(SEED),
                       monitor=RetryMonitor(RetryConfig().alerts, clock, on_interval=lambda *a: seen.append(a)))
    await call(ex, clock, scripted([NotReady("down"), NotReady("down"), "ok"]))
    assert [(up, code) for up, code, _ in seen] == [("tokenizer", "UNAVAILABLE")] * 2
    assert sum(s for _, _, s in seen) == pytest.approx(sum(clock.sleeps))


ERRORS = st.sampled_from([
    lambda: NotReady("down"), lambda: Overloaded("full", retry_after_ms=200),
    lambda: Overloaded("full"), lambda: InvalidInput("bad"), lambda: DeadlineExpired("slow"),
    lambda: NotReady("warm", retry_after_ms=50)])


@settings(max_examples=150, deadline=None)
@given(script=st.lists(ERRORS, min_size=1, max_size=5), timeout=st.floats(0.0, 3.0),
       latency=st.floats(0.0, 0.3), attempt_timeout=st.none() | st.floats(0.05, 1.0),
       seed=st.integers(0, 2**16), max_tokens=st.sampled_from([1.0, 10.0]))
def test_invariants_over_random_scripts(fake_types, script, timeout, latency, attempt_timeout, seed,
                                        max_tokens):
    clock_cls, upstream_cls = fake_types
    clock = clock_cls()
    start = clock.now
    up = upstream_cls(clock, [make() for make in script] + ["ok"], latency)
    cfg = RetryConfig(per_attempt_timeout_s=attempt_timeout, throttle=ThrottleConfig(max_tokens=max_tokens))
    try:
        asyncio.run(call(executor(clock, cfg, seed), clock, up, timeout=timeout))
        succeeded = True
    except KeelError as err:
        succeeded = False
        assert err.metadata["retry_stop"] in {
            "non_retryable", "max_attempts", "budget", "deadline", "pushback_stop", "circuit_open"}
    assert len(up.calls) <= 3
    assert succeeded == (len(up.calls) == len(script) + 1)
    for i, (attempt_timeout_s, md) in enumerate(up.calls):
        assert md.get(PREVIOUS_ATTEMPTS_KEY) == (str(i) if i else None)
        assert md.get(KEEL_PREVIOUS_ATTEMPTS_KEY) == md.get(PREVIOUS_ATTEMPTS_KEY)
        assert attempt_timeout_s > 0
    # Every attempt starts before the deadline minus the margin.
    assert all(t < start + timeout - cfg.deadline_margin_s for t in up.starts)
    assert len(clock.sleeps) == max(len(up.calls) - 1, 0)


@pytest.mark.asyncio
async def test_replicas_lost_one_after_another_spend_no_retry_token(clock, scripted):
    """Two replicas killed in turn under one call: re-dispatched, then retried, with a throttle
    that has no retry to give; an overloaded upstream's UNAVAILABLE would stop at `budget`."""
    lost = lambda: NotReady("process gone", reason="CONNECTION_LOST")  # noqa: E731
    ex = executor(clock, RetryConfig(throttle=ThrottleConfig(max_tokens=1)))
    up = scripted([lost(), lost(), "ok"])
    assert await call(ex, clock, up) == "ok"
    assert ex.throttles.get("tokenizer").tokens == 1.0
    with pytest.raises(NotReady) as info:
        await call(ex, clock, scripted([NotReady("busy"), "ok"]))
    assert info.value.metadata["retry_stop"] == "budget"
