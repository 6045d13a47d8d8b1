"""Start, warm up, serve and drain one stage process. Every stage's __main__ calls ``run``.

Order matters for honest health: bind the port and report NOT_SERVING first (probes get a real
answer, requests get UNAVAILABLE with a retry hint), warm up (model/vocabulary loaded and
exercised), then report SERVING. On SIGTERM/SIGINT: NOT_SERVING, new calls get UNAVAILABLE
SHUTTING_DOWN with a retry hint, in-flight calls finish (each by its own deadline at the latest)
within ``drain_grace_s``; any still running then end with UNAVAILABLE SHUTTING_DOWN and a retry
hint; then exit.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from pathlib import Path
from typing import Callable, Protocol, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared import discovery, meshauth, metrics, notify, stagestatus, tls
from shared.config import EXIT_CONFIG, ConfigError, ServerConfig
from shared.interceptor import ServerInterceptor
from shared.logging import setup_logging
from shared.tracing import setup_tracing

log = logging.getLogger("keel.server")


class Stage(Protocol):
    """What a stage gives the bootstrap. Core work lives behind it; grpc only in ``register``."""

    name: str            # "tokenizer"
    service_name: str    # "keel.tokenizer.v1.Tokenizer"
    # optional: authenticate(metadata pairs, peer) -> principal, raising Unauthenticated (gateway only)
    # optional: begin_drain() -> None: end long-lived calls (the feedback stage's SubmitStream), so
    #   that the drain does not wait them out; their callers go on elsewhere

    def register(self, server: grpc.aio.Server) -> None: ...
    async def warmup(self) -> None: ...
    async def close(self) -> None: ...


def _credentials(cfg: ServerConfig) -> grpc.ServerCredentials | None:
    if not (cfg.tls_cert and cfg.tls_key):
        return None
    pair = [(Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())]
    ca = Path(cfg.tls_ca).read_bytes() if cfg.tls_ca else None
    return grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=ca is not None)


def freeze_heap() -> None:
    """Move every object alive now (imports, config, the model, warm-up state) out of the cyclic
    garbage collector's reach (``gc.freeze``). A full collection otherwise walks all of them and
    stops the event loop meanwhile: in a gateway under load, a pause every few seconds longer than a
    whole answer's budget (docs/BENCHMARKS.md). Frozen objects are still freed by reference
    counting; only a cycle among them is never collected."""
    gc.collect()
    gc.freeze()


async def serve(stage: Stage, cfg: ServerConfig, *, freeze: bool = False) -> None:
    """``freeze``: freeze the heap once warmed up and SERVING (``freeze_heap``); the process entry
    does, a test that serves in its own process need not."""
    ready = False
    serving_gauge = metrics.metrics_for(stage.name).gauge("keel_stage_serving").labels(service=stage.name)
    # Only the public gateway authenticates clients itself; every other stage demands the mesh token.
    authenticate: Callable[[Sequence[tuple[str, str | bytes]], str], str] | None = getattr(stage, "authenticate", None)
    mesh_token = None if authenticate else meshauth.token()
    interceptor = ServerInterceptor(stage.name, mesh_token=mesh_token, authenticate=authenticate,
                                    is_ready=lambda: ready)
    server = grpc.aio.server(interceptors=[interceptor], options=[
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.so_reuseport", 1),  # several worker processes may share one port
        # Clients ping every 20 s (shared/client.py) to keep idle health watches alive; the
        # default (one ping per 5 min without data) would answer GOAWAY too_many_pings.
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # A connection with no call for this long is closed (GOAWAY; a client reconnects when it
        # needs to): idle clients cannot pile up connections. Server pings find dead peers.
        ("grpc.max_connection_idle_ms", round(cfg.max_connection_idle_s * 1000)),
        ("grpc.keepalive_time_ms", round(cfg.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", round(cfg.keepalive_timeout_s * 1000)),
    ])
    health_servicer = discovery.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    stagestatus.StatusServicer().register(server)
    stage.register(server)
    if cfg.reflection:
        discovery.enable_reflection(server, (stage.service_name, stagestatus.SERVICE))
    for name in ("", stage.service_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    address = f"{cfg.host}:{cfg.port}"
    # Explicit server.tls_* wins; else the mesh-wide certificates, mutual for all but the gateway.
    creds = _credentials(cfg) or tls.server_credentials(mutual=authenticate is None)
    port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    if cfg.metrics_port:
        metrics.start_metrics_server(cfg.metrics_port, addr=cfg.host)  # never wider than the gRPC port
    await server.start()
    log.info("listening; warming up", extra={"address": f"{cfg.host}:{port}", "pid": os.getpid()})

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stagestatus.BOARD.phase("warming up")  # a stage's warm-up may report its own steps
    warm = asyncio.create_task(stage.warmup())
    done, _ = await asyncio.wait({warm, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    if warm in done:
        if isinstance(warm.exception(), ConfigError):  # found only once the stage read its files: not restarted
            log.error("invalid configuration; not starting", extra={"error": str(warm.exception())})
            await server.stop(0)
            raise SystemExit(EXIT_CONFIG)
        if warm.exception() is not None:  # the process exits: the supervisor restarts it, health never lied
            log.error("warm-up failed; exiting", exc_info=warm.exception())
            await server.stop(0)
            raise SystemExit(1)
        ready = True
        # READY=1 before SERVING: whoever sees this process SERVING, its supervisor knows it served
        # (and restarts it at once if it dies; keelctl/supervisor.py).
        notify.ready()
        for name in ("", stage.service_name):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        stagestatus.BOARD.phase("serving")
        serving_gauge.set(1)
        log.info("serving", extra={"address": f"{cfg.host}:{port}"})
        if hasattr(stage, "serving"):  # work a stage does once it serves (the inference stage's background gate)
            stage.serving()
        if freeze:  # after SERVING: its one full collection does not delay a restarted stage's return
            freeze_heap()
        await stop.wait()
    log.info("draining", extra={"grace_s": cfg.drain_grace_s})
    stagestatus.BOARD.phase("draining")
    ready = False
    interceptor.begin_drain()
    if hasattr(stage, "begin_drain"):
        stage.begin_drain()
    serving_gauge.set(0)
    await health_servicer.enter_graceful_shutdown()
    # New calls now get UNAVAILABLE SHUTTING_DOWN; in-flight ones finish within the grace period.
    # Health watches are long-lived streams, not work: they are cut once the real calls are done.
    if not await interceptor.drained(cfg.drain_grace_s):
        log.warning("grace period over; cutting the calls still in flight", extra={"inflight": interceptor.inflight})
        await interceptor.cut()
    await server.stop(0.5)
    await stage.close()
    log.info("stopped")


def run(stage_name: str, build: Callable[[], tuple[Stage, ServerConfig]]) -> None:
    """Process entry: set up logs and traces, build the stage (config errors stop it here), serve."""
    setup_logging(stage_name, os.environ.get("KEEL_LOG_LEVEL", "INFO"))
    setup_tracing(stage_name)
    try:
        stage, cfg = build()
        tls.mesh_dir()  # TLS switched on without its certificates stops the stage here, not mid-start
    except ConfigError as exc:
        log.error("invalid configuration; not starting", extra={"error": str(exc)})
        raise SystemExit(EXIT_CONFIG) from exc
    logging.getLogger().setLevel(cfg.log_level)
    asyncio.run(serve(stage, cfg, freeze=True))
