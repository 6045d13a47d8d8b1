"""The engine's per-token work outside the model step, before and after Keel's ops for it:
sampling.pick (greedy: argmax, logprob, entropy), the check that the logits are finite, and the block
formats' embedding lookup.

  pick   torch  the previous pick's torch ops (log_softmax, exp, product, fixed-order row sums,
                argmax: sampling._torch_stats, still pick's path off CPU float32 or without kernels)
         keel   sampling.pick on CPU float32 rows: one keel::row_stats call (kernels/rowstats.cpp)
  finite torch  logits.abs().amax(-1) < inf (sampling.row_is_finite's path off CPU float32 or without kernels)
         keel   sampling.row_is_finite on CPU float32 rows: one keel::rows_finite call (rowstats.cpp)
  embed  torch  the previous BlockEmbedding lookup: unpack_x16's torch ops, then the torch formula of
                Q4_1/Q8_0 or gguf-py's numpy dequantization of the other types (tests' gguf_fixtures
                keep both as the reference)
         keel   BlockEmbedding.forward: one keel::gguf_rows call (kernels/gguf_mm.cpp)

At V = 151936 (Qwen2.5-0.5B's vocabulary, hidden 896) and V = 49152 (SmolLM2's, hidden 576), 1 and 16
rows; the embedding as x16 Q8_0 (the Q4_K_M files' embedding type) and x16 Q5_0 (a type the previous
lookup sent to gguf-py). Random logits N(0, 4^2), random blocks. Each (variant, case) runs in a fresh
process, the variants alternated, --repeats times; a process reports the median of 5 rounds of calls
per row count. Printed: each variant's median over the repeats with its min-max, and torch / keel.

Run: .venv/bin/python -m bench.bench_sampler [--repeats 3] [--what pick,finite,embed]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VOCABS = ((151936, 896), (49152, 576))
ROWS = (1, 16)
EMBED_TYPES = ("Q8_0", "Q5_0")
VARIANTS = ("torch", "keel")


def per_call_us(fn, calls: int, rounds: int = 5) -> float:
    for _ in range(max(3, calls // 10)):
        fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times) * 1e6


def child(variant: str, what: str, v: int, e: int, type_name: str) -> dict[int, float]:
    import gguf
    import torch

    from services.inference.engine import sampling
    from services.inference.model import blocks, kernels

    kernels.load()
    out = {}
    if what == "pick":
        for rows in ROWS:
            logits = torch.randn(rows, v, generator=torch.Generator().manual_seed(rows)) * 4
            draws = [sampling.Draw(0.0, 1.0, 0, 0, 10)] * rows
            fn = ((lambda: sampling._torch_stats(logits, logits, [-1] * rows)) if variant == "torch"
                  else (lambda: sampling.pick(logits, draws)))
            out[rows] = per_call_us(fn, 20 if rows > 1 else 50)
        return out
    if what == "finite":
        for rows in ROWS:
            logits = torch.randn(rows, v, generator=torch.Generator().manual_seed(rows)) * 4
            fn = ((lambda: logits.abs().amax(dim=-1) < float("inf")) if variant == "torch"
                  else (lambda: sampling.row_is_finite(logits)))
            out[rows] = per_call_us(fn, 200)
        return out
    from tests.inference.gguf_fixtures import dequantize_rows, unpack_x16
    from tests.inference.test_gguf_types import random_weights

    t = int(gguf.GGMLQuantizationType[type_name])
    packed = blocks.pack_x16(random_weights(t, v, e, seed=0), t)
    emb = blocks.BlockEmbedding(packed, t, e, x16=True)
    for rows in ROWS:
        ids = torch.randint(0, v, (rows,), generator=torch.Generator().manual_seed(rows))
        fn = ((lambda: dequantize_rows(unpack_x16(packed, ids, t), t)) if variant == "torch"
              else (lambda: emb(ids)))
        out[rows] = per_call_us(fn, 500)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--what", default="pick,finite,embed", help="which of pick, finite, embed to time")
    ap.add_argument("--child", nargs=5, metavar=("VARIANT", "WHAT", "V", "E", "TYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        variant, what, v, e, type_name = args.child
        print(json.dumps(child(variant, what, int(v), int(e), type_name)))
        return
    from bench.lib.machine import machine_line

    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    cases = ([(what, v, e, "-") for what in ("pick", "finite") for v, e in VOCABS]
             + [("embed", v, e, t) for v, e in VOCABS for t in EMBED_TYPES])
    cases = [c for c in cases if c[0] in args.what.split(",")]
    seen: dict[tuple, list[float]] = {}
    for rep in range(args.repeats):
        for what, v, e, t in cases:
            order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]  # alternate which variant runs first
            for variant in order:
                res = subprocess.run([sys.executable, "-m", "bench.bench_sampler", "--child", variant, what, str(v),
                                      str(e), t], capture_output=True, text=True, check=True)
                for rows, us in json.loads(res.stdout.strip().splitlines()[-1]).items():
                    seen.setdefault((what, v, t, int(rows), variant), []).append(us)
    print(f"{'what':6} {'V':>7} {'type':5} {'rows':>4} {'torch us (min-max)':>24} {'keel us (min-max)':>22} "
          f"{'torch/keel':>10}")
    for what, v, e, t in cases:
        for rows in ROWS:
            a, b = seen[(what, v, t, rows, "torch")], seen[(what, v, t, rows, "keel")]
            ma, mb = statistics.median(a), statistics.median(b)
            print(f"{what:6} {v:7d} {t:5} {rows:4d} {ma:10.1f} ({min(a):.1f}-{max(a):.1f}) "
                  f"{mb:9.1f} ({min(b):.1f}-{max(b):.1f}) {ma / mb:10.1f}")
    print(machine_line())


if __name__ == "__main__":
    main()
