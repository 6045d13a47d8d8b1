"""Decode step time of the block-pool forward pass (batched decode attention) against the per-row loop it
replaced, on the real weights, 1 intra-op thread, each configuration in a fresh process.

The per-row peer is `services/inference/model/forward.py` as it stands on the git ref given by --peer-ref
(default: the commit before the block pool), loaded from `git show` into a temporary file; every
other module is this tree's. Rows have mixed context lengths (the pool pads their block tables to the
longest one's). --pow2 adds a pool peer whose capacity is rounded up to a power of two blocks (the same
bits, more copying). --rounds N runs every configuration N times, alternating, and keeps the fastest.
Prints a markdown table.

Run: .venv/bin/python -m bench.bench_kvpool [--batches 1 16] [--formats float32 bfloat16] [--blocks 16 32]
     [--pow2] [--rounds 1]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shared.modelfile import source as model_source

ROOT = Path(__file__).resolve().parent.parent


def contexts(batch: int) -> list[int]:
    """Mixed prompt lengths, 24..231 tokens."""
    return [24 + (i * 53) % 208 for i in range(batch)]


def worker(kind: str, format: str, batch: int, block_tokens: int, peer_file: str, steps: int) -> dict:
    import torch

    from services.inference.model.loader import load_model
    torch.set_num_threads(1)
    if kind == "per-row":
        spec = importlib.util.spec_from_file_location("peer_forward", peer_file)
        module = sys.modules["peer_forward"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        runner = module.LlamaRunner(load_model(model_source().cache_dir, format))
    else:
        from services.inference.model.forward import DecodeView, LlamaRunner

        class Pow2Runner(LlamaRunner):
            """The engine's runner with the decode block tables padded further, to a power of two blocks."""

            def _decode_view(self, caches):
                view = super()._decode_view(caches)
                extra = (1 << (view.table.shape[1] - 1).bit_length()) - view.table.shape[1]
                table = torch.nn.functional.pad(view.table, (0, extra))  # block 0: the padding block
                masked = None if view.masked is None else torch.nn.functional.pad(
                    view.masked, (0, extra * self.block_tokens), value=True)
                return DecodeView(table, view.lengths, masked)

        cls = Pow2Runner if kind == "pool-pow2" else LlamaRunner
        runner = cls(load_model(model_source().cache_dir, format), block_tokens=block_tokens)
    if batch < 16:  # as the engine does: dense layers padded to invariant sizes (16 rows need no padding)
        runner.calibrate_invariant_sizes(16)
    lengths = contexts(batch)
    caches = [runner.new_cache(n + steps + 8) for n in lengths]
    for i, (n, c) in enumerate(zip(lengths, caches)):
        runner.prefill([10 + (i * 31 + j) % 40000 for j in range(n)], c)
    for _ in range(2):
        runner.decode([5] * batch, caches)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        runner.decode([5] * batch, caches)
        times.append(time.perf_counter() - t0)
    return {"ms": statistics.median(times) * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--formats", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--blocks", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--peer-ref", default="main")
    ap.add_argument("--pow2", action="store_true")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(**json.loads(args.worker))))
        return 0
    old = subprocess.run(["git", "show", f"{args.peer_ref}:services/inference/model/forward.py"], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout
    if "class KvPool" in old or "kvpool" in old:
        sys.exit(f"{args.peer_ref} already has the block pool; give --peer-ref a commit before it")
    from bench.bench_inference import machine
    with tempfile.TemporaryDirectory() as tmp:
        peer = Path(tmp) / "peer_forward.py"
        peer.write_text(old)
        print(f"load average before: {', '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
        kinds = [("pool", b) for b in args.blocks] + ([("pool-pow2", args.blocks[0])] if args.pow2 else [])
        header = " | ".join(f"{k} b{b} ms/step | ratio" for k, b in kinds)
        print(f"| format | batch | per-row loop ms/step | {header} |\n|---|---|---|" + "---|---|" * len(kinds))
        for format in args.formats:
            for batch in args.batches:
                row = {}
                for _ in range(args.rounds):
                    for kind, blocks in [("per-row", 0)] + kinds:
                        spec = dict(kind=kind, format=format, batch=batch, block_tokens=blocks or 16,
                                    peer_file=str(peer), steps=args.steps)
                        out = subprocess.run([sys.executable, "-m", __spec__.name, "--worker", json.dumps(spec)],
                                             cwd=ROOT, check=True, capture_output=True, text=True).stdout
                        ms = json.loads(out.strip().splitlines()[-1])["ms"]
                        row[(kind, blocks)] = min(ms, row.get((kind, blocks), ms))
                base = row[("per-row", 0)]
                cells = " | ".join(f"{row[k]:.1f} | {row[k] / base:.2f}x" for k in kinds)
                print(f"| {format} | {batch} | {base:.1f} | {cells} |", flush=True)
        print(f"\nMachine: {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
