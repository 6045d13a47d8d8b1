"""What tracing costs per request: the same gRPC hop with and without Keel's tracing, same run.

Run: .venv/bin/python -m bench.bench_tracing [--calls 3000]

A loopback grpc.aio server behind Keel's ServerInterceptor, called through the gateway's client
path (a client span per attempt + traceparent injection). One request crosses 6 such hops (the
gateway's own RPC plus 5 downstream calls), so the per-request cost is 6 x the per-hop difference.
Tracing on = the real TracerProvider with the JSON-lines exporter writing to a temp folder.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from keel.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from shared import client, tracing
from shared.interceptor import ServerInterceptor

HOPS_PER_REQUEST = 6


class Echo(tokenizer_pb2_grpc.TokenizerServicer):
    async def Decode(self, request, context):
        return tokenizer_pb2.DecodeResponse(text="ok")


async def run(calls: int, traced: bool) -> list[float]:
    server = grpc.aio.server(interceptors=[ServerInterceptor("tokenizer")])
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ch = client.channel(f"127.0.0.1:{port}")
    stub = tokenizer_pb2_grpc.TokenizerStub(ch)
    req = tokenizer_pb2.DecodeRequest(ids=[1, 2, 3])
    out = []
    tracer = trace.get_tracer("bench")
    for i in range(calls + 200):
        t0 = time.perf_counter()
        if traced:
            with tracer.start_as_current_span("call tokenizer/Decode", kind=SpanKind.CLIENT):
                await stub.Decode(req, metadata=client.mesh_metadata())
        else:
            await stub.Decode(req, metadata=client.mesh_metadata())
        if i >= 200:  # warm-up calls are not counted
            out.append((time.perf_counter() - t0) * 1e3)
    await ch.close()
    await server.stop(None)
    return out


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[int(q * (len(xs) - 1))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args()
    off = asyncio.run(run(args.calls, traced=False))  # no provider installed: the API's no-op tracer
    provider = tracing.setup_tracing("bench", Path(tempfile.mkdtemp()))
    on = asyncio.run(run(args.calls, traced=True))
    provider.shutdown()
    p50_off, p50_on = statistics.median(off), statistics.median(on)
    print(f"per hop p50: off {p50_off:.3f} ms, on {p50_on:.3f} ms, ratio {p50_on / p50_off:.2f}x")
    print(f"per hop p99: off {pct(off, 0.99):.3f} ms, on {pct(on, 0.99):.3f} ms")
    print(f"tracing cost per request ({HOPS_PER_REQUEST} hops): {(p50_on - p50_off) * HOPS_PER_REQUEST:.3f} ms p50")
    return 0


if __name__ == "__main__":
    sys.exit(main())
