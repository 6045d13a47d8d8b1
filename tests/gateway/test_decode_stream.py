"""Streamed text over the gateway's real transport and retry policy, against two real tokenizer
replicas (servicer, interceptor, health) on the real vocabulary: a replica that dies in the middle
of an answer costs no text and repeats none."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from keel.tokenizer.v1 import tokenizer_pb2_grpc
from services.gateway.retry import RetryExecutor
from services.gateway.streamtext import StreamedText
from services.gateway.upstreams import MeshUpstreams
from services.tokenizer.compiler import compiled_path
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.core import Tokenizer
from services.tokenizer.servicer import TokenizerServicer
from shared import metrics
from shared.interceptor import ServerInterceptor
from shared.modelfile import source as model_source
from shared.stages import SERVICE_NAMES as SERVICES
from testing.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
TEXT = "Grüße aus 巴黎 \U0001F600 und \ufffd zum Schluss."


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.open(compiled_path(model_source()))


async def replica(tok: Tokenizer, port: int) -> grpc.aio.Server:
    servicer = TokenizerServicer(TokenizerConfig(), metrics.metrics_for("tokenizer", CollectorRegistry()))
    servicer.tok = tok
    server = grpc.aio.server(interceptors=[ServerInterceptor("tokenizer", mesh_token="s3cret-mesh-token")])
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, server)
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await checks.set(SERVICES["tokenizer"], health_pb2.HealthCheckResponse.SERVING)
    return server


@pytest.mark.asyncio
async def test_a_replica_dying_mid_answer_costs_no_text_and_repeats_none(tok, monkeypatch):
    monkeypatch.setenv("KEEL_MESH_TOKEN", "s3cret-mesh-token")
    ports = [free_port(), free_port()]
    servers = {f"127.0.0.1:{p}": await replica(tok, p) for p in ports}
    targets = tuple(servers)
    up = MeshUpstreams({"tokenizer": targets, "inference": targets, "validator": targets}, 1 << 22, 1)
    pool = up.pools["tokenizer"]
    pool.start()
    ex = RetryExecutor()
    ids = tok.encode_ids(TEXT) + [2]
    streamed = StreamedText(up.decode_stream)
    deltas = []

    async def send(batch, finish):
        fn = streamed.attempt(batch, finish)
        return await ex.call_with_retries(fn, method="DecodeStream", upstream="tokenizer", idempotent=True,
                                          deadline=time.monotonic() + 20, trace_id="")
    try:
        for t in targets:  # both SERVING before the answer starts
            while pool.balancer.pick() != t:
                await asyncio.sleep(0.05)
        half = len(ids) // 2
        for i in ids[:half]:
            deltas.append(await send([i], False))
        first = streamed._stream.target
        await servers[first].stop(None)  # the replica serving this answer dies
        deltas.append(await send([ids[half]], False))
        assert streamed._stream.target != first  # the retry reopened the stream on the other replica
        for n, i in enumerate(ids[half + 1:], half + 2):
            deltas.append(await send([i], n == len(ids)))
    finally:
        await pool.close()
        for s in servers.values():
            await s.stop(None)
    assert "".join(deltas) == streamed.text == tok.decode(ids, skip_special_tokens=True) == TEXT
