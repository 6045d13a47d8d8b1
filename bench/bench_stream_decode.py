"""Per-chunk cost of streamed text at the gateway: unary Decode per chunk (the former path) against
the tokenizer's DecodeStream (the current path), same run, same mesh, same ids.

Run: .venv/bin/python -m bench.bench_stream_decode [--tokens 300] [--rounds 5]

Starts a real mesh (`python -m keelctl up`, as tests/e2e do) and drives its tokenizer through the
gateway's own transport (services/gateway/upstreams.py MeshUpstreams), one token per chunk, which is
what a stream at generation speed sends:

- unary: one Decode call per chunk on the ids not yet emitted, a result ending in U+FFFD held back
  (the window then grows), and the whole answer decoded once more at the end (what the gateway did
  before DecodeStream);
- stream: one DecodeStream per answer, one write/read per chunk, finish with the last.

Rounds alternate the two paths; the figure is the median over rounds of (total time / chunks).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench.bench_inference import machine
from services.gateway.streamtext import StreamedText
from services.gateway.upstreams import MeshUpstreams
from services.tokenizer.compiler import compiled_path
from services.tokenizer.core import Tokenizer
from shared.modelfile import source as model_source
from testing.mesh import start_mesh, stop_mesh

ROOT = Path(__file__).resolve().parent.parent

TEXT = ("The capital of France is Paris. 巴黎是法国的首都，人口约两百万。 Emoji too: \U0001F600\U0001F680 "
        "and accents: déjà vu, naïve, Grüße. ")


async def unary(up: MeshUpstreams, ids: list[int]) -> str:
    emitted, read = "", 0
    for n in range(1, len(ids) + 1):
        text = await up.decode(ids[read:n], 30.0, {})
        if not text.endswith("\ufffd"):
            emitted, read = emitted + text, n
    raw = await up.decode(ids, 30.0, {})
    return emitted + raw[len(emitted):]


async def streamed(up: MeshUpstreams, ids: list[int]) -> str:
    text = StreamedText(up.decode_stream)
    for n, i in enumerate(ids, 1):
        await text.attempt([i], n == len(ids))(30.0, {})
    return text.text


async def run(target: str, ids: list[int], rounds: int) -> dict[str, list[float]]:
    up = MeshUpstreams({"tokenizer": (target,), "inference": (target,), "validator": (target,)},
                       4 * 1024 * 1024, 5.0)
    up.pools["tokenizer"].start()
    await up.pools["tokenizer"].pick(30.0)
    per_chunk: dict[str, list[float]] = {"unary": [], "stream": []}
    try:
        for path in ("unary", "stream"):  # warm both paths once
            await (unary if path == "unary" else streamed)(up, ids[:20])
        results = {}
        for _ in range(rounds):
            for path, fn in (("unary", unary), ("stream", streamed)):
                t0 = time.perf_counter()
                results[path] = await fn(up, ids)
                per_chunk[path].append((time.perf_counter() - t0) / len(ids))
        assert results["unary"] == results["stream"], "the two paths disagree on the text"
    finally:
        await up.pools["tokenizer"].close()
    return per_chunk


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    tok = Tokenizer.open(compiled_path(model_source()))
    ids = (tok.encode_ids(TEXT) * (args.tokens // 10 + 1))[:args.tokens]
    mesh = start_mesh(Path(tempfile.mkdtemp(prefix="keel-bench-")))
    try:
        pid = mesh.state()["processes"]["tokenizer-0.0"]["pid"]
        os.environ["KEEL_MESH_TOKEN"] = psutil.Process(pid).environ()["KEEL_MESH_TOKEN"]
        per_chunk = asyncio.run(run(f"127.0.0.1:{mesh.ports['tokenizer'][0]}", ids, args.rounds))
    finally:
        stop_mesh(mesh)
    u, s = (statistics.median(per_chunk[p]) * 1e6 for p in ("unary", "stream"))
    print(f"| path | per chunk, median of {args.rounds} rounds (us) | rounds (us) |\n|---|---|---|\n"
          f"| unary Decode per chunk + final Decode (before) | {u:.0f} | "
          f"{', '.join(f'{x * 1e6:.0f}' for x in per_chunk['unary'])} |\n"
          f"| DecodeStream (after) | {s:.0f} | {', '.join(f'{x * 1e6:.0f}' for x in per_chunk['stream'])} |\n\n"
          f"Ratio before/after: {u / s:.2f}x ({len(ids)} tokens, one per chunk). Machine: {machine()}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
