"""keel::gguf_mm on SmolLM2-135M's real weight blocks against torch's CPU linears, in one run.

Shapes (N out x K in): attention 576x576 and 192x576, gate/up 1536x576, down 576x1536, the
concatenated QKV 960x576 and gate+up 3072x576 (Q4_1), the tied 49152x576 head (Q8_0); M = 1, 4, 16.
Per shape and M, median microseconds per call of:
  keel      keel::gguf_mm (format gguf_f32: float32 activations) on its default path (and `avx2` when
            the host has AVX-512, as AVX2-only hosts run)
  q8        keel::gguf_q8_mm (format gguf: 8-bit activations, integer dot products) on the same blocks
            regrouped by 16 rows (blocks.pack_x16), its default path
  fp32      torch F.linear on the dequantized float32 weights (MKL)
  int8wo    torch.ops.aten._weight_int8pack_mm: int8 per-channel weights, bf16 activations
Each repeat times every candidate once, round robin, so a busy host slows them alike. At M = 1 the
kernels' GB/s (bytes of blocks read / time) is set against a STREAM-like copy of a 256 MiB tensor
timed in the same run (GB/s counts read + write). Prints the CPU flags and the load average.

Run: .venv/bin/python -m bench.bench_kernel [--threads N] [--repeats R]
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from services.inference.model.blocks import pack_x16
from services.inference.model.kernels import SUPPORTED_TYPES, load
from shared.modelfile import shipped_gguf

ROOT = Path(__file__).resolve().parent.parent

FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")
BATCHES = (1, 4, 16)


def weights() -> dict[str, tuple[torch.Tensor, int]]:
    """label -> (blocks [N, K/32*bytes] uint8, ggml type), layer 0's tensors and the head."""
    t = {x.name: x for x in gguf.GGUFReader(shipped_gguf()).tensors}

    def blocks(*names: str) -> tuple[torch.Tensor, int]:
        types = {int(t[n].tensor_type) for n in names}
        assert len(types) == 1
        return torch.from_numpy(np.concatenate([np.asarray(t[n].data) for n in names])), types.pop()

    b = "blk.0."
    return {
        "attn_q 576x576": blocks(b + "attn_q.weight"),
        "attn_k 192x576": blocks(b + "attn_k.weight"),
        "ffn_up 1536x576": blocks(b + "ffn_up.weight"),
        "ffn_down 576x1536": blocks(b + "ffn_down.weight"),
        "qkv 960x576": blocks(b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"),
        "gate+up 3072x576": blocks(b + "ffn_gate.weight", b + "ffn_up.weight"),
        "head 49152x576 Q8_0": blocks("token_embd.weight"),
    }


def calibrate(fn, target_s: float) -> int:
    for _ in range(3):
        fn()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.02:
        fn()
        n += 1
    return max(1, int(target_s * n / (time.perf_counter() - t0)))


def timed(fns: dict, repeats: int, target_s: float = 0.02) -> dict[str, float]:
    """Median seconds per call of each fn; every repeat runs each fn once, round robin."""
    iters = {name: calibrate(fn, target_s) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(iters[name]):
                fn()
            samples[name].append((time.perf_counter() - t0) / iters[name])
    return {name: statistics.median(s) for name, s in samples.items()}


def int8_per_channel(W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = W.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    return torch.round(W / s[:, None]).clamp(-128, 127).to(torch.int8), s.bfloat16()


def cpu_flags() -> str:
    text = Path("/proc/cpuinfo").read_text()
    line = re.search(r"^flags\s*:(.*)$", text, re.M)
    have = set(line.group(1).split()) if line else set()
    model = re.search(r"^model name\s*:(.*)$", text, re.M)
    return (f"{model.group(1).strip() if model else '?'}; "
            + " ".join(f"{f}={'y' if f in have else 'n'}" for f in FLAGS))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    k = load()
    extra = ["avx2"] if k.isa == "avx512" else []
    print(f"cpu: {cpu_flags()}")
    print(f"load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}; torch {torch.__version__}, "
          f"{args.threads} threads; kernel path {k.isa} (host runs {', '.join(k.isas)}), "
          f"q8 path {k.q8_isas[0]}")

    src = torch.ones(64 << 20)  # 256 MiB
    dst = torch.empty_like(src)
    copy_s = timed({"copy": lambda: dst.copy_(src)}, args.repeats, target_s=0.2)["copy"]
    copy_gbs = 2 * src.numel() * 4 / copy_s / 1e9
    print(f"STREAM-like copy of 256 MiB: {copy_gbs:.1f} GB/s (read + write)\n")

    cols = ["keel", *extra, "q8", "fp32", "int8wo"]
    print(f"{'shape':22} {'M':>3} " + " ".join(f"{c + ' us':>10}" for c in cols)
          + f" {'keel/fp32':>9} {'keel/int8':>9} {'q8/keel':>9} {'keel GB/s':>9} {'q8 GB/s':>9}")
    for label, (w, t) in weights().items():
        W = torch.from_numpy(gguf.quants.dequantize(w.numpy(), t))
        N, K = W.shape
        q8, s8 = int8_per_channel(W)
        wp = pack_x16(w, t)
        for M in BATCHES:
            x = torch.randn(M, K)
            xb = x.bfloat16()
            fns = {"keel": lambda: k.matmul(x, w, t, N)}
            for isa in extra:
                fns[isa] = lambda isa=isa: k.matmul(x, w, t, N, isa)
            fns["q8"] = lambda: k.matmul_q8(x, wp, t, N)
            fns["fp32"] = lambda: F.linear(x, W)
            fns["int8wo"] = lambda: torch.ops.aten._weight_int8pack_mm(xb, q8, s8)
            us = {name: s * 1e6 for name, s in timed(fns, args.repeats).items()}
            gbs = " ".join(f"{w.numel() / us[c] / 1e3:9.1f}" if M == 1 else f"{'':9}" for c in ("keel", "q8"))
            print(f"{label:22} {M:>3} " + " ".join(f"{us[c]:10.1f}" for c in cols)
                  + f" {us['keel'] / us['fp32']:9.2f} {us['keel'] / us['int8wo']:9.2f} {us['q8'] / us['keel']:9.2f} "
                    f"{gbs}")
    print(f"\nload average at end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}; "
          f"blocks: {', '.join(f'{v.name} {v.block_bytes} B per 32' for v in SUPPORTED_TYPES.values())}; "
          f"M = 1 GB/s relative to the copy's {copy_gbs:.1f}")


if __name__ == "__main__":
    main()
