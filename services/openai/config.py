"""The OpenAI-compatible stage's one typed config object, built from config/openai.yaml (schema-validated)."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from services.openai.limits import EdgeLimits
from shared import client, config
from shared.config import ServerConfig


@dataclass(frozen=True)
class OpenAIConfig:
    # host, port, TLS (server.tls_cert/tls_key, else the mesh's certificates, as the gateway's),
    # drain_grace_s; max_message_bytes caps a request body (larger: 413 MESSAGE_TOO_LARGE);
    # max_connection_idle_s closes an idle keep-alive connection.
    server: ServerConfig = field(default_factory=ServerConfig)
    # The gateway replicas every request goes to (round robin), over gRPC.
    gateway: tuple[str, ...] = ()
    # What a client may send before the gateway sees anything (services/openai/limits.py).
    edge: EdgeLimits = field(default_factory=EdgeLimits)
    # The proxies (addresses or CIDR networks) whose X-Forwarded-For / X-Forwarded-Proto this stage
    # believes; none by default: the caller is the socket's peer, whatever headers it sends.
    trusted_proxies: tuple[str, ...] = ()
    # How a request whose gateway connection was lost is sent again (attempts, backoff, and how long
    # to wait for a gateway to be back, ready_s) before it is answered 503 (shared/client.py).
    reconnect: client.Reconnect = field(default_factory=client.Reconnect)

    def __post_init__(self) -> None:
        for proxy in self.trusted_proxies:
            ipaddress.ip_network(proxy, strict=False)  # ValueError names the entry that is not one


def load(path=None, environ=None) -> OpenAIConfig:
    return config.load("openai", OpenAIConfig, path, environ, upstreams={("gateway",): "gateway"})
