"""Keel's one catalogue of Prometheus metrics, and the helpers every process uses to export them.

Every metric a Keel process exports is declared once, in ``CATALOGUE``; dashboards, alert rules and
docs/metrics.md are checked against it by tests/deploy. A process asks for its own set:

    from shared.metrics import metrics_for, start_metrics_server
    m = metrics_for("inference")                     # common metrics + the inference ones
    m.gauge("keel_inference_queue_depth").set(3)
    server = start_metrics_server(9103)              # GET /metrics; server.shutdown() stops it

Only the owner's metrics are registered, so the tokenizer never exports a zero
``keel_inference_queue_depth`` that would skew a sum or a mean. Common metrics all carry labels and
so export nothing until first used.

Print the catalogue as the markdown table kept in docs/metrics.md:

    python -m shared.metrics
"""
from __future__ import annotations

import math
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics import MetricWrapperBase

from shared.errors import InvalidInput
from shared.stages import SERVICE_NAMES

COMMON = "common"
# Who may own a metric: every gRPC stage (shared/stages.py), the supervisor and the CLI.
STAGES = (*SERVICE_NAMES, "supervisor", "keelctl")
KINDS = ("counter", "gauge", "histogram")


def log_buckets(low: float, high: float, per_decade: int) -> tuple[float, ...]:
    """Log-spaced histogram bounds from ``low`` to ``high`` inclusive, ``per_decade`` per factor of 10.

    Rounded to 3 significant digits so the ``le`` labels stay readable; ``high`` is always the last bound.
    """
    if not (0 < low < high) or per_decade < 1:
        raise InvalidInput(f"log_buckets needs 0 < low < high and per_decade >= 1, got {low}, {high}, {per_decade}",
                           reason="INVALID_BUCKETS")
    bounds: list[float] = []
    step = 0
    while True:
        b = float(f"{low * 10 ** (step / per_decade):.3g}")
        if b >= high * (1 - 1e-9):
            break
        bounds.append(b)
        step += 1
    bounds.append(float(high))
    return tuple(bounds)


# 1 ms .. 60 s, 4 per decade: 21 bounds; every request/retry latency in the mesh fits this range.
LATENCY_BUCKETS = log_buckets(1e-3, 60.0, 4)
# Tokenizer ops take microseconds to milliseconds, below LATENCY_BUCKETS' first bound.
TOKENIZER_BUCKETS = log_buckets(1e-5, 1.0, 4)
# Output lengths in tokens, powers of two up to the model's 8192-token context.
LENGTH_BUCKETS = tuple(float(2 ** i) for i in range(14))


