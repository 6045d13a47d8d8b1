"""A6 retry tokens, the previous-attempts metadata helpers and the latency estimate."""
from __future__ import annotations

import pytest

from services.gateway import config as gateway_config
from services.gateway.budget import (
    KEEL_PREVIOUS_ATTEMPTS_KEY,
    PREVIOUS_ATTEMPTS_KEY,
    LatencyEstimate,
    RetryThrottle,
    ThrottleConfig,
    ThrottleRegistry,
    attempt_metadata,
    is_retry,
    previous_attempts,
)
from shared.config import ConfigError


def test_throttle_costs_and_refunds():
    t = RetryThrottle(ThrottleConfig())
    assert t.tokens == 10.0 and t.allows_retry()
    t.on_failure()
    assert t.tokens == 9.0
    t.on_success()
    assert t.tokens == 9.1


def test_throttle_threshold_is_strictly_above_half():
    t = RetryThrottle(ThrottleConfig())
    for _ in range(5):
        t.on_failure()
    assert t.tokens == 5.0 and not t.allows_retry()
    t.on_success()
    assert t.tokens == 5.1 and t.allows_retry()


def test_throttle_is_bounded_and_does_not_drift():
    t = RetryThrottle(ThrottleConfig())
    for _ in range(30):
        t.on_failure()
    assert t.tokens == 0.0
    for _ in range(100):
        t.on_success()
    assert t.tokens == 10.0  # exactly: 100 * 0.1 in float would not be
    t.on_success()
    assert t.tokens == 10.0


def test_registry_keeps_one_bucket_per_upstream():
    reg = ThrottleRegistry(ThrottleConfig(max_tokens=4, token_ratio=0.5))
    reg.get("tokenizer").on_failure()
    assert reg.get("tokenizer") is reg.get("tokenizer")
    assert reg.get("tokenizer").tokens == 3.0
    assert reg.get("inference").tokens == 4.0


@pytest.mark.parametrize("key,value", [("max_tokens", "0"), ("max_tokens", "1001"), ("token_ratio", "0")])
def test_throttle_config_rejects_out_of_range(key, value):
    with pytest.raises(ConfigError, match=f"field 'retry.throttle.{key}' breaks rule"):
        gateway_config.load(environ={f"KEEL_GATEWAY_RETRY__THROTTLE__{key.upper()}": value})


@pytest.mark.parametrize("metadata,count", [
    (None, 0),
    ({}, 0),
    ({PREVIOUS_ATTEMPTS_KEY: "2"}, 2),
    (((PREVIOUS_ATTEMPTS_KEY, "1"),), 1),
    ((("Grpc-Previous-Rpc-Attempts", b"3"),), 3),
    ((("x-other", "5"),), 0),
    ({PREVIOUS_ATTEMPTS_KEY: "abc"}, 0),
    ({PREVIOUS_ATTEMPTS_KEY: "-4"}, 0),
    ({PREVIOUS_ATTEMPTS_KEY: ""}, 0),
    ({KEEL_PREVIOUS_ATTEMPTS_KEY: "1"}, 1),
    ({PREVIOUS_ATTEMPTS_KEY: "junk", KEEL_PREVIOUS_ATTEMPTS_KEY: "2"}, 2),
])
def test_previous_attempts_and_is_retry(metadata, count):
    assert previous_attempts(metadata) == count
    assert is_retry(metadata) == (count > 0)


def test_attempt_metadata_marks_only_retries():
    assert attempt_metadata(0) == {}
    assert attempt_metadata(2) == {PREVIOUS_ATTEMPTS_KEY: "2", KEEL_PREVIOUS_ATTEMPTS_KEY: "2"}
    assert is_retry(attempt_metadata(1)) and not is_retry(attempt_metadata(0))


def test_latency_estimate_is_an_ewma_per_upstream_and_method():
    est = LatencyEstimate(alpha=0.2)
    assert est.expected("tokenizer", "Tokenize") == 0.0
    est.observe("tokenizer", "Tokenize", 0.1)
    est.observe("tokenizer", "Tokenize", 0.2)
    assert est.expected("tokenizer", "Tokenize") == pytest.approx(0.12)
    assert est.expected("tokenizer", "Detokenize") == 0.0


@pytest.mark.parametrize("alpha", [0.0, 1.5])
def test_latency_estimate_rejects_bad_alpha(alpha):
    with pytest.raises(ValueError):
        LatencyEstimate(alpha=alpha)
