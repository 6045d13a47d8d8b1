"""How far one ulp moves a format's logits: every input embedding value nudged to the next float32 up
(torch.nextafter), the whole-sequence forward run again, and per position the max |logit change| and
whether the top-1 token changed.

With float32 activations (gguf_f32) a 1-ulp change stays at float rounding (~1e-5 at a logit std of
~8). With 8-bit activations (gguf) it moves some value across a rounding boundary of an activation
block, and 30 layers carry that on: the logits move by the size of the 8-bit rounding itself. This is
why `gguf` and llama.cpp, which quantize the activations alike but sum floats in other orders, agree
on every step of the tiny models and not on SmolLM2 (docs/BENCHMARKS.md, "agreement with llama.cpp,
explained").

Run: .venv/bin/python -m bench.probes.ulp_sensitivity [--type Q8_0] [--prompts 5] [--threads 2]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from bench.lib.machine import machine_line
from services.inference.formats import gateprompts
from services.inference.model.blocks import EXACT_FORMAT, FORMAT
from services.inference.model.loader import load_model
from testing import quantized


@torch.inference_mode()
def logits(model, ids: torch.Tensor, nudge: bool) -> np.ndarray:
    embed = model.model.embed_tokens
    plain = embed.forward
    if nudge:
        embed.forward = lambda t: torch.nextafter(plain(t), torch.tensor(float("inf")))
    try:
        return model(ids).logits[0].float().numpy()
    finally:
        embed.forward = plain


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--type", default="Q8_0", help="SmolLM2 re-quantized by llama.cpp (testing/quantized.py)")
    ap.add_argument("--prompts", type=int, default=5, help="the first N gate prompts, every position")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = quantized.smollm2(args.type)
    seqs = gateprompts.load(args.prompts)
    print(f"Command: `.venv/bin/python -m bench.probes.ulp_sensitivity {' '.join(sys.argv[1:])}`\n")
    print("| file | format | positions | median max abs logit change | top-1 changed |\n|---|---|---|---|---|")
    for fmt in (EXACT_FORMAT, FORMAT):
        model = load_model(path, fmt)
        moved, flipped, n = [], 0, 0
        for seq in seqs:
            ids = torch.tensor([seq.ids[:-1]])
            a, b = logits(model, ids, False), logits(model, ids, True)
            moved.append(np.abs(a - b).max(-1))
            flipped += int((a.argmax(-1) != b.argmax(-1)).sum())
            n += len(a)
        print(f"| {args.type} | {fmt} | {n} | {np.median(np.concatenate(moved)):.2g} | {flipped} ({flipped / n:.1%}) |")
    print(machine_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
