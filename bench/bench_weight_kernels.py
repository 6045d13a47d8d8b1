"""Each weight type's matmul kernel in format gguf (8-bit activations where the type has an integer
kernel, float32 rows for F16/BF16) at one activation row, streaming its blocks from memory as a
decode step does, against a STREAM-like copy timed in the same run.

A 4096 x 4096 matrix of each type (random bytes below 0x3c, so every fp16 scale is finite: the kernels'
work does not depend on the values), in as many copies as make ~400 MB, each copy called once per
round so that no block is in a cache when it is read; the median of 5 rounds. GB/s = bytes of blocks
read / time; the copy counts read + write (a 256 MiB tensor). Also the same kernels on one copy at
M = 1 and 4 (cache-resident: the compute rate alone).

Run: .venv/bin/python -m bench.bench_weight_kernels [--threads 1,2] [--types Q4_0,...] [--shape N,K]
(--shape: an N x K matrix instead, e.g. 9728,896 for the 0.5B-shaped model's gate/up)
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import gguf
import torch

from bench.lib.machine import machine_line
from bench.profile_decode import copy_gb_s
from services.inference.model import kernels
from services.inference.model.blocks import BlockLinear, pack

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16")
N = K = 4096
STREAM_BYTES = 400e6


def linears(name: str, copies: int, n: int = N, k: int = K) -> tuple[list[BlockLinear], int]:
    t = int(gguf.GGMLQuantizationType[name])
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t)]
    row = k // block * size
    blocks = torch.randint(0, 0x3c, (n, row), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    return [BlockLinear(pack(blocks.roll(i, 0).contiguous(), t, True), t, k, n, q8=True)
            for i in range(copies)], n * row


def per_call(lins: list[BlockLinear], x: torch.Tensor, rounds: int = 5) -> float:
    for lin in lins:
        lin(x)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for lin in lins:
            lin(x)
        times.append((time.perf_counter() - t0) / len(lins))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--shape", default=f"{N},{K}", help="N,K of the matrix")
    args = ap.parse_args()
    n, k = (int(v) for v in args.shape.split(","))
    kernels.load()
    print(f"load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print("| threads | type | streamed us | streamed GB/s | of copy | cached M=1 us | cached M=4 us |")
    print("|---|---|---|---|---|---|---|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        copy = copy_gb_s()
        print(f"| {threads} | copy | | {copy:.1f} | 1.00 | | |")
        for name in args.types.split(","):
            nbytes = n * k // gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][0] \
                * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][1]
            lins, _ = linears(name, max(3, int(STREAM_BYTES // nbytes)), n, k)
            one = lins[:1]
            s = per_call(lins, torch.randn(1, k))
            m1, m4 = per_call(one * 20, torch.randn(1, k)), per_call(one * 20, torch.randn(4, k))
            print(f"| {threads} | {name} | {s * 1e6:.0f} | {nbytes / s / 1e9:.1f} | {nbytes / s / 1e9 / copy:.2f} "
                  f"| {m1 * 1e6:.0f} | {m4 * 1e6:.0f} |")
    print(machine_line())


if __name__ == "__main__":
    main()
