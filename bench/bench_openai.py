"""The OpenAI-compatible HTTP API against the gateway's gRPC API, same mesh, same run.

Run: .venv/bin/python -m bench.bench_openai [--peer mesh|stub] [--pairs 200] [--ttft-pairs 40] [--clients 64]

--peer mesh (default) starts `python -m keelctl up` on free loopback ports (the real model);
--peer stub starts a stand-in gateway process that answers at once (the stream: one delta per
--stub-step-ms) and the HTTP stage in front of it, so that what is measured is the HTTP stage's
own cost, without the model's run-to-run spread. Then:
1. a 1-token chat completion: HTTP (POST /v1/chat/completions, one keep-alive connection) and gRPC
   `Generate` (one channel) alternate, pair after pair, so drift in the machine's speed hits both;
   p50 of each, the difference in ms and the ratio;
2. streamed time to first token: HTTP `stream: true` (until the first content delta) against
   `GenerateStream` (until the first delta), alternating; p50s and their ratio;
3. 64 concurrent streamed HTTP clients, one of which stops reading for --stall-s after its first
   event: every stream must end in `data: [DONE]` with no error; for the others, the longest gap
   between two events of a stream, against 64 concurrent `GenerateStream` calls (none stalled).
Greedy decoding, the same prompt on both sides. Prints the CPU flags and the load average.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import httpx2

from bench.lib.machine import machine_line
from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from keelctl import health
from keelctl.ask import DEV_API_KEY
from shared.modelfile import model_id
from testing.mesh import start_mesh, stop_mesh
from testing.ports import free_port

MODEL_ID = model_id()  # the served model's name (shared/modelfile.py)

ROOT = Path(__file__).resolve().parent.parent

PROMPT = "What is the capital of France?"
MD = (("authorization", f"Bearer {DEV_API_KEY}"),)
# The same deadline as the gRPC calls below (300 s), not the gateway's default.
HEADERS = {"Authorization": f"Bearer {DEV_API_KEY}", "x-keel-deadline-ms": "300000"}


def grpc_request(tokens: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt=PROMPT, sampling=common_pb2.SamplingParams(
        max_tokens=tokens, temperature=0.0, top_p=1.0))


def http_body(tokens: int, stream: bool) -> dict:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
            "temperature": 0, "stream": stream}


async def http_unary(http: httpx2.AsyncClient, url: str) -> float:
    t0 = time.perf_counter()
    r = await http.post(url, json=http_body(1, False), headers=HEADERS)
    dt = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    return dt


class RawHttp:
    """One keep-alive HTTP/1.1 connection driven by hand: the least client cost per request, so that
    the comparison with a gRPC stub shows the server side (httpx2's own cost is measured beside it)."""

    def __init__(self, target: str):
        self.host, self.port = target.split(":")
        body = json.dumps(http_body(1, False)).encode()
        self.request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {target}\r\nAuthorization: Bearer "
                        f"{DEV_API_KEY}\r\nx-keel-deadline-ms: 300000\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(body)}\r\n\r\n"
                        ).encode() + body

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, int(self.port))

    async def unary(self) -> float:
        if self.reader.at_eof():  # the server closed the idle connection: a new one, not timed
            await self.open()
        t0 = time.perf_counter()
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
        await self.reader.readexactly(length)
        dt = time.perf_counter() - t0
        assert head.startswith(b"HTTP/1.1 200"), head
        return dt

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


async def grpc_unary(stub) -> float:
    t0 = time.perf_counter()
    await stub.Generate(grpc_request(1), metadata=MD, timeout=300)
    return time.perf_counter() - t0


