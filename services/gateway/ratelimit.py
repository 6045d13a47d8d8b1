"""Per-API-key rate limits and failed-authentication limits per peer, checked by the gateway
before any work (request sizes and ranges: services/gateway/contract.py).

Rate limits are token buckets per key id: ``burst`` requests at once, refilled at
``rate_per_s``. A request that finds no whole token gets Overloaded(reason="RATE_LIMITED")
with ``retry_after_ms`` = the time until one token is back, rounded up, so a client that
honours the hint succeeds on its next try (absent other traffic on the key).

Failed authentications are limited per peer address (the port is ignored, so new connections
do not help), and by a second limiter per key prefix (services/gateway/auth.py): after
``max_failures`` failures a peer is refused for ``backoff_base_s``, doubled with each further
failure up to ``backoff_cap_s``, with Overloaded(reason=AUTH_FAILURES_LIMITED) and the time left
as ``retry_after_ms``. While blocked its requests are refused before any key is checked, so
guesses are not even tried, and each such try counts as a further failure (the caller does that),
so a client that ignores the hint is blocked ever longer. ``window_s`` without a failure after the last block
ended forgets the failures (a success does not: interleaving a valid key would otherwise reset
the count). At most ``max_peers`` peers are tracked (the one idle
longest is forgotten first), so many addresses cannot exhaust memory.

Many clients can share one address (a NAT, a proxy), so a block must not cut off the other keys
behind it: the limiter remembers, per address, the key ids that authenticated from it (at most
``max_keys_per_peer``, the least recent forgotten first), and while the address is blocked a
request presenting one of those keys is still admitted (then limited by its own key's bucket,
as every request is). Any other request from a blocked address is refused without trying its
key against the rest, so guessing stays cut off.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from shared.errors import AUTH_FAILURES_LIMITED, Overloaded


@dataclass(frozen=True)
class RateLimit:
    """One key's bucket (its bounds: config/schemas/gateway.schema.json, $defs.rate)."""

    rate_per_s: float
    burst: float


@dataclass(frozen=True)
class RateLimitConfig:
    default: RateLimit = RateLimit(rate_per_s=10.0, burst=20.0)
    per_key: Mapping[str, RateLimit] = field(default_factory=dict)


class RateLimiter:
    """Token bucket per key id; clock injectable. Buckets exist only for keys seen."""

    def __init__(self, config: RateLimitConfig, *, clock: Callable[[], float] = time.monotonic):
        self._config = config
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key_id -> (tokens, at)

    def check(self, key_id: str) -> None:
        """Take one token for ``key_id``, or raise Overloaded RATE_LIMITED with a retry hint."""
        limit = self._config.per_key.get(key_id, self._config.default)
        now = self.clock()
        tokens, at = self._buckets.get(key_id, (limit.burst, now))
        tokens = min(limit.burst, tokens + (now - at) * limit.rate_per_s)
        if tokens >= 1.0:
            self._buckets[key_id] = (tokens - 1.0, now)
            return
        self._buckets[key_id] = (tokens, now)
        wait_ms = math.ceil((1.0 - tokens) / limit.rate_per_s * 1000.0)
        raise Overloaded(f"rate limit of {limit.rate_per_s:g}/s (burst {limit.burst:g}) reached",
                         reason="RATE_LIMITED", retry_after_ms=wait_ms,
                         metadata={"key_id": key_id, "rate_per_s": f"{limit.rate_per_s:g}"})


@dataclass(frozen=True)
class AuthFailureLimit:
    max_failures: int = 10
    window_s: float = 60.0
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 300.0
    max_peers: int = 10_000
    max_keys_per_peer: int = 64

    def __post_init__(self) -> None:
        # Each field's own bounds are config/schemas/gateway.schema.json's; this is the rule between two.
        if self.backoff_cap_s < self.backoff_base_s:
            raise ValueError(f"an auth failure limit needs backoff_base_s <= backoff_cap_s: {self}")


@dataclass
class _Peer:
    failures: int = 0
    last_s: float = 0.0          # when the last failure happened or the last block ends
    blocked_until: float = 0.0
    keys: OrderedDict[str, None] = field(default_factory=OrderedDict)  # key ids that authenticated here


class AuthFailureLimiter:
    """Counts failed authentications per peer host and blocks a peer with backoff; clock
    injectable."""

    def __init__(self, limit: AuthFailureLimit, *, clock: Callable[[], float] = time.monotonic,
                 subject: str = "this address"):
        self.limit, self.clock, self.subject = limit, clock, subject  # subject: what a refusal names
        self._peers: OrderedDict[str, _Peer] = OrderedDict()

    def refusal(self, peer: str) -> Overloaded | None:
        """The AUTH_FAILURES_LIMITED error (with the time left) while ``peer`` is blocked, else None."""
        state = self._peers.get(peer)
        now = self.clock()
        if state is None or now >= state.blocked_until:
            return None
        wait_ms = math.ceil((state.blocked_until - now) * 1000.0)
        return Overloaded(f"{state.failures} failed authentications from {self.subject}; "
                          f"try again in {wait_ms} ms", reason=AUTH_FAILURES_LIMITED,
                          retry_after_ms=wait_ms, metadata={"failures": state.failures})

    def known_keys(self, peer: str) -> frozenset[str]:
        """Key ids that authenticated from ``peer`` (admitted even while it is blocked)."""
        state = self._peers.get(peer)
        return frozenset(state.keys) if state is not None else frozenset()

    def succeeded(self, peer: str, key_id: str) -> None:
        """Remember that ``key_id`` authenticated from ``peer`` (the failure count is kept)."""
        state = self._peers.pop(peer, None) or _Peer()
        state.keys.pop(key_id, None)
        state.keys[key_id] = None
        while len(state.keys) > self.limit.max_keys_per_peer:
            state.keys.popitem(last=False)
        self._remember(peer, state)

    def failed(self, peer: str) -> None:
        """Count one failed authentication of ``peer``; block it once over the limit."""
        limit, now = self.limit, self.clock()
        state = self._peers.pop(peer, None) or _Peer()
        if now - state.last_s > limit.window_s:
            state.failures = 0
        state.failures += 1
        state.last_s = now
        over = state.failures - limit.max_failures
        if over >= 0:
            state.blocked_until = now + min(limit.backoff_cap_s, limit.backoff_base_s * 2.0 ** min(over, 64))
            state.last_s = state.blocked_until
        self._remember(peer, state)

    def _remember(self, peer: str, state: _Peer) -> None:
        self._peers[peer] = state
        while len(self._peers) > self.limit.max_peers:
            self._peers.popitem(last=False)
