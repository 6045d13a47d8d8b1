"""Graded circuit breakers: unit behaviour with a fake clock, and their effect on the engine."""
from __future__ import annotations

import logging
import math

import pytest

from services.inference import config as inference_config
from services.inference.engine.breaker import BreakerBoard, BreakerConfig, TripRule
from shared.config import ConfigError
from shared.errors import NotReady, NumericalInstability
from tests.inference.faults import FaultSpec, inject
from tests.inference.helpers import collect, ids, prompt, request


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def board(clock, **kw) -> BreakerBoard:
    cfg = BreakerConfig(timeout=TripRule(10.0, 2), quiet_period_s=60.0, **kw)
    return BreakerBoard(cfg, max_batch_size=16, clock=clock)


def test_failures_spread_beyond_the_window_do_not_trip():
    clock = FakeClock()
    b = board(clock)
    for _ in range(5):
        b.record("timeout")
        clock.now += 11
    assert b.policy().level == 0 and b.snapshot()["timeout"].total_failures == 5


def test_levels_climb_one_per_threshold_and_grade_the_policy():
    clock = FakeClock()
    b = board(clock)
    expected = [
        (1, 0.3, 10.0, None, False),
        (2, 0.3, 10.0, 4, False),
        (3, 0.3, 10.0, 4, True),
        (3, 0.3, 10.0, 4, True),  # capped at 3
    ]
    for level, temp, clamp, batch, reject in expected:
        b.record("timeout")
        b.record("timeout")
        p = b.policy()
        assert (p.level, p.temperature_cap, p.logit_clamp, p.max_batch_size, p.reject) == \
            (level, temp, clamp, batch, reject)
    assert b.policy().retry_after_ms == 60_000
    assert b.snapshot()["timeout"].state == "open"


def test_quiet_period_steps_down_one_level_at_a_time():
    clock = FakeClock()
    b = board(clock)
    for _ in range(6):
        b.record("timeout")
    assert b.policy().level == 3
    clock.now += 59.9
    assert b.policy().level == 3 and b.policy().retry_after_ms == 100
    clock.now += 0.1
    assert b.policy().level == 2 and b.snapshot()["timeout"].state == "half_open"
    clock.now += 60
    assert b.policy().level == 1
    clock.now += 60
    assert b.policy().level == 0 and b.snapshot()["timeout"].state == "closed"


def test_a_failure_while_half_open_climbs_straight_back():
    clock = FakeClock()
    b = board(clock)
    for _ in range(4):
        b.record("timeout")
    clock.now += 60
    assert b.policy().level == 1 and b.snapshot()["timeout"].state == "half_open"
    b.record("timeout")  # one failure, below the threshold of 2
    assert b.policy().level == 2 and b.snapshot()["timeout"].state == "open"


def test_a_failure_restarts_the_quiet_period():
    clock = FakeClock()
    b = board(clock)
    b.record("timeout")
    b.record("timeout")
    clock.now += 50
    b.record("timeout")
    clock.now += 50  # 100 s since the trip, but only 50 s of quiet
    assert b.policy().level == 1


def test_breakers_are_independent_and_the_highest_level_applies():
    clock = FakeClock()
    b = board(clock, oom=TripRule(10.0, 1))
    b.record("oom")
    b.record("oom")
    assert b.snapshot()["oom"].level == 2 and b.snapshot()["timeout"].level == 0
    assert b.policy().level == 2


def test_transitions_are_logged_with_their_cause(caplog):
    clock = FakeClock()
    b = board(clock)
    caplog.set_level(logging.WARNING, logger="services.inference.engine.breaker")
    b.record("timeout", "deadline")
    b.record("timeout", "deadline")
    rec = caplog.records[-1]
    assert (rec.breaker, rec.from_level, rec.to_level, rec.to_state) == ("timeout", 0, 1, "open")
    assert "deadline" in rec.cause


