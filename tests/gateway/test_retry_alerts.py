"""Retry intervals to the exporter, the clustering alert and the 10%-for-2-minutes alert."""
from __future__ import annotations

import logging
import math
import random

import pytest

from services.gateway.retry_alerts import (
    AlertConfig,
    RetryInterval,
    RetryMonitor,
    clustering_signals,
    densest_band,
    expected_band_fraction,
    ks_distance_uniform,
)

CFG = AlertConfig()
CLUSTER = ("retry_clustering", "tokenizer", "UNAVAILABLE")


def monitor(clock, **kw):
    alerts = []
    mon = RetryMonitor(kw.pop("config", CFG), clock, on_alert=alerts.append, **kw)
    return mon, alerts


def test_every_retry_interval_goes_to_the_exporter(clock):
    seen = []
    mon, _ = monitor(clock, on_interval=lambda *a: seen.append(a))
    for s in (0.0005, 0.05, 100.0):
        mon.record_retry("tokenizer", "UNAVAILABLE", RetryInterval(s, s, s))
    mon.record_retry("inference", "RESOURCE_EXHAUSTED", RetryInterval(2.0, 2.0, 2.0))
    assert seen == [("tokenizer", "UNAVAILABLE", 0.0005), ("tokenizer", "UNAVAILABLE", 0.05),
                    ("tokenizer", "UNAVAILABLE", 100.0), ("inference", "RESOURCE_EXHAUSTED", 2.0)]


def test_ks_distance_known_values():
    assert ks_distance_uniform([0.5]) == 0.5
    assert ks_distance_uniform([(i + 0.5) / 10 for i in range(10)]) == pytest.approx(0.05)
    assert ks_distance_uniform([1.0] * 10) == 1.0
    with pytest.raises(ValueError):
        ks_distance_uniform([])


def test_densest_band_and_expected_fraction():
    assert densest_band([0, 1, 2, 20, 21], 1.0) == (0, 0.6)
    with pytest.raises(ValueError):
        densest_band([], 1.0)
    ivs = [RetryInterval(0.3, 0.0, 1.0), RetryInterval(3.0, 3.0, 3.0)]
    assert expected_band_fraction(ivs, 0.0, 0.5) == pytest.approx(0.25)  # (0.5 + 0) / 2
    assert expected_band_fraction(ivs, 0.0, 5.0) == pytest.approx(1.0)


def jittered(rng, n, low, high):
    return [RetryInterval(rng.uniform(low, high), low, high) for _ in range(n)]


def test_signals_healthy_jitter_trips_nothing():
    rng = random.Random(7)
    backoff = [RetryInterval(rng.uniform(0, hi), 0.0, hi) for hi in (0.1, 0.2) * 250]
    pushback = jittered(rng, 500, 30.0, 45.0)
    for window in (backoff, pushback):
        sig = clustering_signals(window, CFG)
        assert sig["ks_distance"] < 0.1 and not sig["band_trips"] and not sig["ks_trips"]


def test_signals_band_trips_for_synchronized_long_waits():
    rng = random.Random(3)
    # Allowed 30..45 s, but every client waited 30..33 s: synchronized.
    window = [RetryInterval(rng.uniform(30.0, 33.0), 30.0, 45.0) for _ in range(400)]
    sig = clustering_signals(window, CFG)
    assert sig["band_fraction"] == 1.0 and sig["band_expected"] == pytest.approx(2 / 3, abs=0.01)
    assert sig["band_trips"] and sig["ks_trips"]


def test_band_test_is_blind_below_its_width():
    # Sub-second backoff always sits inside one +-5 s band; only KS can judge it.
    rng = random.Random(4)
    sig = clustering_signals(jittered(rng, 400, 0.0, 1.0), CFG)
    assert sig["band_fraction"] == 1.0 and not sig["band_trips"]


def test_clustering_alert_fires_once_for_synchronized_intervals(clock, caplog):
    caplog.set_level(logging.WARNING, logger="keel.gateway.retry")
    mon, alerts = monitor(clock)
    for _ in range(CFG.window):  # jitter lost: every wait is the full backoff
        mon.record_retry("tokenizer", "UNAVAILABLE", RetryInterval(0.1, 0.0, 0.1))
    assert mon.alerts == {CLUSTER: 1} and len(alerts) == 1
    assert alerts[0].kind == "retry_clustering" and alerts[0].detail["ks_distance"] == 1.0
    (rec,) = [r for r in caplog.records if getattr(r, "event", None) == "retry_alert"]
    assert (rec.alert, rec.upstream, rec.code) == CLUSTER


