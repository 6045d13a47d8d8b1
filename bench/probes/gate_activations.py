"""What the activations' precision costs the block formats in the quality gate: gguf_f32 (the file's
blocks, float32 activations) with every linear layer's input rounded per 32-element block to the
levels of a B-bit integer first, as an integer kernel would quantize it.

For each --bits B: a = max |x| over the block, d = a / (2^(B-1) - 1), x -> round(x / d) * d (in
float32, clamped to the levels; a zero block stays zero), then the exact kernel on the blocks. Only
the summation order differs from an integer kernel on those levels: at B = 8 the emulation should
give the agreement `gguf` itself gets (`python -m services.inference.formats.gate`), which tells how far to
trust the other
widths. Scored against float32 on the gate's prompts (services/inference/formats/quality.py); nothing
is stored.

Run: .venv/bin/python -m bench.probes.gate_activations [--bits 8,16] [--prompts N] [--threads 2]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from bench.bench_inference import MODEL, machine
from services.inference.formats import gateprompts, quality
from services.inference.model.blocks import EXACT_FORMAT, BlockLinear
from services.inference.model.loader import load_model, model_in_format


def rounded(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x [M, K] with each 32-element block on the levels of a signed `bits`-bit integer."""
    top = 2 ** (bits - 1) - 1
    b = x.reshape(-1, 32)
    d = b.abs().amax(-1, keepdim=True) / top
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return ((b * inv).round().clamp(-top, top) * d).reshape(x.shape)


def with_rounded_inputs(model: torch.nn.Module, bits: int) -> torch.nn.Module:
    for m in model.modules():
        if isinstance(m, BlockLinear):
            def forward(x, m=m):
                flat = x.reshape(-1, m.in_features).contiguous()
                return m._op(rounded(flat, bits), *m._args).reshape(*x.shape[:-1], m.out_features)
            m.forward = forward
    return model


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--bits", default="8,16")
    ap.add_argument("--prompts", type=int, default=None, help="the first N prompts (default: all 200)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ref = load_model(MODEL, "float32")
    candidates = {f"{EXACT_FORMAT}, inputs on {b}-bit levels": with_rounded_inputs(
        model_in_format(ref, EXACT_FORMAT, MODEL), b) for b in map(int, args.bits.split(","))}
    sequences = gateprompts.load(args.prompts)
    t0 = time.perf_counter()
    results = quality.evaluate(ref, candidates, sequences, lambda i: None)
    print(f"Command: `.venv/bin/python -m bench.probes.gate_activations {' '.join(sys.argv[1:])}`")
    print(f"Machine: {machine()}; {len(sequences)} sequences, {time.perf_counter() - t0:.0f} s\n")
    print("| candidate | mean KL (nats) | p95 KL | greedy agreement |\n|---|---|---|---|")
    for r in results:
        print(f"| {r.format} | {r.kl_mean:.5f} | {r.kl_p95:.5f} | {r.greedy_agreement:.2%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
