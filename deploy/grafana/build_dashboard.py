"""Build the Keel Grafana dashboard (deploy/grafana/dashboards/keel.json) from the panel list below.

Run from the repository root after changing a panel:

    .venv/bin/python deploy/grafana/build_dashboard.py

The JSON is committed (Grafana provisions it as is); tests/deploy fails when it is stale or when a
panel reads a metric that shared/metrics.py does not define.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards" / "keel.json"
DATASOURCE = {"type": "prometheus", "uid": "keel-prometheus"}  # provisioning/datasources/prometheus.yml
RATE = "[$__rate_interval]"
WIDTH, HEIGHT, PER_ROW = 8, 8, 3


def q(quantile: float, bucket: str, by: str = "") -> str:
    """histogram_quantile over a rate of ``bucket``, keeping the ``by`` labels."""
    keep = f"{by}, le" if by else "le"
    return f"histogram_quantile({quantile}, sum by ({keep}) (rate({bucket}{RATE})))"


def ts(title: str, targets: list[tuple[str, str]], unit: str = "short", description: str = "") -> dict:
    return {"type": "timeseries", "title": title, "description": description, "unit": unit, "targets": targets}


def stat(title: str, targets: list[tuple[str, str]], unit: str = "short", description: str = "") -> dict:
    return {"type": "stat", "title": title, "description": description, "unit": unit, "targets": targets}


ROWS: list[tuple[str, list[dict]]] = [
    ("Pipeline overview", [
        ts("Requests/s by stage", [(f"sum by (service) (rate(keel_requests_total{RATE}))", "{{service}}")], "reqps"),
        ts("Error ratio by stage", [(
            f'sum by (service) (rate(keel_requests_total{{code!="OK"}}{RATE})) '
            f"/ sum by (service) (rate(keel_requests_total{RATE}))", "{{service}}")], "percentunit",
           "Share of RPCs that ended with a non-OK gRPC status."),
        ts("p99 latency by stage", [(q(0.99, "keel_request_duration_seconds_bucket", "service"), "{{service}}")], "s"),
        stat("Stages serving", [("min by (service) (keel_stage_serving)", "{{service}}")], "none",
             "1 = every replica of the stage reports SERVING; 0 = at least one does not."),
        ts("Tokens/s generated", [(f"sum(rate(keel_inference_generated_tokens_total{RATE}))", "tokens/s")]),
        ts("Supervisor restarts (1h)", [("sum by (stage) (increase(keel_supervisor_restarts_total[1h]))",
                                         "{{stage}}")], "short", "Dev mesh only: Kubernetes counts its own restarts."),
    ]),
    ("Gateway", [
        ts("Requests/s by code", [(f'sum by (code) (rate(keel_requests_total{{service="gateway"}}{RATE}))',
                                   "{{code}}")], "reqps"),
        ts("Latency p50 / p99", [
            (q(0.5, 'keel_request_duration_seconds_bucket{service="gateway"}', "method"), "p50 {{method}}"),
            (q(0.99, 'keel_request_duration_seconds_bucket{service="gateway"}', "method"), "p99 {{method}}")], "s"),
        ts("Retry decisions/s", [(f"sum by (upstream, decision, reason) (rate(keel_retries_total{RATE}))",
                                  "{{upstream}} {{decision}} ({{reason}})")], "ops"),
        ts("Retry interval p50 / p99", [
            (q(0.5, "keel_retry_interval_seconds_bucket", "upstream"), "p50 {{upstream}}"),
            (q(0.99, "keel_retry_interval_seconds_bucket", "upstream"), "p99 {{upstream}}")], "s"),
        ts("Retry alerts (1h)", [("sum by (upstream, kind) (increase(keel_retry_alerts_total[1h]))",
                                  "{{upstream}} {{kind}}")], "short",
           "retry_clustering: intervals bunched or not uniform; retry_rate: retries over 10% of requests."),
        ts("Rejected inputs waiting for the quarantine", [("sum by (instance) (keel_gateway_rejected_spill_backlog)",
                                                          "{{instance}}")], "short",
           "The gateway's spill of rejected inputs the validator has not taken yet (sent again every second)."),
        ts("Inference routing decisions/s", [(f"sum by (reason) (rate(keel_gateway_route_decisions_total{RATE}))",
                                              "{{reason}}")], "ops",
           "Why the router picked a replica: prefix (longest cached prefix), miss, imbalanced, or the policy."),
    ]),
    ("Tokenizer", [
        ts("Requests/s and errors", [
            (f'sum(rate(keel_requests_total{{service="tokenizer"}}{RATE}))', "all"),
            (f'sum(rate(keel_requests_total{{service="tokenizer",code!="OK"}}{RATE}))', "errors")], "reqps"),
        ts("Op latency p50 / p99", [
            (q(0.5, "keel_tokenizer_latency_seconds_bucket", "op"), "p50 {{op}}"),
            (q(0.99, "keel_tokenizer_latency_seconds_bucket", "op"), "p99 {{op}}")], "s"),
        ts("Truncations/s", [(f"sum(rate(keel_tokenizer_truncations_total{RATE}))", "truncated")], "ops"),
    ]),
    ("Inference", [
        ts("Queue depth and running batch", [
            ("sum by (instance) (keel_inference_queue_depth)", "queued {{instance}}"),
            ("sum by (instance) (keel_inference_running_batch_size)", "running {{instance}}")], "short",
           "The HPA scales inference on the queue depth per pod."),
        ts("Time to first token p50 / p99", [
            (q(0.5, "keel_inference_ttft_seconds_bucket"), "p50"),
            (q(0.99, "keel_inference_ttft_seconds_bucket"), "p99")], "s"),
        ts("Inter-token latency p50 / p99", [
            (q(0.5, "keel_inference_itl_seconds_bucket"), "p50"),
            (q(0.99, "keel_inference_itl_seconds_bucket"), "p99")], "s"),
        ts("Tokens/s by replica", [(f"sum by (instance) (rate(keel_inference_generated_tokens_total{RATE}))",
                                    "{{instance}}")]),
        ts("Predicted memory vs budget", [
            ("keel_inference_predicted_memory_bytes", "predicted {{instance}}"),
            ("keel_inference_memory_budget_bytes", "budget {{instance}}"),
            ("keel_inference_observed_peak_memory_bytes", "observed peak {{instance}} "
                                                          "(engine.memory_audit)")], "bytes"),
        ts("Breaker level by error type", [("max by (error_type) (keel_inference_breaker_level)", "{{error_type}}")],
           "none", "0 closed, 1 parameters capped, 2 smaller batch / fallback format, 3 open."),
        ts("Prefix cache hit rate by replica", [(
            f"sum by (instance) (rate(keel_inference_prefix_cache_hit_tokens_total{RATE})) / "
            f"sum by (instance) (rate(keel_inference_prefix_cache_prompt_tokens_total{RATE}))", "{{instance}}"),
            ("keel_inference_prefix_cache_hit_rate", "since start {{instance}}")],
           "percentunit", "Prompt tokens served from the prefix cache over prompt tokens looked up, per replica "
           "(the rotation rules read the since-start gauge)."),
        stat("LoRA adapters refused", [('count by (adapter, version, reason) '
                                        '(keel_inference_adapter_state{state="refused"})',
                                        "{{adapter}}@{{version}} {{reason}}")], "none",
             "Adapter versions a replica refused at start, by reason (keel lora list says more)."),
        ts("Requests/s and tokens/s by adapter", [
            (f"sum by (adapter) (rate(keel_inference_adapter_requests_total{RATE}))", "requests {{adapter}}"),
            (f"sum by (adapter) (rate(keel_inference_adapter_tokens_total{RATE}))", "tokens {{adapter}}")], "short",
           "\"base\" = no adapter."),
        stat("Model served", [("max by (instance, model, architecture, digest) (keel_inference_model)",
                               "{{instance}} {{model}} ({{architecture}}, {{digest}})")], "none",
             "The model each replica serves (config/keel.yaml model, KEEL_MODEL; docs/models.md)."),
        stat("Weight format served", [("max by (instance, format) (keel_inference_weight_format)",
                                       "{{instance}} {{format}}")], "none",
             "engine.format as resolved at start (auto picks the fastest gated, batch-invariant format)."),
        ts("Active model variant by replica", [("max by (instance, variant) (keel_inference_active_variant)",
                                               "{{instance}} {{variant}}")], "none",
           "1 for the variant new requests start on (SetVariant, e.g. rotation); a restart serves primary."),
        ts("Share of tokens in the fallback format, and fallbacks (1h)", [
            (f"sum(rate(keel_inference_fallback_format_tokens_total{RATE})) "
             f"/ sum(rate(keel_inference_generated_tokens_total{RATE}))", "fallback token share"),
            ("sum(increase(keel_inference_precision_fallbacks_total[1h]))", "requests in fallback (1h)")], "short",
           "The breaker's fallback weight format: > 0 means the served format is failing."),
        ts("Numerical faults and OOM recoveries (1h)", [
            ("sum(increase(keel_inference_numerical_faults_total[1h]))", "numerical faults"),
            ("sum(increase(keel_inference_oom_recoveries_total[1h]))", "OOM recoveries")]),
    ]),
    ("Validator", [
        ts("Verdicts/s by plugin and outcome", [(
            f"sum by (plugin, outcome) (rate(keel_validator_verdicts_total{RATE}))", "{{plugin}} {{outcome}}")], "ops"),
        ts("Empty response rate and output entropy", [
            ("keel_validator_empty_response_rate", "empty rate {{instance}}"),
            ("keel_validator_output_entropy_mean", "entropy mean {{instance}}")], "short",
           "Sliding-window gauges; the collapse alert fires on empty > 0.08 with entropy < 0.8."),
        ts("Output length p50 / p99 (tokens)", [
            (q(0.5, "keel_validator_output_length_tokens_bucket"), "p50"),
            (q(0.99, "keel_validator_output_length_tokens_bucket"), "p99")]),
        ts("Outputs/s: all, empty, low confidence", [
            (f"sum(rate(keel_validator_outputs_total{RATE}))", "outputs"),
            (f"sum(rate(keel_validator_empty_outputs_total{RATE}))", "empty"),
            (f"sum(rate(keel_validator_low_confidence_total{RATE}))", "low confidence")], "ops"),
        ts("Quarantine size and spill backlog", [
            # every validator worker reports the same stream's length: max, not sum
            ("max(keel_validator_quarantine_size)", "quarantine stream"),
            ("sum by (instance) (keel_validator_spill_backlog)", "spill backlog {{instance}}")], "short",
           "A growing spill backlog means Redis is down or slow."),
        ts("Refused inputs not stored (flood gate)", [
            (f"sum by (why) (rate(keel_validator_quarantine_dropped_total{RATE}))", "{{why}}")], "ops",
           "Duplicates of a stored payload and records over a source's cap: a client repeating bad requests."),
        ts("Redis memory", [
            ("max by (instance) (keel_validator_redis_memory_used_bytes)", "used {{instance}}"),
            ("max by (instance) (keel_validator_redis_maxmemory_bytes)", "cap {{instance}}")], "bytes",
           "Redis never evicts (noeviction): at the cap quarantine writes fail and spill."),
        ts("Answers and tokens/s by LoRA adapter", [
            (f"sum by (adapter) (rate(keel_gateway_adapter_requests_total{RATE}))", "answers {{adapter}}"),
            (f"sum by (adapter, kind) (rate(keel_gateway_adapter_tokens_total{RATE}))",
             "{{kind}} tokens {{adapter}}")], "ops",
           "By the adapter that served (id@version as the engine answered; base = none), never by requested name."),
    ]),
    ("Feedback", [
        ts("Feedback/s by error type and severity", [(
            f"sum by (error_type, severity) (rate(keel_feedback_total{RATE}))", "{{error_type}} {{severity}}")],
            "ops"),
        ts("Replay records/s by path, and dropped by the gateway", [
            (f"sum by (path) (rate(keel_replay_records_total{RATE}))", "{{path}}"),
            (f"sum by (reason) (rate(keel_replay_records_dropped_total{RATE}))", "dropped {{reason}}")], "ops",
           "spilled > 0: the feedback database is down; the spill is written to it once it is back."),
        ts("Replay record spill backlog", [("sum by (instance) (keel_feedback_spill_backlog)", "{{instance}}")]),
        stat("Last determinism check", [("sum by (result) (keel_determinism_checks_total)", "{{result}}")], "short",
             "From `keel verify determinism` (nightly CronJob, via the Pushgateway); mismatch > 0 alerts."),
    ]),
    ("Rotation", [
        ts("Rotation decisions by action and outcome", [(
            "sum by (action, outcome) (increase(keel_rotation_decisions_total[1h]))", "{{action}} {{outcome}}")],
            "short", "Per hour. proposed: waits for `keel rotation approve`; failed: every try failed, nothing "
            "half-applied; cooldown: the same action ran too recently (docs/rotation.md)."),
        ts("Rotation webhook calls by status", [(
            f"sum by (code) (rate(keel_rotation_webhook_requests_total{RATE}))", "{{code}}")], "reqps",
           "400: a malformed payload; 401: a caller without the mesh token; 503: the database was down "
           "(Alertmanager retries)."),
    ]),
]


def build() -> dict:
    panels: list[dict] = []
    y = 0
    for row_title, row_panels in ROWS:
        panels.append({"type": "row", "title": row_title, "collapsed": False, "id": len(panels) + 1,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        y += 1
        for i, p in enumerate(row_panels):
            if i and i % PER_ROW == 0:
                y += HEIGHT
            panels.append({
                "id": len(panels) + 1, "type": p["type"], "title": p["title"], "description": p["description"],
                "datasource": DATASOURCE,
                "gridPos": {"h": HEIGHT, "w": WIDTH, "x": (i % PER_ROW) * WIDTH, "y": y},
                "fieldConfig": {"defaults": {"unit": p["unit"]}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}} if p["type"] == "timeseries"
                else {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "background"},
                "targets": [{"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": chr(65 + n)}
                            for n, (expr, legend) in enumerate(p["targets"])],
            })
        y += HEIGHT
    return {
        "uid": "keel-overview", "title": "Keel", "tags": ["keel"], "timezone": "browser",
        "schemaVersion": 39, "version": 1, "editable": False, "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"}, "panels": panels,
        "templating": {"list": []}, "annotations": {"list": []},
    }


def render() -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    sys.stdout.write(f"wrote {OUT}\n")