@dataclass(frozen=True)
class MetricSpec:
    """One catalogue entry. ``name`` is the exposed family name (counters end in ``_total``)."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...] = ()
    owner: str = COMMON
    buckets: tuple[float, ...] | None = None
    windowed: bool = False  # a gauge fed by SlidingWindowGauge

    def sample_names(self) -> tuple[str, ...]:
        """Series names this metric exposes, as PromQL sees them."""
        if self.kind == "histogram":
            return tuple(f"{self.name}{s}" for s in ("_bucket", "_sum", "_count"))
        return (self.name,)


def _c(name: str, help: str, labels: tuple[str, ...] = (), owner: str = COMMON) -> MetricSpec:
    return MetricSpec(name, "counter", help, labels, owner)


def _g(name: str, help: str, labels: tuple[str, ...] = (), owner: str = COMMON, windowed: bool = False) -> MetricSpec:
    return MetricSpec(name, "gauge", help, labels, owner, windowed=windowed)


def _h(name: str, help: str, buckets: tuple[float, ...], labels: tuple[str, ...] = (),
       owner: str = COMMON) -> MetricSpec:
    return MetricSpec(name, "histogram", help, labels, owner, buckets)


CATALOGUE: tuple[MetricSpec, ...] = (
    # Every stage (the server interceptor and the client side of each call).
    _c("keel_requests_total", "RPCs handled, by serving stage, method and final gRPC status code name.",
       ("service", "method", "code")),
    _h("keel_request_duration_seconds", "Server-side RPC duration, from first byte in to status sent.",
       LATENCY_BUCKETS, ("service", "method")),
    _c("keel_retries_total", "Retry decisions on failed upstream calls; decision is retry or stop, "
       "reason says why (budget, attempts, code, deadline, pushback).", ("upstream", "code", "decision", "reason")),
    _h("keel_retry_interval_seconds", "Actual delay before each retry, by upstream and the code that caused it.",
       LATENCY_BUCKETS, ("upstream", "code")),
    _c("keel_retry_alerts_total", "Retry anomaly alerts raised; kind retry_clustering (intervals bunched or "
       "not uniform over their range) or retry_rate (retries over 10% of requests).", ("upstream", "kind")),
    _g("keel_stage_serving", "1 while the stage reports SERVING on grpc.health.v1, else 0.", ("service",)),
    # Tokenizer.
    _h("keel_tokenizer_latency_seconds", "Tokenizer core time per operation (encode, decode, decode_stream).",
       TOKENIZER_BUCKETS, ("op",), "tokenizer"),
    _c("keel_tokenizer_truncations_total", "Inputs truncated to max_length (always reported to the caller too).",
       owner="tokenizer"),
    # Inference.
    _g("keel_inference_queue_depth", "Requests admitted but waiting for a batch slot (the HPA scales on this).",
       owner="inference"),
    _g("keel_inference_running_batch_size", "Rows in the running decode batch.", owner="inference"),
    _h("keel_inference_ttft_seconds", "Time to first token, from admission to the first streamed token.",
       LATENCY_BUCKETS, owner="inference"),
    _h("keel_inference_itl_seconds", "Inter-token latency between consecutive streamed tokens of a request.",
       LATENCY_BUCKETS, owner="inference"),
    _c("keel_inference_generated_tokens_total", "Tokens generated; rate() of it is tokens/s.", owner="inference"),
    _g("keel_inference_predicted_memory_bytes", "Memory model's prediction for the running batch plus static.",
       owner="inference"),
    _g("keel_inference_memory_budget_bytes", "Configured memory budget that admission keeps the prediction under.",
       owner="inference"),
    _g("keel_inference_observed_peak_memory_bytes", "With engine.memory_audit on: the largest allocator-measured "
       "step so far (static + live caches + the step's transient peak), to hold against the prediction.",
       owner="inference"),
    _g("keel_inference_breaker_level", "Circuit breaker level per error type: 0 closed, 1 parameters capped, "
       "2 smaller batch / fallback format, 3 open (rejecting).", ("error_type",), "inference"),
    _g("keel_inference_model", "1 for the model the stage serves: its name, family and the first 16 hex digits "
       "of the sha256 of its bytes (shared/modelfile.py, docs/models.md).", ("model", "architecture", "digest"),
       "inference"),
    _g("keel_inference_weight_format", "1 for the weight format the stage serves (engine.format, auto resolved "
       "at start).", ("format",), "inference"),
    _g("keel_inference_active_variant", "1 for the model variant new requests start on, 0 for the other variants "
       "preloaded at warm-up (SetVariant switches it; a start serves primary).", ("variant",), "inference"),
    _c("keel_inference_precision_fallbacks_total", "Requests the circuit breaker ran in its fallback weight format "
       "instead of the served one.", owner="inference"),
    _c("keel_inference_fallback_format_tokens_total", "Tokens generated in the breaker's fallback weight format; "
       "over keel_inference_generated_tokens_total, the share of decode steps run in it.", owner="inference"),
    _g("keel_inference_prefix_cache_hit_rate", "Prompt tokens whose keys/values came from the prefix cache, "
       "over prompt tokens, since the stage started.", owner="inference"),
    _c("keel_inference_prefix_cache_prompt_tokens_total", "Prompt tokens looked up in the prefix cache.",
       owner="inference"),
    _c("keel_inference_prefix_cache_hit_tokens_total", "Of those, tokens whose keys/values came from the cache "
       "(per replica: what the gateway's routing gains).", owner="inference"),
    _c("keel_inference_numerical_faults_total", "Rows failed with NaN/inf logits.", owner="inference"),
    _g("keel_inference_adapter_state", "1 per registered LoRA adapter version, labelled with its state at start "
       "(accepted or refused) and the refusal reason.", ("adapter", "version", "state", "reason"), "inference"),
    _c("keel_inference_adapter_requests_total", "Requests answered, by adapter (\"id@version\", or \"base\").",
       ("adapter",), "inference"),
    _c("keel_inference_adapter_tokens_total", "Tokens generated, by adapter (\"id@version\", or \"base\").",
       ("adapter",), "inference"),
    _c("keel_inference_oom_recoveries_total", "Out-of-memory errors recovered from without a restart.",
       owner="inference"),
    # Validator.
    _c("keel_validator_verdicts_total", "Output plugin verdicts by plugin and outcome (pass, annotate, block).",
       ("plugin", "outcome"), "validator"),
    _c("keel_validator_outputs_total", "Outputs validated.", owner="validator"),
    _c("keel_validator_empty_outputs_total", "Outputs that were empty after processing.", owner="validator"),
    _g("keel_validator_empty_response_rate", "Share of empty outputs over the sliding window (NaN when no output "
       "in the window).", owner="validator", windowed=True),
    _g("keel_validator_output_entropy_mean", "Mean predictive entropy (nats) of outputs over the sliding window "
       "(NaN when no output in the window).", owner="validator", windowed=True),
    _h("keel_validator_output_length_tokens", "Output length in tokens (p99 via histogram_quantile).",
       LENGTH_BUCKETS, owner="validator"),
    _c("keel_validator_low_confidence_total", "Outputs marked low_confidence_output and sent to review.",
       owner="validator"),
    _g("keel_validator_quarantine_size", "Records in the Redis quarantine stream, as last seen.", owner="validator"),
    _g("keel_validator_spill_backlog", "Quarantine records in the local spill file not yet replayed into Redis.",
       owner="validator"),
    _c("keel_validator_quarantine_dropped_total", "Rejected/flagged inputs not stored by the quarantine's flood gate "
       "(why: duplicate of a stored payload, source_cap).", ("why",), "validator"),
    # Gateway: answers by LoRA adapter (services/gateway/adapter_usage.py; "base" = no adapter).
    _c("keel_gateway_adapter_requests_total", "Answered requests by the adapter that served them (id@version as "
       "the engine answered, or base); never a name a client asked for.", ("adapter",), "gateway"),
    _c("keel_gateway_adapter_tokens_total", "Tokens of answered requests by serving adapter and kind (prompt, "
       "completion).", ("adapter", "kind"), "gateway"),
    _g("keel_gateway_rejected_spill_backlog", "Inputs the gateway rejected that wait in its spill file for the "
       "validator's quarantine (services/gateway/rejects.py); above 0 for long: the validator is not taking them.",
       owner="gateway"),
    _c("keel_gateway_route_decisions_total", "Inference replicas picked by the router, by reason (prefix: the "
       "longest cached prefix; miss: none cached, least loaded; imbalanced: least loaded over the cache; "
       "least_loaded, round_robin: those policies).", ("reason",), "gateway"),
    # Feedback (replay records, feedback; services/feedback) and the gateway's side of it.
    _c("keel_feedback_total", "Feedback items created (an update of the same feedback_id is not counted again).",
       ("error_type", "severity"), "feedback"),
    _c("keel_replay_records_total", "Replay records by path: direct (written to the database), spilled (to the "
       "local file while the database was down), replayed (from the spill into the database).", ("path",),
       "feedback"),
    _g("keel_feedback_spill_backlog", "Replay records in the local spill file not yet in the database.",
       owner="feedback"),
    _c("keel_rotation_decisions_total", "Rotation decisions by action and outcome (proposed, applied, failed, "
       "cooldown, skipped, expired); a redelivered alert is not counted again.", ("action", "outcome"), "feedback"),
    _c("keel_rotation_webhook_requests_total", "Alertmanager webhook calls by HTTP status (200 taken, 400 malformed, "
       "401 unauthenticated, 503 database down).", ("code",), "feedback"),
    _c("keel_replay_records_dropped_total", "Replay records the gateway could not hand to the feedback stage "
       "(queue_full, unreachable, or error); reason says which.", ("reason",), "gateway"),
    _c("keel_determinism_checks_total", "Replays run by `keel verify determinism`, by result (identical, "
       "mismatch, not_comparable, failed).", ("result",), "keelctl"),
    _g("keel_validator_redis_memory_used_bytes", "Redis used_memory, as last seen (the quarantine's store).",
       owner="validator"),
    _g("keel_validator_redis_maxmemory_bytes", "Redis maxmemory, as last seen (0: no cap; the policy is noeviction, "
       "so at the cap quarantine writes fail and spill).", owner="validator"),
    # Supervisor.
    _c("keel_supervisor_restarts_total", "Stage processes restarted by the supervisor.", ("stage",), "supervisor"),
)

SPECS: Mapping[str, MetricSpec] = {s.name: s for s in CATALOGUE}


def specs_for(stage: str) -> tuple[MetricSpec, ...]:
    """The metrics one stage's process exports: the common ones plus its own."""
    if stage not in STAGES:
        raise InvalidInput(f"unknown stage {stage!r}; expected one of {', '.join(STAGES)}",
                           reason="UNKNOWN_STAGE", metadata={"stage": stage})
    return tuple(s for s in CATALOGUE if s.owner in (COMMON, stage))


