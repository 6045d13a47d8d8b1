"""The gateway's one typed config object, built from config/gateway.yaml (schema-validated)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from services.gateway.auth import ApiKeyEntry
from services.gateway.contract import Limits
from services.gateway.ratelimit import AuthFailureLimit, RateLimit, RateLimitConfig
from services.gateway.recording import ReplayConfig
from services.gateway.rejects import RejectSpillConfig
from services.gateway.retry import RetryConfig
from services.gateway.routing import RoutingConfig
from shared import config
from shared.config import ServerConfig
from shared.stages import GATEWAY_UPSTREAMS


@dataclass(frozen=True)
class Upstreams:
    tokenizer: tuple[str, ...] = ()
    inference: tuple[str, ...] = ()
    validator: tuple[str, ...] = ()
    # The feedback stage (replay records, SubmitFeedback); empty = neither.
    feedback: tuple[str, ...] = ()
    # HTTP/2 connections per replica; calls rotate over them (so every worker behind a shared port gets some).
    channels_per_replica: int = 8
    # How often a target "dns:///name:port" (a Kubernetes headless Service) is resolved again.
    resolve_interval_s: float = 10.0


@dataclass(frozen=True)
class GatewayConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    upstreams: Upstreams = field(default_factory=Upstreams)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    limits: Limits = field(default_factory=Limits)
    retry: RetryConfig = field(default_factory=RetryConfig)
    api_keys: tuple[ApiKeyEntry, ...] = ()
    rate_limits: RateLimitConfig = field(default_factory=RateLimitConfig)
    auth_failures: AuthFailureLimit = field(default_factory=AuthFailureLimit)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    rejected_spill: RejectSpillConfig = field(default_factory=RejectSpillConfig)


def load(path=None, environ=None) -> GatewayConfig:
    """Load and validate; API keys and per-key rate limits are records inside lists/maps."""
    cfg = config.load("gateway", GatewayConfig, path, environ,
                      upstreams={("upstreams", s): s for s in (*GATEWAY_UPSTREAMS, "feedback")})
    per_key = {k: RateLimit(**v) for k, v in dict(cfg.rate_limits.per_key).items()}
    return replace(cfg, api_keys=tuple(ApiKeyEntry(**k) for k in cfg.api_keys),
                   rate_limits=replace(cfg.rate_limits, per_key=per_key))
