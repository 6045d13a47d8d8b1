"""Would batching decode attention across rows pay, and would it keep batch invariance?

Compares, for one layer of SmolLM2's shapes (3 KV heads x 3 query heads each, head_dim 64):
  per-row   the engine's way: one SDPA call per row over exactly its own cache
  padded    rows' caches gathered into one zero-padded [B, KV, Lmax, D] tensor with a -inf mask,
            one SDPA call
  manual    the same gather, then matmul + float32 softmax + matmul
Time per layer at B=16 with contexts of 40..200 tokens, and how many rows of random batches
(B in 1, 2, 5, 16; contexts 1..300) differ bit for bit from the same row computed alone.

Run: .venv/bin/python bench/probe_batched_attention.py [--trials 200]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench_inference import machine  # noqa: E402

KV, G, D, SCALE = 3, 3, 64, 64 ** -0.5


def per_row(qs, keys, values, dtype):
    return torch.stack([F.scaled_dot_product_attention(q.view(1, KV, G, D), k[None], v[None], scale=SCALE).reshape(-1)
                        for q, k, v in zip(qs, keys, values)])


def _gather(qs, keys, values, dtype):
    rows, width = len(qs), max(k.shape[1] for k in keys)
    kp, vp = torch.zeros(rows, KV, width, D, dtype=dtype), torch.zeros(rows, KV, width, D, dtype=dtype)
    mask = torch.full((rows, 1, 1, width), float("-inf"))
    for b, (k, v) in enumerate(zip(keys, values)):
        kp[b, :, :k.shape[1]], vp[b, :, :k.shape[1]] = k, v
        mask[b, ..., :k.shape[1]] = 0
    return torch.stack(qs).view(rows, KV, G, D), kp, vp, mask


def padded(qs, keys, values, dtype):
    q, kp, vp, mask = _gather(qs, keys, values, dtype)
    return F.scaled_dot_product_attention(q, kp, vp, attn_mask=mask.to(dtype), scale=SCALE).reshape(len(qs), -1)


def manual(qs, keys, values, dtype):
    q, kp, vp, mask = _gather(qs, keys, values, dtype)
    probs = torch.softmax(torch.matmul(q, kp.transpose(-1, -2)).float() * SCALE + mask, dim=-1).to(dtype)
    return torch.matmul(probs, vp).reshape(len(qs), -1)


def batch(rows: int, lengths, dtype, rng: torch.Generator):
    def randn(*shape):
        return torch.randn(*shape, generator=rng).to(dtype)
    return ([randn(KV * G * D) for _ in range(rows)], [randn(KV, n, D) for n in lengths],
            [randn(KV, n, D) for n in lengths])


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--trials", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(2)
    pick, rng = random.Random(0), torch.Generator().manual_seed(0)
    print(f"Machine: {machine()}\n")
    print("| dtype | way | us per layer, 16 rows | rows differing from alone |\n|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        timing = batch(16, [pick.randint(40, 200) for _ in range(16)], dtype, rng)
        for way in (per_row, padded, manual):
            differ = 0
            for _ in range(args.trials):
                rows = pick.choice([1, 2, 5, 16])
                qs, ks, vs = batch(rows, [pick.randint(1, 300) for _ in range(rows)], dtype, rng)
                together = way(qs, ks, vs, dtype)
                differ += sum(not torch.equal(way([q], [k], [v], dtype)[0], t)
                              for q, k, v, t in zip(qs, ks, vs, together))
            for _ in range(5):
                way(*timing, dtype)
            t0 = time.perf_counter()
            for _ in range(100):
                way(*timing, dtype)
            print(f"| {str(dtype)[6:]} | {way.__name__} | {(time.perf_counter() - t0) * 1e4:.0f} | {differ} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
