"""The cost of the mesh: the same prompts in-process (tokenizer core + engine + validator core)
and through the gateway of a real mesh (five gRPC hops, retries, traces, validation), same run.

Run: .venv/bin/python -m bench.bench_mesh [--prompts 16] [--tokens 16] [--concurrency 1,4,16]
     [--write docs/bench/mesh.md]

Step 1 runs in-process and frees the model; step 2 starts `python -m keelctl up` on free loopback
ports (Redis + 4 stages, the real model) and drives the gateway with concurrent clients.
Greedy decoding on both sides, so both produce the same tokens; mesh overhead = p50 latency
difference per request at concurrency 1.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import psutil

from bench.bench_inference import engine_for, machine
from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from keelctl.ask import DEV_API_KEY
from services.inference.engine.core import GenerationRequest, TokenEvent
from services.inference.engine.torchthread import TorchThread
from services.inference.formats.gateprompts import FORMS, SUBJECTS
from services.inference.model.loader import load_model
from services.tokenizer.compiler import compiled_path
from services.tokenizer.core import Tokenizer
from services.validator import config as validator_config
from services.validator.core import ValidatorCore
from services.validator.output_pipeline import PipelineConfig
from shared.modelfile import source as model_source
from testing.mesh import start_mesh, stop_mesh

ROOT = Path(__file__).resolve().parent.parent


def texts(n: int) -> list[str]:
    return [f.format(s) for f in FORMS for s in SUBJECTS][:n]


async def in_process(prompts: list[str], tokens: int) -> list[float]:
    tok = Tokenizer.open(compiled_path(model_source()))
    tok.self_check()
    tok.warmup()
    # All torch work on one thread, as the stage does (services/inference/engine/torchthread.py says why).
    torch_thread = TorchThread()
    model = await torch_thread.run(load_model, model_source().cache_dir)
    engine = await torch_thread.run(lambda: engine_for(model, "cpu", "float32", eos_token_ids=(2,)))
    await engine.start(torch_thread)
    vcfg = validator_config.load()
    core = ValidatorCore.build(vcfg.path(vcfg.contracts_dir), PipelineConfig.load(vcfg.path(vcfg.pipeline_file)),
                               vcfg.quarantine)
    lat = []
    for i, text in enumerate(prompts):
        t0 = time.perf_counter()
        core.validate_input(json.dumps({"prompt": text, "max_tokens": tokens}), source="default",
                            domain="default", trace_id="")
        ids = tok.encode(tok.render_chat([("user", text)])).input_ids
        out, ent = [], []
        async for ev in engine.generate(GenerationRequest(f"m{i}", ids, tokens)):
            if isinstance(ev, TokenEvent):
                out.append(ev.token_id)
                ent.append(ev.entropy)
        core.validate_output(tok.decode(out, skip_special_tokens=True), domain="default", token_entropies=ent)
        lat.append(time.perf_counter() - t0)
    await engine.stop(1.0)
    return lat


def request(text: str, tokens: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt=text, sampling=common_pb2.SamplingParams(max_tokens=tokens))


async def through_mesh(target: str, prompts: list[str], tokens: int,
                       concurrency: int) -> tuple[list[float], float, int]:
    gate = asyncio.Semaphore(concurrency)
    lat: list[float] = []
    generated = 0
    async with grpc.aio.insecure_channel(target) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)

        async def one(text: str) -> None:
            nonlocal generated
            async with gate:
                t0 = time.perf_counter()
                resp = await stub.Generate(request(text, tokens), metadata=(("x-api-key", DEV_API_KEY),), timeout=600)
                lat.append(time.perf_counter() - t0)
                generated += resp.usage.completion_tokens
        t0 = time.perf_counter()
        await asyncio.gather(*(one(t) for t in prompts))
        wall = time.perf_counter() - t0
    return lat, generated / wall, generated


def validator_ms(traces: Path) -> list[float]:
    """Per request: time the gateway spent in its calls to the validator (client spans, both calls;
    since the input check runs beside the encoding, this over-counts what it adds to latency)."""
    per_trace: dict[str, float] = {}
    for f in traces.glob("gateway-*.jsonl"):
        for line in f.read_text().splitlines():
            span = json.loads(line)
            if span["name"].startswith("call validator/"):
                per_trace[span["trace_id"]] = per_trace.get(span["trace_id"], 0.0) + span["duration_ms"]
    return sorted(per_trace.values())


def outside_model_ms(traces: Path) -> list[float]:
    """Per request: the gateway's whole span minus the inference stage's own span, i.e. the time
    the mesh (hops, tokenizer, validator, gateway) adds around the model. Same requests, no
    cross-process noise from the generation itself."""
    spans: dict[str, dict[str, float]] = {}
    for f in traces.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            s = json.loads(line)
            if s["name"] in ("gateway/Generate", "inference/Generate"):
                spans.setdefault(s["trace_id"], {})[s["name"]] = s["duration_ms"]
    return sorted(v["gateway/Generate"] - v["inference/Generate"] for v in spans.values() if len(v) == 2)


def span_medians(traces: Path) -> str:
    """Median duration per span name over the requests that reached inference: the gateway's client
    span of each call next to the called stage's own server span (the hop is the difference)."""
    spans: dict[str, list[float]] = {}
    for f in traces.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            s = json.loads(line)
            if "/" in s["name"]:
                spans.setdefault(s["name"], []).append(s["duration_ms"])
    return "\n".join(["| span | median ms | spans |", "|---|---|---|"] + [
        f"| {name} | {statistics.median(d):.2f} | {len(d)} |" for name, d in sorted(spans.items())])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    ap.add_argument("--hygiene", type=int, default=100, help="sequential requests for the RSS check")
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    prompts = texts(args.prompts)
    local = asyncio.run(in_process(prompts, args.tokens))
    lines = ["| path | concurrency | p50 ms | p99 ms | tokens/s |", "|---|---|---|---|---|",
             f"| in-process (tokenizer core + engine + validator core) | 1 | {statistics.median(local) * 1e3:.1f} "
             f"| {max(local) * 1e3:.1f} | - |"]
    mesh = start_mesh(Path(tempfile.mkdtemp(prefix="keel-bench-")))
    try:
        inference = psutil.Process(mesh.state()["processes"]["inference-0.0"]["pid"])
        rss_warm = inference.memory_info().rss
        asyncio.run(through_mesh(mesh.gateway, prompts[:2], args.tokens, 1))  # first-use effects out of the way
        rss_before = inference.memory_info().rss
        asyncio.run(through_mesh(mesh.gateway, (prompts * 100)[:args.hygiene], 4, 1))
        rss_after = inference.memory_info().rss
        p50_mesh_1 = None
        for c in args.concurrency:
            lat, tok_s, _ = asyncio.run(through_mesh(mesh.gateway, prompts, args.tokens, c))
            if c == 1:
                time.sleep(1)  # let the span exporter flush
                val = validator_ms(mesh.tmp / "traces")
                outside = outside_model_ms(mesh.tmp / "traces")
                breakdown = span_medians(mesh.tmp / "traces")
            p50 = statistics.median(lat) * 1e3
            p50_mesh_1 = p50 if c == 1 else p50_mesh_1
            lines.append(f"| through the mesh (gateway) | {c} | {p50:.1f} | {max(lat) * 1e3:.1f} | {tok_s:.1f} |")
    finally:
        stop_mesh(mesh)
    summary = (f"\nMesh overhead from the traces (gateway span minus inference span, {len(outside)} requests at "
               f"concurrency 1): p50 {statistics.median(outside):.2f} ms, p99 "
               f"{outside[int(0.99 * (len(outside) - 1))]:.2f} ms.\n"
               f"\nSpans at concurrency 1 (every request so far; `call X` is the gateway's side of a "
               f"hop):\n\n{breakdown}\n"
               f"\nValidator's share of a request through the mesh (both calls, gateway client spans, "
               f"{len(val)} requests): p50 {statistics.median(val):.2f} ms, p99 {val[int(0.99 * (len(val) - 1))]:.2f} "
               "ms.\n"
               f"\nInference stage RSS after warm-up: {rss_warm / 2**20:.1f} MiB (fp32); over {args.hygiene} "
               f"sequential requests after the first two: {(rss_after - rss_before) / 2**20:+.2f} MiB.\n"
               f"\nEnd-to-end difference at concurrency 1 (mesh p50 minus in-process p50, two different processes, "
               f"so it carries the generation's run-to-run noise): {p50_mesh_1 - statistics.median(local) * 1e3:.1f} "
               "ms "
               f"({args.prompts} prompts x up to {args.tokens} tokens, greedy). Machine: {machine()}.")
    out = "\n".join(lines) + summary
    print(out)
    if args.write:
        args.write.write_text("# Mesh overhead\n\nCommand: `.venv/bin/python -m bench.bench_mesh "
                              f"--prompts {args.prompts} --tokens {args.tokens} --concurrency "
                              f"{','.join(map(str, args.concurrency))} --hygiene {args.hygiene} --write "
                              f"{args.write}`\n\n{out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
