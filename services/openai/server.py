"""Start, serve and drain the OpenAI-compatible stage: the Starlette app under uvicorn.

Serving means the port is bound and the gateway channels are open: then ``GET /health`` answers 200
and the supervisor gets ``READY=1`` (shared/notify.py). Like the gateway with its upstreams, a
gateway that is down does not make this stage NOT_SERVING: its requests get 503 with a retry hint.
TLS: ``server.tls_cert``/``tls_key`` when set, else the mesh's server certificate when
KEEL_MESH_TLS_DIR is set, exactly as the gateway serves (no client certificate asked for: clients
authenticate by API key). On SIGTERM uvicorn stops accepting, lets the requests in flight finish
within ``server.drain_grace_s`` and then cuts them (a cut stream cancels its gateway call).
"""
from __future__ import annotations

import asyncio
import logging
import os
from contextlib import asynccontextmanager

import uvicorn

from services.openai import config as openai_config
from services.openai.app import Api, build_app
from services.openai.channels import Gateway
from services.openai.connection import connection_class
from shared import metrics, notify, tls
from shared.config import ConfigError
from shared.logging import setup_logging

log = logging.getLogger("keel.openai")


def tls_files(cfg: openai_config.OpenAIConfig) -> tuple[str | None, str | None]:
    """(certificate, key) the HTTP port serves with, or (None, None) for plain HTTP."""
    if cfg.server.tls_cert and cfg.server.tls_key:
        return cfg.server.tls_cert, cfg.server.tls_key
    folder = tls.mesh_dir()
    if folder is None:
        return None, None
    return str(folder / "server.pem"), str(folder / "server.key")


class _Server(uvicorn.Server):
    """uvicorn's server, which marks the API serving (and tells the supervisor) once it listens."""

    def __init__(self, config: uvicorn.Config, api: Api):
        super().__init__(config)
        self.api = api

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit:
            self.api.serving = True
            notify.ready()
            log.info("serving", extra={"address": f"{self.config.host}:{self.config.port}", "pid": os.getpid()})

    async def shutdown(self, sockets=None) -> None:
        self.api.serving = False
        log.info("draining", extra={"grace_s": self.config.timeout_graceful_shutdown})
        await super().shutdown(sockets)


def build(cfg: openai_config.OpenAIConfig) -> tuple[_Server, Api]:
    api = Api(Gateway(cfg.gateway, cfg.server.max_message_bytes, cfg.reconnect), cfg.server.max_message_bytes,
              cfg.edge)

    @asynccontextmanager
    async def lifespan(_app):
        api.gateway.open()
        try:
            yield
        finally:
            await api.gateway.close()

    app = build_app(api, lifespan)
    cert, key = tls_files(cfg)
    # httptools (C) parses HTTP/1.1: measured against h11 with bench/bench_openai.py --peer stub,
    # it took the stage's added latency per 1-token answer from a ratio of 1.89 to 1.55-1.76 of the gRPC call.
    # The connection class adds the edge's header/body timeouts and header limits (connection.py).
    uv = uvicorn.Config(app, host=cfg.server.host, port=cfg.server.port, ssl_certfile=cert, ssl_keyfile=key,
                        log_config=None, access_log=False, lifespan="on", server_header=False,
                        http=connection_class(cfg.edge), ws="none",
                        # X-Forwarded-For is believed from the configured proxies only (uvicorn's own
                        # default trusts 127.0.0.1, so any local caller could name any address)
                        proxy_headers=bool(cfg.trusted_proxies), forwarded_allow_ips=list(cfg.trusted_proxies),
                        timeout_graceful_shutdown=cfg.server.drain_grace_s,
                        # an idle keep-alive connection is closed after this long (uvicorn's own 5 s
                        # equals the SDKs' pool expiry, so a reused connection could meet the close)
                        timeout_keep_alive=cfg.server.max_connection_idle_s)
    return _Server(uv, api), api


def run() -> None:
    """Process entry: logs, config (an invalid one exits 2 naming the field), serve until SIGTERM."""
    setup_logging("openai", os.environ.get("KEEL_LOG_LEVEL", "INFO"))
    try:
        cfg = openai_config.load()
        server, _api = build(cfg)
    except ConfigError as exc:
        log.error("invalid configuration; not starting", extra={"error": str(exc)})
        raise SystemExit(2) from exc
    logging.getLogger().setLevel(cfg.server.log_level)
    if cfg.server.metrics_port:  # the process's own metrics (CPU, memory, file descriptors)
        metrics.start_metrics_server(cfg.server.metrics_port, addr=cfg.server.host)
    asyncio.run(server.serve())
