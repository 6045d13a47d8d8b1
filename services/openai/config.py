"""The OpenAI-compatible stage's one typed config object, built from config/openai.yaml (schema-validated)."""
from __future__ import annotations

from dataclasses import dataclass, field

from shared import config
from shared.config import ServerConfig


@dataclass(frozen=True)
class OpenAIConfig:
    # host, port, TLS (server.tls_cert/tls_key, else the mesh's certificates, as the gateway's),
    # drain_grace_s; max_message_bytes caps a request body (larger: 413 MESSAGE_TOO_LARGE);
    # max_connection_idle_s closes an idle keep-alive connection.
    server: ServerConfig = field(default_factory=ServerConfig)
    # The gateway replicas every request goes to (round robin), over gRPC.
    gateway: tuple[str, ...] = ()


def load(path=None, environ=None) -> OpenAIConfig:
    return config.load("openai", OpenAIConfig, path, environ, upstreams={("gateway",): "gateway"})