@pytest.mark.parametrize("kind", ["disk", "", "OOM"])
def test_unknown_kind_is_rejected(kind):
    with pytest.raises(ValueError):
        board(FakeClock()).record(kind)


@pytest.mark.parametrize("key,value", [("QUIET_PERIOD_S", "0"), ("DEGRADED_MAX_BATCH_SIZE", "0"),
                                       ("OOM__WINDOW_S", "0"), ("OOM__THRESHOLD", "0")])
def test_bad_breaker_config_is_rejected(key, value):
    field = "engine.breaker." + key.lower().replace("__", ".")
    with pytest.raises(ConfigError, match=f"field '{field}' breaks rule"):
        inference_config.load(environ={f"KEEL_INFERENCE_ENGINE__BREAKER__{key}": value})


def trip(engine, times: int) -> None:
    for _ in range(times):
        engine.report_failure("output_limit", "validator said too long")


FAST_TRIP = BreakerConfig(output_limit=TripRule(60.0, 1), logit_clamp=1e9, fallback_format="bfloat16",
                          degraded_max_batch_size=2)


@pytest.mark.asyncio
async def test_level_one_caps_temperature(make_engine):
    engine = await make_engine(breaker=FAST_TRIP)
    cool, _ = await collect(engine, request("a", prompt(1), max_tokens=12, temperature=0.3, seed=7))
    hot, _ = await collect(engine, request("b", prompt(1), max_tokens=12, temperature=2.0, seed=7))
    assert ids(hot) != ids(cool)
    trip(engine, 1)
    capped, fin = await collect(engine, request("c", prompt(1), max_tokens=12, temperature=2.0, seed=7))
    assert ids(capped) == ids(cool) and fin.breaker_level == 1


@pytest.mark.asyncio
async def test_level_one_clamps_logits(make_engine):
    engine = await make_engine(breaker=BreakerConfig(output_limit=TripRule(60.0, 1), logit_clamp=0.01))
    before, _ = await collect(engine, request("a", prompt(2), max_tokens=4))
    trip(engine, 1)
    after, _ = await collect(engine, request("b", prompt(2), max_tokens=4))
    # Logits squeezed into +-0.01 make the distribution almost uniform over the vocabulary.
    assert all(t.entropy > math.log(49152) - 0.01 for t in after)
    assert all(t.entropy < math.log(49152) - 1 for t in before)


@pytest.mark.asyncio
async def test_level_two_shrinks_the_batch_and_uses_the_fallback_format(make_engine):
    engine = await make_engine(breaker=FAST_TRIP)
    trip(engine, 2)
    assert engine.stats().breaker_level == 2 and engine.stats().batch_cap == 2
    _, fin = await collect(engine, request("a", prompt(3), max_tokens=3))
    assert fin.format == "bfloat16" and fin.breaker_level == 2


@pytest.mark.asyncio
async def test_level_three_rejects_then_half_opens(make_engine):
    clock = FakeClock()
    engine = await make_engine(breaker=FAST_TRIP, clock=clock)
    trip(engine, 3)
    with pytest.raises(NotReady) as e:
        await collect(engine, request("a", prompt(4), max_tokens=3))
    assert e.value.reason == "CIRCUIT_OPEN" and e.value.retry_after_ms == 300_000
    clock.now += 300
    assert engine.stats().breaker["output_limit"].state == "half_open"
    tokens, fin = await collect(engine, request("b", prompt(4), max_tokens=3))
    assert len(tokens) == 3 and fin.breaker_level == 2


@pytest.mark.asyncio
async def test_repeated_numerical_faults_trip_the_breaker(make_engine):
    engine = await make_engine()
    faults = inject(engine)
    for i in range(3):
        faults[f"n{i}"] = FaultSpec(nan_at_step=1)
        with pytest.raises(NumericalInstability):
            await collect(engine, request(f"n{i}", prompt(i)))
    assert engine.stats().breaker["numerical_instability"].level == 1