async def http_stream(http: httpx2.AsyncClient, url: str, tokens: int,
                      stall_s: float = 0.0) -> tuple[float, float, bool, float]:
    """(time to the first content delta, the longest gap between two events, ended with [DONE],
    the whole stream's time)."""
    t0 = time.perf_counter()
    first, last, gap, done = None, None, 0.0, False
    async with http.stream("POST", url, json=http_body(tokens, True), headers=HEADERS) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            assert "error" not in event, event
            if last is not None:
                gap = max(gap, now - last)
            last = now
            if first is None and event["choices"] and event["choices"][0]["delta"].get("content"):
                first = now - t0
                if stall_s:
                    await asyncio.sleep(stall_s)
                    last = time.perf_counter()
    return first or 0.0, gap, done, time.perf_counter() - t0


async def grpc_stream(stub, tokens: int) -> tuple[float, float, bool, float]:
    t0 = time.perf_counter()
    first, last, gap, done = None, None, 0.0, False
    async for ev in stub.GenerateStream(grpc_request(tokens), metadata=MD, timeout=300):
        now = time.perf_counter()
        if last is not None:
            gap = max(gap, now - last)
        last = now
        if ev.WhichOneof("event") == "delta" and first is None:
            first = now - t0
        done = ev.WhichOneof("event") == "done"
    return first or 0.0, gap, done, time.perf_counter() - t0


def p50(xs: list[float]) -> float:
    return statistics.median(xs)


async def run(mesh, args) -> None:
    url = f"http://{mesh.http}/v1/chat/completions"
    limits = httpx2.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    async with httpx2.AsyncClient(timeout=300, limits=limits) as http, grpc.aio.insecure_channel(mesh.gateway) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        for _ in range(5):  # warm both paths (connections, first-call costs)
            await http_unary(http, url)
            await grpc_unary(stub)
        raw = RawHttp(mesh.http)
        await raw.open()
        await raw.unary()
        h, r, g = [], [], []
        for _ in range(args.pairs):
            h.append(await http_unary(http, url))
            r.append(await raw.unary())
            g.append(await grpc_unary(stub))
        await raw.close()
        for name, xs in (("HTTP (httpx2 client)", h), ("HTTP (raw socket client)", r)):
            print(f"1-token chat completion, {args.pairs} alternating rounds: {name} p50 {p50(xs) * 1e3:.2f} ms, "
                  f"gRPC Generate p50 {p50(g) * 1e3:.2f} ms; HTTP adds {(p50(xs) - p50(g)) * 1e3:+.2f} ms "
                  f"(ratio {p50(xs) / p50(g):.3f}); per-round difference p50 "
                  f"{p50([a - b for a, b in zip(xs, g)]) * 1e3:+.2f} ms", flush=True)

        ht, gt = [], []
        for _ in range(args.ttft_pairs):
            ht.append((await http_stream(http, url, args.tokens))[0])
            gt.append((await grpc_stream(stub, args.tokens))[0])
        print(f"streamed time to first token, {args.ttft_pairs} alternating pairs ({args.tokens} tokens): HTTP p50 "
              f"{p50(ht) * 1e3:.1f} ms, GenerateStream p50 {p50(gt) * 1e3:.1f} ms; ratio {p50(ht) / p50(gt):.3f}",
              flush=True)

        grpc_runs = await asyncio.gather(*(grpc_stream(stub, args.tokens) for _ in range(args.clients)),
                                         return_exceptions=True)
        http_runs = await asyncio.gather(
            http_stream(http, url, args.tokens, stall_s=args.stall_s),
            *(http_stream(http, url, args.tokens) for _ in range(args.clients - 1)), return_exceptions=True)
        failed = [r for r in http_runs if isinstance(r, BaseException) or not r[2]]
        failed_g = [r for r in grpc_runs if isinstance(r, BaseException) or not r[2]]
        others = [r for r in http_runs[1:] if not isinstance(r, BaseException)]
        fine_g = [r for r in grpc_runs if not isinstance(r, BaseException)]
        gaps_h, gaps_g = [r[1] for r in others], [r[1] for r in fine_g]
        took_h, took_g = [r[3] for r in others], [r[3] for r in fine_g]
        print(f"{args.clients} concurrent streams ({args.tokens} tokens), one HTTP client stalled {args.stall_s:.0f} "
              "s: "
              f"HTTP errors or streams without [DONE]: {len(failed)}, gRPC: {len(failed_g)}; the other streams' whole "
              "time: HTTP p50 "
              f"{p50(took_h):.2f} s max {max(took_h):.2f} s, gRPC p50 {p50(took_g):.2f} s max {max(took_g):.2f} s "
              f"(max ratio {max(took_h) / max(took_g):.3f}); their longest gap between events: HTTP p50 "
              f"{p50(gaps_h) * 1e3:.0f} ms max {max(gaps_h) * 1e3:.0f} ms, gRPC p50 {p50(gaps_g) * 1e3:.0f} ms max "
              f"{max(gaps_g) * 1e3:.0f} ms (max ratio {max(gaps_h) / max(gaps_g):.3f})", flush=True)
        for r in (failed + failed_g)[:4]:
            print(f"  failure: {str(r)[:300]}")


