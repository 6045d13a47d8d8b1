"""An 8192-token context: time to the first token of a prompt that fills it, Keel beside llama.cpp on the
same GGUF, and a flood of such prompts against the inference stage's memory budget.

The whole mesh runs (`keel up` on free ports, the served model, engine.format as --format with
formats.force, the prefix cache off so no run reuses another's prompt). Keel's TTFT is measured at the
inference stage (pre-tokenized ids with the mesh token, as bench_serving's "stage" path: the gateway's
text limits are not what is measured), from the call to the first token event. llama.cpp
(llama-cpp-python, 2 threads, n_ctx 8192, its default batch) runs in a fresh process after the mesh
stopped, on the same ids, its cache reset before each run. The flood then sends --flood such prompts
at once and samples the inference process's RSS every 50 ms: its peak beside engine.memory_budget_bytes.

Run: .venv/bin/python -m bench.bench_long_prompt [--rounds 3] [--tokens 8180] [--format gguf] [--flood 8]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import psutil

from bench.bench_inference import machine
from keel.common.v1 import common_pb2
from keel.inference.v1 import inference_pb2, inference_pb2_grpc
from services.inference import config as inference_config
from services.inference.formats.gateprompts import SUBJECTS
from services.tokenizer.compiler import compiled_path
from services.tokenizer.core import Tokenizer
from shared.meshauth import HEADER as MESH_TOKEN_KEY
from shared.modelfile import model_path
from shared.modelfile import source as model_source
from testing.mesh import start_mesh, stop_mesh

PEER = """
import json, sys, time
from llama_cpp import Llama
ids, rounds = json.loads(sys.stdin.read()), int(sys.argv[2])
llm = Llama(model_path=sys.argv[1], n_threads=2, n_ctx=8192, verbose=False, seed=0)
out = []
for _ in range(rounds):
    llm.reset()
    t0 = time.perf_counter()
    next(llm.generate(ids, top_k=1, temp=0.0))
    out.append(time.perf_counter() - t0)
print(json.dumps(out))
"""


def prompt_ids(tokens: int) -> list[int]:
    tok = Tokenizer.open(compiled_path(model_source()))
    text = " ".join(f"Tell me about {s}, its history, its people and what makes it different." for s in SUBJECTS)
    ids: list[int] = []
    while len(ids) < tokens:
        ids += tok.encode_ids(text)
    return ids[:tokens]


async def first_token_s(target: str, token: str, ids: list[int], max_tokens: int = 1) -> float:
    async with grpc.aio.insecure_channel(target) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        req = inference_pb2.GenerateRequest(prompt_ids=ids, sampling=common_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, seed=0))
        t0 = time.perf_counter()
        async for ev in stub.Generate(req, metadata=((MESH_TOKEN_KEY, token),), timeout=900):
            if ev.HasField("token"):
                return time.perf_counter() - t0
    raise RuntimeError("no token")


def peak_rss(pid: int, stop: threading.Event, out: list[int]) -> None:
    proc, peak = psutil.Process(pid), 0
    while not stop.is_set():
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.05)
    out.append(peak)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8180)
    ap.add_argument("--format", default="gguf")
    ap.add_argument("--flood", type=int, default=8)
    args = ap.parse_args(argv)
    ids = prompt_ids(args.tokens)
    budget = inference_config.load().engine.memory_budget_bytes
    tmp = Path(tempfile.mkdtemp(prefix="keel-long-"))
    mesh = start_mesh(tmp, extra_env={"KEEL_INFERENCE_ENGINE__FORMAT": args.format,
                                      "KEEL_INFERENCE_FORMATS__FORCE": "true",
                                      "KEEL_INFERENCE_ENGINE__PREFIX_CACHE_BYTES": "0"})
    try:
        state = mesh.state()
        target, token = f"127.0.0.1:{mesh.ports['inference'][0]}", state["mesh_token"]
        pid = next(p["pid"] for name, p in state["processes"].items() if name.startswith("inference"))
        keel = [asyncio.run(first_token_s(target, token, ids)) for _ in range(args.rounds)]
        print(f"keel TTFT {[round(x, 2) for x in keel]} s", flush=True)
        stop, peaks = threading.Event(), []
        watcher = threading.Thread(target=peak_rss, args=(pid, stop, peaks))
        watcher.start()
        t0 = time.perf_counter()

        async def flood():
            return await asyncio.gather(*(first_token_s(target, token, ids[:-i - 1] + [ids[i]], max_tokens=4)
                                          for i in range(args.flood)), return_exceptions=True)
        results = asyncio.run(flood())
        stop.set()
        watcher.join()
        refused = [str(r)[:120] for r in results if isinstance(r, Exception)]
        print(f"flood of {args.flood}: {time.perf_counter() - t0:.1f} s, peak RSS {peaks[0] / 1e9:.2f} GB, "
              f"budget {budget / 1e9:.2f} GB, refused {len(refused)} {refused[:2]}", flush=True)
    finally:
        stop_mesh(mesh)
    out = subprocess.run([sys.executable, "-c", PEER, str(model_path()), str(args.rounds)], input=json.dumps(ids),
                         capture_output=True, text=True, check=True)
    peer = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"llama.cpp TTFT {[round(x, 2) for x in peer]} s", flush=True)
    k, p = statistics.median(keel), statistics.median(peer)
    print(json.dumps({"prompt_tokens": len(ids), "format": args.format, "keel_ttft_s": round(k, 2),
                      "llamacpp_ttft_s": round(p, 2), "ratio": round(k / p, 2), "flood": args.flood,
                      "flood_peak_rss_gb": round(peaks[0] / 1e9, 2), "budget_gb": round(budget / 1e9, 2),
                      "flood_refused": len(refused), "machine": machine()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
