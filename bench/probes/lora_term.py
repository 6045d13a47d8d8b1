"""Which way of computing the LoRA term keeps a row's bits the same alone and in a mixed batch, and what it costs.

For SmolLM2's projection shapes (576->576 q/o, 576->192 k/v, 576->1536 gate/up, 1536->576 down), rank 8
and 5 slots, compares three per-token formulations of B[s] (A[s] h):
  einsum   gathered stacks, torch.einsum("ni,nri->nr") then einsum("nr,nor->no")  (model/loraslots.py)
  bmm      the same gathers through torch.bmm
  mulsum   gathered stacks, broadcast multiply and sum over the last dimension
Counts rows of 16-row batches (random slots) that equal the same row computed alone, bit for bit, at 1 and
2 threads; then times each formulation for 13 adapter rows against the base F.linear of 16 rows
(median of interleaved repeats, 1 thread).

Run: .venv/bin/python -m bench.probes.lora_term [--trials 50] [--repeats 300]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576))
SLOTS, RANK, ROWS = 5, 8, 16


def einsum(h, a, b, s):
    return torch.einsum("nr,nor->no", torch.einsum("ni,nri->nr", h, a[s]), b[s])


def bmm(h, a, b, s):
    return torch.bmm(b[s], torch.bmm(a[s], h[:, :, None]))[..., 0]


def mulsum(h, a, b, s):
    return ((h[:, None, :] * a[s]).sum(-1)[:, None, :] * b[s]).sum(-1)


WAYS = {"einsum": einsum, "bmm": bmm, "mulsum": mulsum}


def invariance(trials: int) -> None:
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for fin, fout in SHAPES:
            a, b = torch.randn(SLOTS, RANK, fin), torch.randn(SLOTS, fout, RANK)
            same = dict.fromkeys(WAYS, 0)
            for _ in range(trials):
                h, s = torch.randn(ROWS, fin), torch.randint(0, SLOTS, (ROWS,))
                for name, f in WAYS.items():
                    full = f(h, a, b, s)
                    same[name] += sum(torch.equal(f(h[i:i + 1], a, b, s[i:i + 1])[0], full[i]) for i in range(ROWS))
            print(f"threads {threads}, {fin}->{fout}: rows equal alone and in the batch, of {trials * ROWS}: "
                  + ", ".join(f"{k} {v}" for k, v in same.items()), flush=True)


def timing(repeats: int) -> None:
    torch.set_num_threads(1)
    for fin, fout in SHAPES:
        a, b, w = torch.randn(SLOTS, RANK, fin), torch.randn(SLOTS, fout, RANK), torch.randn(fout, fin)
        h, s = torch.randn(ROWS, fin), torch.randint(1, SLOTS, (ROWS - 3,))
        rows = torch.arange(ROWS - 3)
        runs = {**{k: (lambda f=f: f(h[rows], a, b, s)) for k, f in WAYS.items()}, "base "
                                                                                   "linear": lambda: F.linear(h, w)}
        times = {k: [] for k in runs}
        for _ in range(repeats):
            for k, f in runs.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
        print(f"{fin}->{fout}, median us: " + ", ".join(f"{k} {1e6 * statistics.median(v):.1f}"
                                                      for k, v in times.items()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args()
    torch.manual_seed(0)
    invariance(args.trials)
    timing(args.repeats)
    with open("/proc/loadavg") as f:
        print("load average:", " ".join(f.read().split()[:3]))


if __name__ == "__main__":
    main()