def _build(spec: MetricSpec, registry: CollectorRegistry) -> MetricWrapperBase:
    if spec.kind == "counter":
        # prometheus_client appends _total itself; the catalogue keeps the exposed name.
        return Counter(spec.name.removesuffix("_total"), spec.help, spec.labels, registry=registry)
    if spec.kind == "gauge":
        gauge = Gauge(spec.name, spec.help, spec.labels, registry=registry)
        if spec.windowed:
            gauge.set(math.nan)  # "no data" until a SlidingWindowGauge is bound, never a false 0
        return gauge
    return Histogram(spec.name, spec.help, spec.labels, registry=registry, buckets=spec.buckets)


# One metric object per (registry, name), so two stages hosted by one process (tests, a dev
# all-in-one) share the common metrics instead of failing on a duplicate registration.
_BUILT: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, MetricWrapperBase]] = weakref.WeakKeyDictionary()
_BUILT_LOCK = threading.Lock()


class StageMetrics(Mapping[str, MetricWrapperBase]):
    """A stage's metrics by full name; the typed getters also check the kind."""

    def __init__(self, stage: str, metrics: dict[str, MetricWrapperBase], registry: CollectorRegistry):
        self.stage = stage
        self.registry = registry
        self._metrics = metrics

    def __getitem__(self, name: str) -> MetricWrapperBase:
        try:
            return self._metrics[name]
        except KeyError:
            owner = SPECS[name].owner if name in SPECS else "nobody (not in the catalogue)"
            raise KeyError(f"{name} is not exported by {self.stage}; it belongs to {owner}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._metrics)

    def __len__(self) -> int:
        return len(self._metrics)

    def _typed(self, name: str, kind: str) -> MetricWrapperBase:
        metric = self[name]
        if SPECS[name].kind != kind:
            raise TypeError(f"{name} is a {SPECS[name].kind}, not a {kind}")
        return metric

    def counter(self, name: str) -> Counter:
        return self._typed(name, "counter")  # type: ignore[return-value]

    def gauge(self, name: str) -> Gauge:
        return self._typed(name, "gauge")  # type: ignore[return-value]

    def histogram(self, name: str) -> Histogram:
        return self._typed(name, "histogram")  # type: ignore[return-value]


def metrics_for(stage: str, registry: CollectorRegistry = REGISTRY) -> StageMetrics:
    """Register (once per registry) and return the metrics ``stage`` exports."""
    specs = specs_for(stage)
    with _BUILT_LOCK:
        built = _BUILT.setdefault(registry, {})
        for spec in specs:
            if spec.name not in built:
                built[spec.name] = _build(spec, registry)
        return StageMetrics(stage, {s.name: built[s.name] for s in specs}, registry)


def start_metrics_server(port: int, registry: CollectorRegistry = REGISTRY, addr: str = "127.0.0.1"):
    """Serve ``registry`` on http://addr:port/metrics from a daemon thread; returns the server.

    ``port=0`` picks a free port (read it from ``server.server_address[1]``). Call ``shutdown()``
    then ``server_close()`` on the result to stop it.
    """
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise InvalidInput(f"metrics port must be an int in 0..65535, got {port!r}",
                           reason="INVALID_PORT", metadata={"port": repr(port)})
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server


class SlidingWindowGauge:
    """Keeps a gauge at the mean of the values observed over the last ``window_s`` seconds.

    Observations are summed into ``slots`` equal time slots, so memory is O(slots) whatever the
    request rate; the window therefore covers between ``window_s - window_s/slots`` and ``window_s``.
    The gauge reads the window at scrape time, so it decays with no traffic; with nothing in the
    window it reads NaN, which compares false in PromQL and so never fires an alert.
    Feed 1.0/0.0 to get a rate (e.g. empty responses) or a value to get its mean (e.g. entropy).
    """

    def __init__(self, gauge: Gauge, window_s: float, slots: int = 60,
                 clock: Callable[[], float] = time.monotonic):
        if not (isinstance(window_s, (int, float)) and math.isfinite(window_s) and window_s > 0):
            raise InvalidInput(f"window_s must be a positive finite number, got {window_s!r}",
                               reason="INVALID_WINDOW")
        if not isinstance(slots, int) or slots < 1:
            raise InvalidInput(f"slots must be an int >= 1, got {slots!r}", reason="INVALID_WINDOW")
        self._width = window_s / slots
        self._slots = slots
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: deque[list[float]] = deque()  # [slot index, sum, count], oldest first
        gauge.set_function(self.value)

    def _evict(self, now_slot: int) -> None:
        while self._buckets and self._buckets[0][0] <= now_slot - self._slots:
            self._buckets.popleft()

    def observe(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidInput(f"observation must be a finite number, got {value!r}",
                               reason="NON_FINITE_OBSERVATION")
        slot = math.floor(self._clock() / self._width)
        with self._lock:
            self._evict(slot)
            if self._buckets and self._buckets[-1][0] == slot:
                self._buckets[-1][1] += value
                self._buckets[-1][2] += 1
            else:
                self._buckets.append([slot, float(value), 1])

    def value(self) -> float:
        slot = math.floor(self._clock() / self._width)
        with self._lock:
            self._evict(slot)
            count = sum(b[2] for b in self._buckets)
            return sum(b[1] for b in self._buckets) / count if count else math.nan


def markdown_table() -> str:
    """The catalogue as the markdown table docs/metrics.md embeds."""
    rows = ["| name | type | labels | owner | meaning |", "| --- | --- | --- | --- | --- |"]
    for s in CATALOGUE:
        kind = f"{s.kind} (sliding window)" if s.windowed else s.kind
        labels = ", ".join(s.labels) or "-"
        rows.append(f"| `{s.name}` | {kind} | {labels} | {s.owner} | {s.help} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown_table())
