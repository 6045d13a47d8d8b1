"""Watching the gateway's own retries: an interval histogram and two storm alerts.

Every retry the executor makes is reported with the interval it actually waited and the range
its policy drew the delay from (``low``..``high``; equal for the unjittered linear backoff).

- Actual intervals per (upstream, code) go to the ``on_interval`` callback: the gateway observes them
  in the Prometheus histogram keel_retry_interval_seconds (shared/metrics.py: log-spaced buckets
  1 ms .. 60 s).
- Clustering alert, per (upstream, code), over the last ``window`` jittered intervals, when
  either (a) >= 95% of them fall inside one +-5 s band although the policy's own ranges would
  put at most 75% there (a band test is blind when the whole range is narrower than the band,
  as it is for the sub-second backoff), or (b) the Kolmogorov-Smirnov distance of
  (interval - low) / (high - low) from U(0, 1) exceeds 0.1. For (b) the window must hold
  >= 300 samples: the 1% critical KS value is ~1.63/sqrt(n), under 0.1 only from n ~ 266,
  so smaller windows would fire on healthy jitter.
- Rate alert, per upstream, when retries exceed 10% of requests in every 10 s bucket for
  2 minutes (a "for: 2m" rule evaluated as events arrive; an empty bucket ends a breach).

An alert is one WARNING log record (``event="retry_alert"``), +1 on :attr:`RetryMonitor.alerts`
and a call of the injected ``on_alert``. It latches: it fires once when its condition becomes
true and re-arms when the condition clears.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger("keel.gateway.retry")

@dataclass(frozen=True)
class AlertConfig:
    window: int = 500
    min_samples: int = 300
    evaluate_every: int = 25
    band_half_width_s: float = 5.0
    band_fraction: float = 0.95
    band_expected_max: float = 0.75
    ks_threshold: float = 0.1
    rate_threshold: float = 0.1
    rate_for_s: float = 120.0
    rate_bucket_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.min_samples <= self.window or self.evaluate_every < 1:
            raise ValueError("need 0 < min_samples <= window and evaluate_every >= 1")
        if self.rate_bucket_s <= 0 or self.rate_for_s < self.rate_bucket_s:
            raise ValueError("need 0 < rate_bucket_s <= rate_for_s")


@dataclass(frozen=True)
class RetryInterval:
    """One retry's actual wait and the range its policy drew the delay from."""

    actual_s: float
    low_s: float
    high_s: float


@dataclass(frozen=True)
class Alert:
    kind: str  # "retry_clustering" | "retry_rate"
    upstream: str
    code: str  # "" for the rate alert, which spans codes
    detail: dict[str, float] = field(default_factory=dict)


def ks_distance_uniform(samples: Iterable[float]) -> float:
    """Kolmogorov-Smirnov distance between the samples' empirical CDF and U(0, 1)."""
    values = sorted(min(max(v, 0.0), 1.0) for v in samples)
    n = len(values)
    if n == 0:
        raise ValueError("no samples")
    return max(max((i + 1) / n - v, v - i / n) for i, v in enumerate(values))


def densest_band(values: Sequence[float], half_width: float) -> tuple[float, float]:
    """(start, fraction): the [start, start + 2*half_width] band holding the most values."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    best_start, best_count, j = ordered[0], 0, 0
    for i, start in enumerate(ordered):
        j = max(j, i)
        while j < len(ordered) and ordered[j] <= start + 2 * half_width:
            j += 1
        if j - i > best_count:
            best_start, best_count = start, j - i
    return best_start, best_count / len(ordered)


def expected_band_fraction(intervals: Sequence[RetryInterval], lo: float, hi: float) -> float:
    """Share of intervals the policy's own ranges would put in [lo, hi] (uniform draws)."""
    total = 0.0
    for iv in intervals:
        if iv.high_s > iv.low_s:
            total += max(0.0, min(hi, iv.high_s) - max(lo, iv.low_s)) / (iv.high_s - iv.low_s)
        else:
            total += 1.0 if lo <= iv.low_s <= hi else 0.0
    return total / len(intervals)


