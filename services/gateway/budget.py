"""What a call may still spend: retry tokens per upstream, attempts per request, time to the deadline.

- :class:`RetryThrottle` is gRFC A6 retry throttling for one upstream: ``max_tokens`` tokens;
  each failure with a retryable code costs 1, each success gives back ``token_ratio``; a retry
  is allowed only while tokens > max_tokens / 2. Counted in thousandths, as A6 does, so
  repeated +0.1 steps do not drift.
- The previous-attempts helpers mark a retried request, so a stage that receives one never
  retries it again (retries would otherwise multiply down the chain). The marker is sent under
  two names: ``grpc-previous-rpc-attempts`` (the name gRFC A6 gives it) and
  ``x-keel-previous-rpc-attempts``, because grpcio treats ``grpc-*`` keys as reserved and does
  not deliver an application-set ``grpc-previous-rpc-attempts`` to the server handler
  (grpcio 1.85, checked with an in-process server); :func:`is_retry` reads either.
- :class:`LatencyEstimate` keeps an EWMA of successful attempt latency per (upstream, method),
  which the executor uses to refuse a retry that could not finish before the deadline.

Single event loop: nothing here takes a lock.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.gateway.auth import Metadata, header_value

PREVIOUS_ATTEMPTS_KEY = "grpc-previous-rpc-attempts"
KEEL_PREVIOUS_ATTEMPTS_KEY = "x-keel-previous-rpc-attempts"
_MILLI = 1000


@dataclass(frozen=True)
class ThrottleConfig:
    """gRFC A6 ``retryThrottling`` (its bounds: config/schemas/gateway.schema.json, retry.throttle)."""

    max_tokens: float = 10.0
    token_ratio: float = 0.1


class RetryThrottle:
    """A6 token bucket of one upstream."""

    def __init__(self, config: ThrottleConfig):
        self._max = round(config.max_tokens * _MILLI)
        self._ratio = round(config.token_ratio * _MILLI)
        self._tokens = self._max

    @property
    def tokens(self) -> float:
        return self._tokens / _MILLI

    def on_failure(self) -> None:
        """An attempt failed with a retryable code (whether or not it will be retried)."""
        self._tokens = max(0, self._tokens - _MILLI)

    def on_success(self) -> None:
        self._tokens = min(self._max, self._tokens + self._ratio)

    def allows_retry(self) -> bool:
        return 2 * self._tokens > self._max


class ThrottleRegistry:
    """One :class:`RetryThrottle` per upstream name, made on first use."""

    def __init__(self, config: ThrottleConfig):
        self._config = config
        self._throttles: dict[str, RetryThrottle] = {}

    def get(self, upstream: str) -> RetryThrottle:
        throttle = self._throttles.get(upstream)
        if throttle is None:
            throttle = self._throttles[upstream] = RetryThrottle(self._config)
        return throttle



def _count(value: str | None) -> int:
    try:
        return max(int(value), 0) if value is not None else 0
    except ValueError:
        return 0


def previous_attempts(metadata: Metadata) -> int:
    """How many attempts preceded this one, per either marker (0 if absent or junk)."""
    return max(_count(header_value(metadata, PREVIOUS_ATTEMPTS_KEY)),
               _count(header_value(metadata, KEEL_PREVIOUS_ATTEMPTS_KEY)))


def is_retry(metadata: Metadata) -> bool:
    """True when the incoming request is itself a retry; such a request must not be retried again."""
    return previous_attempts(metadata) > 0


def attempt_metadata(previous: int) -> dict[str, str]:
    """Metadata to attach to an attempt that follows ``previous`` earlier attempts."""
    if previous <= 0:
        return {}
    return {PREVIOUS_ATTEMPTS_KEY: str(previous), KEEL_PREVIOUS_ATTEMPTS_KEY: str(previous)}


class LatencyEstimate:
    """EWMA of successful attempt latency, per (upstream, method); 0 until one succeeds."""

    def __init__(self, alpha: float = 0.2):
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self._alpha = alpha
        self._ewma: dict[tuple[str, str], float] = {}

    def observe(self, upstream: str, method: str, seconds: float) -> None:
        key = (upstream, method)
        old = self._ewma.get(key)
        self._ewma[key] = seconds if old is None else old + self._alpha * (seconds - old)

    def expected(self, upstream: str, method: str) -> float:
        return self._ewma.get((upstream, method), 0.0)
