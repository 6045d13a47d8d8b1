"""Echo scoring, as an evaluation harness does it: N (context, continuation) pairs, each the
loglikelihood of the continuation's tokens after the context, through Keel's HTTP API beside
llama.cpp on the same GGUF.

Keel: the whole mesh (`keel up` on free ports, engine.format as --format with formats.force); each
pair is one /v1/completions request as lm-evaluation-harness's local-completions sends it (token-id
prompt, echo, logprobs 1, max_tokens 1), --clients at a time over HTTP; the continuation's score is
the sum of its tokens' `token_logprobs`. llama.cpp: llama-cpp-python in a fresh process after the
mesh stopped (2 threads, logits_all), each pair evaluated from a reset context, the same sums from
its logits. Both score the same ids; the figure is pairs per second, and the largest difference
between the two scores of a pair is printed beside it (the formats are not the same arithmetic).

Run: .venv/bin/python -m bench.bench_scoring [--pairs 1000] [--clients 8] [--format gguf]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.bench_inference import machine
from keelctl.ask import DEV_API_KEY
from services.inference.formats.gateprompts import SUBJECTS
from services.tokenizer.compiler import compiled_path
from services.tokenizer.core import Tokenizer
from shared.modelfile import model_id, model_path
from shared.modelfile import source as model_source
from testing.mesh import start_mesh, stop_mesh

ENDINGS = (" is a place worth knowing.", " has a long history.", " was founded long ago by traders.",
           " is known for its food, its music and its people.")

PEER = """
import json, sys, time
import numpy as np
from llama_cpp import Llama
pairs = json.loads(sys.stdin.read())
llm = Llama(model_path=sys.argv[1], n_threads=2, n_ctx=512, logits_all=True, verbose=False, seed=0)
out, t0 = [], time.perf_counter()
for ctx, cont in pairs:
    ids = ctx + cont
    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[len(ctx) - 1:len(ids) - 1], dtype=np.float64)
    logz = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    out.append(float(sum(logits[i, t] - logz[i] for i, t in enumerate(cont))))
print(json.dumps({"seconds": time.perf_counter() - t0, "scores": out}))
"""


def pairs(n: int) -> list[tuple[list[int], list[int]]]:
    tok = Tokenizer.open(compiled_path(model_source()))
    out = []
    for i in range(n):
        subject, ending = SUBJECTS[i // len(ENDINGS) % len(SUBJECTS)], ENDINGS[i % len(ENDINGS)]
        out.append((tok.encode_ids(f"Question {i}: tell me about {subject}. Answer: {subject}"),
                    tok.encode_ids(ending)))
    return out


async def keel_scores(http: str, work: list[tuple[list[int], list[int]]], clients: int) -> tuple[float, list[float]]:
    scores: list[float] = [0.0] * len(work)
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(len(work)):
        queue.put_nowait(i)

    async def client(session: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            ctx, cont = work[i]
            r = await session.post("/v1/completions", json={
                "model": model_id(), "prompt": [ctx + cont], "echo": True, "logprobs": 1, "max_tokens": 1,
                "temperature": 0, "seed": 1234})
            r.raise_for_status()
            lp = r.json()["choices"][0]["logprobs"]["token_logprobs"]
            scores[i] = sum(lp[len(ctx):len(ctx) + len(cont)])

    async with httpx.AsyncClient(base_url=f"http://{http}", timeout=600,
                                 headers={"authorization": f"Bearer {DEV_API_KEY}"}) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        return time.perf_counter() - t0, scores


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--format", default="gguf")
    args = ap.parse_args(argv)
    work = pairs(args.pairs)
    mesh = start_mesh(Path(tempfile.mkdtemp(prefix="keel-scoring-")),
                      extra_env={"KEEL_INFERENCE_ENGINE__FORMAT": args.format, "KEEL_INFERENCE_FORMATS__FORCE": "true"})
    try:
        asyncio.run(keel_scores(mesh.http, work[:16], args.clients))  # warm: connections, first steps
        keel_s, ours = asyncio.run(keel_scores(mesh.http, work, args.clients))
    finally:
        stop_mesh(mesh)
    print(f"keel: {args.pairs} pairs in {keel_s:.1f} s ({args.clients} clients)", flush=True)
    out = subprocess.run([sys.executable, "-c", PEER, str(model_path())], input=json.dumps(work),
                         capture_output=True, text=True, check=True)
    peer = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"llama.cpp: {args.pairs} pairs in {peer['seconds']:.1f} s", flush=True)
    diff = max(abs(a - b) for a, b in zip(ours, peer["scores"]))
    print(json.dumps({"pairs": args.pairs, "clients": args.clients, "format": args.format,
                      "keel_pairs_per_s": round(args.pairs / keel_s, 1),
                      "llamacpp_pairs_per_s": round(args.pairs / peer["seconds"], 1),
                      "ratio": round(peer["seconds"] / keel_s, 2), "max_score_diff": round(diff, 4),
                      "machine": machine()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