class StubGateway(gateway_pb2_grpc.GatewayServicer):
    """Answers without a model: the unary answer at once; a stream of ``tokens`` one-word deltas,
    ``step_s`` apart (as a decode step would), then the summary."""

    def __init__(self, step_s: float):
        self.step_s = step_s

    def _done(self, n: int) -> gateway_pb2.GenerateResponse:
        return gateway_pb2.GenerateResponse(text="Paris" * n, trace_id="0" * 32, finish_reason="length",
                                            system_fingerprint="0" * 16,
                                            usage=common_pb2.Usage(prompt_tokens=37, completion_tokens=n))

    async def Generate(self, request, context):
        await context.send_initial_metadata((("x-keel-trace-id", "0" * 32),))
        return self._done(request.sampling.max_tokens)

    async def GenerateStream(self, request, context):
        await context.send_initial_metadata((("x-keel-trace-id", "0" * 32),))
        for _ in range(request.sampling.max_tokens):
            await asyncio.sleep(self.step_s)
            yield gateway_pb2.GenerateStreamResponse(delta="Paris")
        yield gateway_pb2.GenerateStreamResponse(done=self._done(request.sampling.max_tokens))


async def serve_stub(port: int, step_s: float) -> None:
    server = grpc.aio.server()
    gateway_pb2_grpc.add_GatewayServicer_to_server(StubGateway(step_s), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


class StubMesh:
    """The stand-in gateway and the HTTP stage in front of it, each its own process."""

    def __init__(self, step_ms: float):
        gport, hport = free_port(), free_port()
        self.gateway, self.http = f"127.0.0.1:{gport}", f"127.0.0.1:{hport}"
        env = dict(os.environ, KEEL_OPENAI_SERVER__PORT=str(hport), KEEL_OPENAI_GATEWAY=f"[{self.gateway}]",
                   KEEL_LOG_LEVEL="WARNING")
        self.procs = [subprocess.Popen([sys.executable, "-m", __spec__.name, "--serve-stub", str(gport),
                                        "--stub-step-ms", str(step_ms)], cwd=ROOT),
                      subprocess.Popen([sys.executable, "-m", "services.openai"], cwd=ROOT, env=env,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
        health.wait_serving({"openai": (self.http, health.HTTP)}, 60)

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
            p.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--ttft-pairs", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--stall-s", type=float, default=5.0)
    ap.add_argument("--peer", choices=("mesh", "stub"), default="mesh")
    ap.add_argument("--stub-step-ms", type=float, default=20.0)
    ap.add_argument("--serve-stub", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the stub's own process
    args = ap.parse_args()
    if args.serve_stub:
        asyncio.run(serve_stub(args.serve_stub, args.stub_step_ms / 1000))
        return 0
    if args.peer == "stub":
        mesh = StubMesh(args.stub_step_ms)
        try:
            asyncio.run(run(mesh, args))
        finally:
            mesh.stop()
    else:
        with tempfile.TemporaryDirectory() as tmp:
            mesh = start_mesh(Path(tmp))
            try:
                asyncio.run(run(mesh, args))
            finally:
                stop_mesh(mesh)
    print(machine_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
