"""Assembles the gateway stage: config -> auth, rate limits, retry executor, upstreams, servicer."""
from __future__ import annotations

import time
from dataclasses import replace

import grpc

from keel.gateway.v1 import gateway_pb2_grpc
from services.gateway import config as gateway_config
from services.gateway import recording
from services.gateway.adapter_usage import AdapterUsage
from services.gateway.auth import ApiKeyAuthenticator, Metadata, client_peer
from services.gateway.pipeline import Pipeline
from services.gateway.ratelimit import AuthFailureLimiter, RateLimiter
from services.gateway.rejects import RejectSpill, sender
from services.gateway.retry import RetryExecutor
from services.gateway.retry_alerts import RetryMonitor
from services.gateway.routing import Router
from services.gateway.servicer import GatewayServicer
from services.gateway.upstreams import MeshUpstreams
from services.gateway.values import Served
from shared import metrics, modelcard, modelfile, proxyauth, toolformat
from shared.config import ConfigError, ServerConfig
from shared.stages import GATEWAY_UPSTREAMS, SERVICE_NAMES


class GatewayStage:
    name = "gateway"
    service_name = SERVICE_NAMES["gateway"]

    def __init__(self, cfg: gateway_config.GatewayConfig, tool_format: str = toolformat.GENERIC):
        self.cfg = cfg
        self._auth = ApiKeyAuthenticator(cfg.api_keys, AuthFailureLimiter(cfg.auth_failures))
        self._proxy_token = proxyauth.token()  # a caller holding it may name the client it calls for
        self._limiter = RateLimiter(cfg.rate_limits)
        m = metrics.metrics_for("gateway")
        decisions = m.counter("keel_gateway_route_decisions_total")
        router = Router(cfg.routing, on_decision=lambda d: decisions.labels(reason=d.reason).inc())
        self.upstreams = MeshUpstreams({up: getattr(cfg.upstreams, up) for up in GATEWAY_UPSTREAMS},
                                       cfg.server.max_message_bytes, cfg.upstreams.channels_per_replica, router,
                                       cfg.upstreams.resolve_interval_s)
        retries, intervals, alerts = (m.counter("keel_retries_total"), m.histogram("keel_retry_interval_seconds"),
                                      m.counter("keel_retry_alerts_total"))
        for up in GATEWAY_UPSTREAMS:  # export from 0 so increase() sees the first alert
            for kind in ("retry_clustering", "retry_rate"):
                alerts.labels(upstream=up, kind=kind)
        monitor = RetryMonitor(cfg.retry.alerts, time.monotonic,
                               on_interval=lambda up, code, s: intervals.labels(upstream=up, code=code).observe(s),
                               on_alert=lambda a: alerts.labels(upstream=a.upstream, kind=a.kind).inc())
        self.executor = RetryExecutor(cfg.retry, monitor=monitor, on_decision=lambda r: retries.labels(
            upstream=r.upstream, code=r.code or "NONE", decision=r.decision, reason=r.reason or "retryable").inc())
        self.recorder, self.feedback = recording.build(cfg.upstreams.feedback, cfg.replay, cfg.server.max_message_bytes)
        usage = AdapterUsage(m)
        recorder = self.recorder

        def on_served(served: Served) -> None:
            usage.served(served)
            if recorder is not None:
                recorder.served(served)
        backlog = m.gauge("keel_gateway_rejected_spill_backlog")
        self.rejects = RejectSpill(cfg.rejected_spill, sender(self.upstreams.validate_input), backlog.set)
        self.pipeline = Pipeline(self.upstreams, self.executor, cfg.limits, on_served=on_served,
                                 spill_rejected=self.rejects.put, tool_format=tool_format)

    def authenticate(self, metadata: Metadata, peer: str = "") -> str:
        key_id = self._auth.authenticate(metadata, client_peer(metadata, peer, self._proxy_token))
        self._limiter.check(key_id)
        return key_id

    def register(self, server: grpc.aio.Server) -> None:
        gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(self.pipeline, self.cfg.limits, self.feedback),
                                                       server)

    async def warmup(self) -> None:
        # Ready means the gateway can take requests: one that finds no SERVING replica of a stage
        # is held until its deadline, so an upstream being down (restarting) never makes the
        # gateway itself NOT_SERVING. An outage shows as NO_HEALTHY_UPSTREAM answers and metrics.
        self.upstreams.start()
        self.rejects.start()
        if self.recorder is not None:
            self.recorder.start()

    async def close(self) -> None:
        if self.recorder is not None:
            await self.recorder.close()
        await self.feedback.close()
        await self.rejects.close()
        await self.upstreams.close()


def with_model(cfg: gateway_config.GatewayConfig, card: modelcard.ModelCard) -> gateway_config.GatewayConfig:
    """`cfg` holding requests to the served model's context (or the lower limit it sets)."""
    limit = cfg.limits.max_context_tokens
    if limit is not None and limit > card.context_tokens:
        raise ConfigError(f"field 'limits.max_context_tokens' breaks rule 'at most the model's context "
                          f"({card.context_tokens})'")
    return replace(cfg, limits=replace(cfg.limits, max_context_tokens=limit or card.context_tokens))


def build() -> tuple[GatewayStage, ServerConfig]:
    card = modelcard.read(modelfile.source())
    cfg = with_model(gateway_config.load(), card)
    # The tokenizer stage renders the same model's template (it reports the format as tool_format).
    return GatewayStage(cfg, toolformat.detect(card.chat_template)), cfg.server
