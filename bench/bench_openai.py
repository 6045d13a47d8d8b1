"""The OpenAI-compatible HTTP API against the gateway's gRPC API, same mesh, same run.

Run: .venv/bin/python bench/bench_openai.py [--pairs 200] [--ttft-pairs 40] [--clients 64]

Starts `python -m keelctl up` on free loopback ports (the real model), then:
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from keel.common.v1 import common_pb2  # noqa: E402
from keel.gateway.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402
from keelctl.ask import DEV_API_KEY  # noqa: E402
from shared.modelfile import MODEL_ID  # noqa: E402
from tests.e2e.conftest import start_mesh, stop_mesh  # noqa: E402

PROMPT = "What is the capital of France?"
MD = (("authorization", f"Bearer {DEV_API_KEY}"),)
HEADERS = {"Authorization": f"Bearer {DEV_API_KEY}"}


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


async def grpc_unary(stub) -> float:
    t0 = time.perf_counter()
    await stub.Generate(grpc_request(1), metadata=MD, timeout=120)
    return time.perf_counter() - t0


async def http_stream(http: httpx2.AsyncClient, url: str, tokens: int, stall_s: float = 0.0) -> tuple[float, float, bool]:
    """(time to the first content delta, the longest gap between two events, ended with [DONE])."""
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
    return first or 0.0, gap, done


async def grpc_stream(stub, tokens: int) -> tuple[float, float, bool]:
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
    return first or 0.0, gap, done


def p50(xs: list[float]) -> float:
    return statistics.median(xs)


def cpu_flags() -> str:
    text = Path("/proc/cpuinfo").read_text()
    return " ".join(sorted(set(re.findall(r"\b(avx2|avx512f|avx512_vnni|avx512_bf16|amx[a-z_]*)\b", text))))


async def run(mesh, args) -> None:
    url = f"http://{mesh.http}/v1/chat/completions"
    limits = httpx2.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    async with httpx2.AsyncClient(timeout=300, limits=limits) as http, grpc.aio.insecure_channel(mesh.gateway) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        for _ in range(5):  # warm both paths (connections, first-call costs)
            await http_unary(http, url)
            await grpc_unary(stub)
        h, g = [], []
        for _ in range(args.pairs):
            h.append(await http_unary(http, url))
            g.append(await grpc_unary(stub))
        print(f"1-token chat completion, {args.pairs} alternating pairs: HTTP p50 {p50(h) * 1e3:.2f} ms, "
              f"gRPC Generate p50 {p50(g) * 1e3:.2f} ms; HTTP adds {(p50(h) - p50(g)) * 1e3:+.2f} ms "
              f"(ratio {p50(h) / p50(g):.3f}); per-pair difference p50 "
              f"{p50([a - b for a, b in zip(h, g)]) * 1e3:+.2f} ms", flush=True)

        ht, gt = [], []
        for _ in range(args.ttft_pairs):
            ht.append((await http_stream(http, url, args.tokens))[0])
            gt.append((await grpc_stream(stub, args.tokens))[0])
        print(f"streamed time to first token, {args.ttft_pairs} alternating pairs ({args.tokens} tokens): HTTP p50 "
              f"{p50(ht) * 1e3:.1f} ms, GenerateStream p50 {p50(gt) * 1e3:.1f} ms; ratio {p50(ht) / p50(gt):.3f}",
              flush=True)

        t0 = time.perf_counter()
        grpc_runs = await asyncio.gather(*(grpc_stream(stub, args.tokens) for _ in range(args.clients)))
        grpc_wall = time.perf_counter() - t0
        t0 = time.perf_counter()
        http_runs = await asyncio.gather(
            http_stream(http, url, args.tokens, stall_s=args.stall_s),
            *(http_stream(http, url, args.tokens) for _ in range(args.clients - 1)), return_exceptions=True)
        http_wall = time.perf_counter() - t0
        failed = [r for r in http_runs if isinstance(r, BaseException) or not r[2]]
        others = [r for r in http_runs[1:] if not isinstance(r, BaseException)]
        gaps_h, gaps_g = [r[1] for r in others], [r[1] for r in grpc_runs]
        print(f"{args.clients} concurrent streams ({args.tokens} tokens), one HTTP client stalled {args.stall_s:.0f} s: "
              f"HTTP errors or streams without [DONE]: {len(failed)}; wall HTTP {http_wall:.1f} s vs gRPC "
              f"{grpc_wall:.1f} s (ratio {http_wall / grpc_wall:.3f}); longest gap between events of the other "
              f"streams: HTTP p50 {p50(gaps_h) * 1e3:.0f} ms max {max(gaps_h) * 1e3:.0f} ms, gRPC p50 "
              f"{p50(gaps_g) * 1e3:.0f} ms max {max(gaps_g) * 1e3:.0f} ms (max ratio "
              f"{max(gaps_h) / max(gaps_g):.3f})", flush=True)
        for r in failed[:3]:
            print(f"  failure: {r!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--ttft-pairs", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--stall-s", type=float, default=5.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mesh = start_mesh(Path(tmp))
        try:
            asyncio.run(run(mesh, args))
        finally:
            stop_mesh(mesh)
    print(f"CPU flags: {cpu_flags()}; {os.cpu_count()} cores; load average at the end "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}; git {subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True, cwd=ROOT).stdout.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