def clustering_signals(intervals: Sequence[RetryInterval], config: AlertConfig) -> dict[str, float]:
    """The band and KS statistics of a window of jittered intervals, plus whether each trips."""
    start, observed = densest_band([iv.actual_s for iv in intervals], config.band_half_width_s)
    expected = expected_band_fraction(intervals, start, start + 2 * config.band_half_width_s)
    ks = ks_distance_uniform((iv.actual_s - iv.low_s) / (iv.high_s - iv.low_s) for iv in intervals)
    return {
        "band_start_s": start, "band_fraction": observed, "band_expected": expected,
        "ks_distance": ks, "samples": float(len(intervals)),
        "band_trips": float(observed >= config.band_fraction and expected <= config.band_expected_max),
        "ks_trips": float(ks > config.ks_threshold),
    }


class _RateState:
    def __init__(self, start: float):
        self.bucket_start = start
        self.requests = 0
        self.retries = 0
        self.breach_since: float | None = None
        self.firing = False


class RetryMonitor:
    """Clustering and rate alerts over the executor's retries, each interval handed to ``on_interval``;
    clock injected."""

    def __init__(self, config: AlertConfig, clock: Callable[[], float], *,
                 on_interval: Callable[[str, str, float], None] | None = None,
                 on_alert: Callable[[Alert], None] | None = None):
        self._config = config
        self._clock = clock
        self._on_interval = on_interval
        self._on_alert = on_alert
        self._windows: dict[tuple[str, str], deque[RetryInterval]] = {}
        self._since_eval: dict[tuple[str, str], int] = {}
        self._clustering: set[tuple[str, str]] = set()
        self._rates: dict[str, _RateState] = {}
        self.alerts: dict[tuple[str, str, str], int] = {}

    def record_request(self, upstream: str) -> None:
        """A call entered the executor (the denominator of the retry rate)."""
        self._rate(upstream).requests += 1

    def record_retry(self, upstream: str, code: str, interval: RetryInterval) -> None:
        """A retry was made after waiting ``interval.actual_s``."""
        self._rate(upstream).retries += 1
        key = (upstream, code)
        if self._on_interval is not None:
            self._on_interval(upstream, code, interval.actual_s)
        if interval.high_s > interval.low_s:
            self._observe_jittered(key, interval)

    def _observe_jittered(self, key: tuple[str, str], interval: RetryInterval) -> None:
        cfg = self._config
        window = self._windows.setdefault(key, deque(maxlen=cfg.window))
        window.append(interval)
        self._since_eval[key] = self._since_eval.get(key, 0) + 1
        if len(window) < cfg.min_samples or self._since_eval[key] < cfg.evaluate_every:
            return
        self._since_eval[key] = 0
        signals = clustering_signals(list(window), cfg)
        if signals["band_trips"] or signals["ks_trips"]:
            if key not in self._clustering:
                self._clustering.add(key)
                self._fire(Alert("retry_clustering", key[0], key[1], signals))
        else:
            self._clustering.discard(key)

    def _rate(self, upstream: str) -> _RateState:
        """The upstream's rate state with its current bucket rolled forward to now."""
        now = self._clock()
        cfg = self._config
        state = self._rates.get(upstream)
        if state is None:
            state = self._rates[upstream] = _RateState(now)
        while now >= state.bucket_start + cfg.rate_bucket_s:
            breaching = state.requests > 0 and state.retries / state.requests > cfg.rate_threshold
            if breaching and state.breach_since is None:
                state.breach_since = state.bucket_start
            elif not breaching:
                state.breach_since, state.firing = None, False
            state.bucket_start += cfg.rate_bucket_s
            if (state.breach_since is not None and not state.firing
                    and state.bucket_start - state.breach_since >= cfg.rate_for_s):
                state.firing = True
                self._fire(Alert("retry_rate", upstream, "", {
                    "retry_ratio_last_bucket": state.retries / state.requests,
                    "breach_s": state.bucket_start - state.breach_since}))
            state.requests = state.retries = 0
            if now >= state.bucket_start + cfg.rate_bucket_s:
                # The buckets up to now are empty: the breach is over; skip them in one step.
                state.breach_since, state.firing = None, False
                skipped = (now - state.bucket_start) // cfg.rate_bucket_s
                state.bucket_start += skipped * cfg.rate_bucket_s
        return state

    def _fire(self, alert: Alert) -> None:
        key = (alert.kind, alert.upstream, alert.code)
        self.alerts[key] = self.alerts.get(key, 0) + 1
        log.warning("retry alert %s on %s %s", alert.kind, alert.upstream, alert.code, extra={
            "event": "retry_alert", "alert": alert.kind, "upstream": alert.upstream,
            "code": alert.code, **alert.detail})
        if self._on_alert is not None:
            self._on_alert(alert)
