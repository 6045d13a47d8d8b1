"""shared/metrics.py: the catalogue, per-stage registration, SlidingWindowGauge and the /metrics server."""
from __future__ import annotations

import math
import threading
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shared import metrics
from shared.errors import InvalidInput
from shared.metrics import CATALOGUE, SPECS, SlidingWindowGauge, log_buckets, metrics_for, start_metrics_server

ROOT = Path(__file__).resolve().parents[2]

# The assignment's list: every name with its labels must be in the catalogue.
REQUIRED = {
    "keel_requests_total": ("service", "method", "code"),
    "keel_request_duration_seconds": ("service", "method"),
    "keel_retries_total": ("upstream", "code", "decision", "reason"),
    "keel_retry_interval_seconds": ("upstream", "code"),
    "keel_retry_alerts_total": ("upstream", "kind"),
    "keel_tokenizer_latency_seconds": ("op",),
    "keel_tokenizer_truncations_total": (),
    "keel_inference_queue_depth": (),
    "keel_inference_running_batch_size": (),
    "keel_inference_ttft_seconds": (),
    "keel_inference_itl_seconds": (),
    "keel_inference_generated_tokens_total": (),
    "keel_inference_predicted_memory_bytes": (),
    "keel_inference_memory_budget_bytes": (),
    "keel_inference_breaker_level": ("error_type",),
    "keel_inference_numerical_faults_total": (),
    "keel_inference_oom_recoveries_total": (),
    "keel_validator_verdicts_total": ("plugin", "outcome"),
    "keel_validator_outputs_total": (),
    "keel_validator_empty_outputs_total": (),
    "keel_validator_empty_response_rate": (),
    "keel_validator_output_entropy_mean": (),
    "keel_validator_output_length_tokens": (),
    "keel_validator_low_confidence_total": (),
    "keel_validator_quarantine_size": (),
    "keel_validator_spill_backlog": (),
    "keel_supervisor_restarts_total": ("stage",),
    "keel_stage_serving": ("service",),
}


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def exposed(registry: CollectorRegistry) -> dict[str, float]:
    """Every sample of the registry as {name{labels}: value}."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


# --- catalogue ---------------------------------------------------------------------------------

def test_catalogue_has_every_required_metric_with_its_labels():
    assert {name: SPECS[name].labels for name in REQUIRED if name in SPECS} == REQUIRED


def test_catalogue_names_are_unique_prefixed_and_typed():
    names = [s.name for s in CATALOGUE]
    assert len(names) == len(set(names))
    for s in CATALOGUE:
        assert s.name.startswith("keel_"), s.name
        assert s.kind in metrics.KINDS, s.name
        assert s.owner in (metrics.COMMON, *metrics.STAGES), s.name
        assert s.help and len(s.help) > 15, s.name
        assert s.name.endswith("_total") == (s.kind == "counter"), s.name
        assert (s.buckets is not None) == (s.kind == "histogram"), s.name
        assert not s.windowed or (s.kind == "gauge" and not s.labels), s.name


def test_specified_histograms_use_log_spaced_1ms_to_60s_buckets():
    for name in ("keel_request_duration_seconds", "keel_retry_interval_seconds"):
        b = SPECS[name].buckets
        assert b[0] == 0.001 and b[-1] == 60.0
        ratios = [hi / lo for lo, hi in zip(b[:-2], b[1:-1])]
        assert all(1.7 < r < 1.85 for r in ratios), ratios  # 10 ** 0.25 = 1.778, up to rounding


def test_sample_names_of_a_histogram_are_its_series():
    assert SPECS["keel_inference_ttft_seconds"].sample_names() == (
        "keel_inference_ttft_seconds_bucket", "keel_inference_ttft_seconds_sum", "keel_inference_ttft_seconds_count")
    assert SPECS["keel_requests_total"].sample_names() == ("keel_requests_total",)


@pytest.mark.parametrize("low,high,per_decade", [(0, 1, 4), (-1, 1, 4), (2, 1, 4), (1, 1, 4), (0.1, 1, 0)])
def test_log_buckets_rejects_bad_ranges(low, high, per_decade):
    with pytest.raises(InvalidInput) as exc:
        log_buckets(low, high, per_decade)
    assert exc.value.reason == "INVALID_BUCKETS"


def test_log_buckets_ends_exactly_at_high_and_increases():
    b = log_buckets(0.01, 5.0, 2)
    assert b == (0.01, 0.0316, 0.1, 0.316, 1.0, 3.16, 5.0)


# --- per-stage registration --------------------------------------------------------------------

def test_each_stage_gets_common_plus_only_its_own_metrics():
    registry = CollectorRegistry()
    tok = metrics_for("tokenizer", registry)
    assert "keel_requests_total" in tok and "keel_tokenizer_truncations_total" in tok
    assert not any(name.startswith(("keel_inference_", "keel_validator_", "keel_supervisor_")) for name in tok)
    text = generate_latest(registry).decode()
    assert "keel_inference_queue_depth" not in text


def test_two_stages_on_one_registry_share_common_metrics():
    registry = CollectorRegistry()
    inf = metrics_for("inference", registry)
    val = metrics_for("validator", registry)
    assert inf["keel_requests_total"] is val["keel_requests_total"]
    assert metrics_for("inference", registry)["keel_inference_queue_depth"] is inf["keel_inference_queue_depth"]


def test_unknown_stage_is_invalid_input():
    with pytest.raises(InvalidInput) as exc:
        metrics_for("gatewya", CollectorRegistry())
    assert exc.value.reason == "UNKNOWN_STAGE"


def test_asking_for_another_stages_metric_names_its_owner():
    m = metrics_for("gateway", CollectorRegistry())
    with pytest.raises(KeyError, match="belongs to inference"):
        m["keel_inference_queue_depth"]
    with pytest.raises(KeyError, match="not in the catalogue"):
        m["keel_made_up_total"]


def test_typed_getters_check_the_kind():
    m = metrics_for("inference", CollectorRegistry())
    with pytest.raises(TypeError, match="is a gauge, not a counter"):
        m.counter("keel_inference_queue_depth")
    m.counter("keel_inference_generated_tokens_total").inc(5)
    m.histogram("keel_inference_ttft_seconds").observe(0.2)
    m.gauge("keel_inference_breaker_level").labels(error_type="oom").set(3)
    samples = exposed(m.registry)
    assert samples["keel_inference_generated_tokens_total{}"] == 5
    assert samples["keel_inference_ttft_seconds_bucket{le=0.316}"] == 1
    assert samples["keel_inference_ttft_seconds_bucket{le=0.178}"] == 0
    assert samples["keel_inference_breaker_level{error_type=oom}"] == 3


def test_windowed_gauges_read_nan_until_fed():
    m = metrics_for("validator", CollectorRegistry())
    assert math.isnan(exposed(m.registry)["keel_validator_empty_response_rate{}"])


# --- SlidingWindowGauge ------------------------------------------------------------------------

def window(window_s: float = 60.0, slots: int = 6) -> tuple[SlidingWindowGauge, FakeClock, CollectorRegistry]:
    registry, clock = CollectorRegistry(), FakeClock()
    m = metrics_for("validator", registry)
    return SlidingWindowGauge(m.gauge("keel_validator_empty_response_rate"), window_s, slots, clock), clock, registry


def test_window_mean_is_exported_as_the_gauge():
    g, _clock, registry = window()
    for v in (1.0, 0.0, 0.0, 0.0):
        g.observe(v)
    assert g.value() == 0.25
    assert exposed(registry)["keel_validator_empty_response_rate{}"] == 0.25


def test_old_slots_leave_the_window_and_it_decays_to_nan_without_traffic():
    g, clock, _ = window(window_s=60, slots=6)
    g.observe(1.0)
    clock.t += 30
    g.observe(0.0)
    assert g.value() == 0.5
    clock.t += 40  # the first observation is now 70 s old
    assert g.value() == 0.0
    clock.t += 60
    assert math.isnan(g.value())


def test_memory_stays_bounded_by_slots():
    g, clock, _ = window(window_s=10, slots=5)
    for _ in range(1000):
        g.observe(1.0)
        clock.t += 0.37
    assert len(g._buckets) <= 5
    assert g.value() == 1.0


def test_concurrent_observations_are_all_counted():
    g, _clock, _ = window()
    threads = [threading.Thread(target=lambda: [g.observe(1.0 if i % 2 else 0.0) for i in range(2000)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert g.value() == 0.5
    assert sum(b[2] for b in g._buckets) == 8000


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "0.5", None, True])
def test_non_finite_or_non_numeric_observation_is_rejected(bad):
    g, _clock, _ = window()
    g.observe(0.5)
    with pytest.raises(InvalidInput) as exc:
        g.observe(bad)
    assert exc.value.reason == "NON_FINITE_OBSERVATION"
    assert g.value() == 0.5  # the bad value left no trace


@pytest.mark.parametrize("window_s,slots", [(0, 6), (-5, 6), (math.inf, 6), (math.nan, 6), (60, 0), (60, 2.5)])
def test_bad_window_config_is_rejected(window_s, slots):
    gauge = metrics_for("validator", CollectorRegistry()).gauge("keel_validator_output_entropy_mean")
    with pytest.raises(InvalidInput) as exc:
        SlidingWindowGauge(gauge, window_s, slots)
    assert exc.value.reason == "INVALID_WINDOW"


# --- /metrics server ---------------------------------------------------------------------------

def test_metrics_server_serves_the_registry_over_http():
    registry = CollectorRegistry()
    m = metrics_for("gateway", registry)
    m.counter("keel_requests_total").labels(service="gateway", method="Generate", code="OK").inc(3)
    server = start_metrics_server(0, registry=registry, addr="127.0.0.1")
    try:
        port = server.server_address[1]
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        server.shutdown()
        server.server_close()
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(body) for s in f.samples}
    assert values[("keel_requests_total", (("code", "OK"), ("method", "Generate"), ("service", "gateway")))] == 3


@pytest.mark.parametrize("port", [-1, 65536, "9101", 9101.0, True, None])
def test_metrics_server_rejects_bad_ports(port):
    with pytest.raises(InvalidInput) as exc:
        start_metrics_server(port, registry=CollectorRegistry())
    assert exc.value.reason == "INVALID_PORT"


# --- docs ----------------------------------------------------------------------------------------

def test_docs_metrics_md_embeds_the_current_catalogue_table():
    doc = (ROOT / "docs" / "metrics.md").read_text()
    assert metrics.markdown_table() in doc, "docs/metrics.md is stale: regenerate with `python -m shared.metrics`"
