"""Graded circuit breakers, one per error kind, with an injectable clock.

Each kind counts its failures in a sliding window; reaching the threshold raises its level by one:
  1  adjust parameters: temperature capped, logits clamped
  2  adjust architecture: smaller max batch, fallback format for new requests
  3  reject new requests with NotReady(reason="CIRCUIT_OPEN")
After a quiet period without failures of that kind the level steps down by one ("half_open" while
above 0); any failure while half open climbs straight back up. The engine applies the highest level.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from shared.failures import FailureKind

log = logging.getLogger(__name__)

KINDS = tuple(FailureKind)  # one breaker each; BreakerConfig has a TripRule field per kind
MAX_LEVEL = 3


@dataclass(frozen=True)
class TripRule:
    window_s: float = 60.0
    threshold: int = 5


@dataclass(frozen=True)
class BreakerConfig:
    numerical_instability: TripRule = field(default_factory=lambda: TripRule(60.0, 3))
    oom: TripRule = field(default_factory=lambda: TripRule(60.0, 3))
    timeout: TripRule = field(default_factory=lambda: TripRule(60.0, 20))
    output_limit: TripRule = field(default_factory=lambda: TripRule(60.0, 20))
    quiet_period_s: float = 300.0
    temperature_cap: float = 0.3
    logit_clamp: float = 10.0
    degraded_max_batch_size: int = 4
    fallback_format: str | None = None  # used for new requests at level >= 2; None keeps the format


@dataclass(frozen=True)
class Policy:
    """What the current level asks of the engine."""

    level: int
    temperature_cap: float | None
    logit_clamp: float | None
    max_batch_size: int | None
    use_fallback: bool
    reject: bool
    retry_after_ms: int


@dataclass(frozen=True)
class BreakerState:
    level: int
    state: str                  # closed | open | half_open
    recent_failures: int        # in the current window
    total_failures: int
    last_cause: str
    seconds_to_step_down: float


class _Breaker:
    def __init__(self, kind: str, rule: TripRule, quiet_s: float, now: float):
        self.kind, self.rule, self.quiet_s = kind, rule, quiet_s
        self.level = 0
        self.state = "closed"
        self.failures: deque[float] = deque()
        self.total = 0
        self.changed_at = now
        self.last_failure = float("-inf")
        self.cause = ""

    def record(self, now: float, cause: str) -> None:
        self.total += 1
        self.last_failure = now
        self.failures.append(now)
        while self.failures and self.failures[0] <= now - self.rule.window_s:
            self.failures.popleft()
        if self.state == "half_open":
            self._move(self.level + 1, now, f"failure while half open: {cause}")
        elif len(self.failures) >= self.rule.threshold and self.level < MAX_LEVEL:
            self._move(self.level + 1, now, f"{len(self.failures)} failures in {self.rule.window_s:g}s: {cause}")

    def tick(self, now: float) -> None:
        if self.level and now - max(self.changed_at, self.last_failure) >= self.quiet_s:
            self._move(self.level - 1, now, f"quiet for {self.quiet_s:g}s")

    def seconds_to_step_down(self, now: float) -> float:
        return max(0.0, max(self.changed_at, self.last_failure) + self.quiet_s - now)

    def _move(self, level: int, now: float, cause: str) -> None:
        old_level, old_state = self.level, self.state
        self.level = min(level, MAX_LEVEL)
        if self.level > old_level:
            self.state = "open"
        else:
            self.state = "half_open" if self.level else "closed"
        self.failures.clear()
        self.changed_at = now
        self.cause = cause
        log.warning("circuit breaker %s: level %d -> %d (%s)", self.kind, old_level, self.level, cause,
                    extra={"breaker": self.kind, "from_level": old_level, "to_level": self.level,
                           "from_state": old_state, "to_state": self.state, "cause": cause})

    def snapshot(self, now: float) -> BreakerState:
        return BreakerState(self.level, self.state, len(self.failures), self.total, self.cause,
                            round(self.seconds_to_step_down(now), 3) if self.level else 0.0)


class BreakerBoard:
    """The four breakers; thread-safe. `policy()` also performs due step-downs."""

    def __init__(self, config: BreakerConfig, max_batch_size: int,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.max_batch_size = max_batch_size
        self.clock = clock
        self._lock = threading.Lock()
        now = clock()
        self._breakers = {k: _Breaker(k, getattr(config, k), config.quiet_period_s, now) for k in KINDS}

    def record(self, kind: str, cause: str = "") -> None:
        if kind not in self._breakers:
            raise ValueError(f"unknown breaker kind {kind!r}; expected one of {KINDS}")
        with self._lock:
            now = self.clock()
            self._breakers[kind].tick(now)
            self._breakers[kind].record(now, cause or kind)

    def policy(self) -> Policy:
        with self._lock:
            now = self.clock()
            for b in self._breakers.values():
                b.tick(now)
            level = max(b.level for b in self._breakers.values())
            top = [b for b in self._breakers.values() if b.level == MAX_LEVEL]
            retry_s = max((b.seconds_to_step_down(now) for b in top), default=0.0)
        c = self.config
        return Policy(
            level=level,
            temperature_cap=c.temperature_cap if level >= 1 else None,
            logit_clamp=c.logit_clamp if level >= 1 else None,
            max_batch_size=min(c.degraded_max_batch_size, self.max_batch_size) if level >= 2 else None,
            use_fallback=level >= 2 and c.fallback_format is not None,
            reject=level >= MAX_LEVEL,
            retry_after_ms=round(retry_s * 1000),
        )

    def snapshot(self) -> Mapping[str, BreakerState]:
        """Every breaker's state by kind (an immutable view)."""
        with self._lock:
            now = self.clock()
            for b in self._breakers.values():
                b.tick(now)
            return MappingProxyType({k: b.snapshot(now) for k, b in self._breakers.items()})
