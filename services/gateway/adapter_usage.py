"""Requests and tokens by LoRA adapter, counted once per answered request (Pipeline's on_served).

The label is the adapter the engine answered with ("id@version", or "base" for none), never the
name a client asked for: only adapters a replica accepted at start can appear, so the label's
cardinality is bounded by the registry, whatever clients send. ("base" cannot collide with an
adapter: every served adapter name carries an '@'.)
"""
from __future__ import annotations

from services.gateway.values import Served
from shared import metrics

BASE_LABEL = "base"


class AdapterUsage:
    def __init__(self, m: metrics.StageMetrics):
        self._requests = m.counter("keel_gateway_adapter_requests_total")
        self._tokens = m.counter("keel_gateway_adapter_tokens_total")

    def served(self, s: Served) -> None:
        label = s.done.adapter or BASE_LABEL
        self._requests.labels(adapter=label).inc()
        self._tokens.labels(adapter=label, kind="prompt").inc(s.done.prompt_tokens)
        self._tokens.labels(adapter=label, kind="completion").inc(s.done.completion_tokens)
