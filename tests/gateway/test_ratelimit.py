"""Per-key token-bucket rate limits and the request size checker."""
from __future__ import annotations

import pytest

from services.gateway import config as gateway_config
from services.gateway.ratelimit import RateLimit, RateLimitConfig, RateLimiter
from shared.config import ConfigError
from shared.errors import Overloaded


def limiter(clock, rate=2.0, burst=3.0, per_key=None):
    return RateLimiter(RateLimitConfig(RateLimit(rate, burst), per_key or {}), clock=clock)


def test_burst_then_rate_limited_with_exact_hint(clock):
    rl = limiter(clock, rate=2.0, burst=3.0)
    for _ in range(3):
        rl.check("team-a")
    with pytest.raises(Overloaded) as info:
        rl.check("team-a")
    err = info.value
    assert (err.reason, err.code, err.retry_after_ms) == ("RATE_LIMITED", "RESOURCE_EXHAUSTED", 500)
    assert err.metadata["key_id"] == "team-a"


def test_waiting_the_hint_is_enough(clock):
    rl = limiter(clock, rate=4.0, burst=1.0)
    rl.check("k")
    clock.advance(0.1)
    with pytest.raises(Overloaded) as info:
        rl.check("k")
    assert info.value.retry_after_ms == 150  # 0.6 token missing at 4/s
    clock.advance(info.value.retry_after_ms / 1000)
    rl.check("k")


def test_refill_is_capped_at_burst(clock):
    rl = limiter(clock, rate=10.0, burst=2.0)
    clock.advance(3600.0)
    rl.check("k")
    rl.check("k")
    with pytest.raises(Overloaded):
        rl.check("k")


def test_keys_are_isolated_and_overrides_apply(clock):
    rl = limiter(clock, rate=1.0, burst=1.0, per_key={"big": RateLimit(1.0, 5.0)})
    rl.check("small")
    with pytest.raises(Overloaded):
        rl.check("small")
    for _ in range(5):
        rl.check("big")
    rl.check("other")


def test_rejected_requests_do_not_consume_tokens(clock):
    rl = limiter(clock, rate=1.0, burst=1.0)
    rl.check("k")
    for _ in range(5):
        with pytest.raises(Overloaded):
            rl.check("k")
    clock.advance(1.0)
    rl.check("k")


@pytest.mark.parametrize("rate,burst", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.5)])
def test_rate_limit_config_validation(rate, burst):
    value = f"{{rate_per_s: {rate}, burst: {burst}}}"
    with pytest.raises(ConfigError, match="field 'rate_limits.default.(rate_per_s|burst)' breaks rule"):
        gateway_config.load(environ={"KEEL_GATEWAY_RATE_LIMITS__DEFAULT": value})