def test_clustering_alert_needs_min_samples(clock):
    mon, alerts = monitor(clock)
    for _ in range(CFG.min_samples - 1):
        mon.record_retry("tokenizer", "UNAVAILABLE", RetryInterval(0.1, 0.0, 0.1))
    assert alerts == []


def test_uniform_jitter_does_not_fire(clock):
    mon, alerts = monitor(clock)
    rng = random.Random(11)
    for _ in range(3000):
        hi = rng.choice((0.1, 0.2))
        mon.record_retry("tokenizer", "UNAVAILABLE", RetryInterval(rng.uniform(0, hi), 0.0, hi))
    assert alerts == [] and mon.alerts == {}


def test_unjittered_linear_waits_are_not_judged(clock):
    mon, alerts = monitor(clock)
    for _ in range(1000):
        mon.record_retry("tokenizer", "DEADLINE_EXCEEDED", RetryInterval(0.05, 0.05, 0.05))
    assert alerts == []
    assert mon.alerts == {}


def test_clustering_alert_rearms_after_recovery(clock):
    mon, alerts = monitor(clock)
    rng = random.Random(5)
    for phase in ("bad", "good", "bad"):
        for _ in range(CFG.window):
            actual = 0.1 if phase == "bad" else rng.uniform(0, 0.1)
            mon.record_retry("tokenizer", "UNAVAILABLE", RetryInterval(actual, 0.0, 0.1))
    assert mon.alerts == {CLUSTER: 2}


def drive_rate(clock, mon, *, seconds, per_s=10, retries_per_s=2):
    """One second at a time: per_s requests and retries_per_s retries on the tokenizer."""
    fired_at = []
    for _ in range(seconds):
        before = sum(mon.alerts.values())
        for _ in range(per_s):
            mon.record_request("tokenizer")
        for _ in range(retries_per_s):
            mon.record_retry("tokenizer", "UNAVAILABLE", RetryInterval(0.05, 0.05, 0.05))
        if sum(mon.alerts.values()) > before:
            fired_at.append(clock.now)
        clock.advance(1.0)
    return fired_at


def test_rate_alert_fires_after_two_minutes_above_ten_percent(clock):
    mon, alerts = monitor(clock)
    start = clock.now
    fired = drive_rate(clock, mon, seconds=300)
    assert fired == [start + 120.0]  # once, when 12 breaching 10 s buckets have closed
    assert alerts[0].kind == "retry_rate" and alerts[0].detail["retry_ratio_last_bucket"] == 0.2
    assert mon.alerts == {("retry_rate", "tokenizer", ""): 1}


def test_rate_alert_quiet_at_ten_percent_or_below(clock):
    mon, _ = monitor(clock)
    assert drive_rate(clock, mon, seconds=300, retries_per_s=1) == []


def test_rate_alert_needs_the_breach_to_last(clock):
    mon, _ = monitor(clock)
    assert drive_rate(clock, mon, seconds=100) == []
    assert drive_rate(clock, mon, seconds=30, retries_per_s=0) == []
    assert drive_rate(clock, mon, seconds=100) == []


def test_rate_alert_breach_ends_in_a_traffic_gap_and_rearms(clock):
    mon, _ = monitor(clock)
    assert drive_rate(clock, mon, seconds=110) == []
    clock.advance(60.0)  # no traffic at all
    first = drive_rate(clock, mon, seconds=150)
    assert len(first) == 1
    assert drive_rate(clock, mon, seconds=20, retries_per_s=0) == []
    assert len(drive_rate(clock, mon, seconds=150)) == 1
    assert mon.alerts == {("retry_rate", "tokenizer", ""): 2}


@pytest.mark.parametrize("kwargs", [
    {"min_samples": 0}, {"min_samples": 600}, {"evaluate_every": 0},
    {"rate_bucket_s": 0.0}, {"rate_bucket_s": 30.0, "rate_for_s": 10.0},
])
def test_alert_config_rejects_nonsense(kwargs):
    with pytest.raises(ValueError):
        AlertConfig(**kwargs)


def test_min_samples_keeps_ks_false_alarms_rare():
    # The documented reason for min_samples=300: healthy jitter stays under 0.1 at that size.
    rng = random.Random(99)
    distances = [ks_distance_uniform(rng.random() for _ in range(CFG.min_samples)) for _ in range(200)]
    assert sum(d > CFG.ks_threshold for d in distances) <= 2
    assert 1.63 / math.sqrt(CFG.min_samples) < CFG.ks_threshold
