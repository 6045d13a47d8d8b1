"""Which matrices' 8-bit activations cost `gguf` its gate agreement: `gguf` with the named matrices taken
from `gguf_f32` (the same blocks, float32 activations), scored against float32 in the quality gate.

Each --float candidate is a comma list of module names (`lm_head`, or a layer's linear by its last name:
q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, every layer's), candidates separated by
';'. The real kernels compute every candidate (no emulation): a named matrix runs keel::gguf_mm on
float32 activations, the others keel::gguf_q8_mm / gguf_q8k_mm as in `gguf`. `gguf` itself is always
scored first. Against float32 on the gate's prompts (services/inference/formats/quality.py); nothing is
stored. --time N adds what a candidate costs: the median of N one-token forwards (a decode step's
matrices without a KV cache) and of N 16-token forwards, interleaved across candidates so that a
shared host's load falls on all alike.

Run: .venv/bin/python -m bench.probes.gate_mixed --type Q8_0 [--float "lm_head;down_proj"] [--prompts N]
     (--type: SmolLM2 re-quantized by llama.cpp, testing/quantized.py; or --model a GGUF file)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from bench.lib.machine import machine_line
from services.inference.formats import gateprompts, quality
from services.inference.model.blocks import EXACT_FORMAT, FORMAT
from services.inference.model.loader import load_model
from testing import quantized


def with_float_inputs(model: nn.Module, exact: nn.Module, names: set[str]) -> nn.Module:
    """`model` with each module whose name (or its last part) is in `names` replaced by `exact`'s."""
    swaps = [(name, module) for name, module in exact.named_modules()
             if name in names or name.rsplit(".", 1)[-1] in names]
    if not swaps:
        raise SystemExit(f"no module named {', '.join(sorted(names))}")
    for name, module in swaps:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, module)
    return model


@torch.inference_mode()
def forward_times(models: dict[str, nn.Module], tokens: int, reps: int) -> dict[str, float]:
    """Median seconds of a forward over `tokens` tokens, per model; rounds alternate between models."""
    ids = torch.arange(100, 100 + tokens)[None]
    times: dict[str, list[float]] = {name: [] for name in models}
    for model in models.values():
        model(ids)  # warm-up
    for _ in range(reps):
        for name, model in models.items():
            t0 = time.perf_counter()
            model(ids)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--type", help="SmolLM2 re-quantized by llama.cpp to this type (Q8_0, Q6_K, Q4_K_M...)")
    src.add_argument("--model", type=Path, help="a GGUF file")
    ap.add_argument("--float", default="lm_head", help="candidates: module names, ',' within, ';' between")
    ap.add_argument("--prompts", type=int, default=None, help="the first N prompts (default: all 200)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--time", type=int, default=0, metavar="N", help="also time each candidate, N forwards")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or quantized.smollm2(args.type)
    ref = load_model(path, "float32")
    exact = load_model(path, EXACT_FORMAT)
    candidates = {FORMAT: load_model(path, FORMAT)}
    for spec in args.float.split(";"):
        names = {n.strip() for n in spec.split(",") if n.strip()}
        candidates[f"{FORMAT}, float32 inputs to {', '.join(sorted(names))}"] = with_float_inputs(
            load_model(path, FORMAT), exact, names)
    sequences = gateprompts.load(args.prompts)
    t0 = time.perf_counter()
    results = quality.evaluate(ref, candidates, sequences)
    print(f"Command: `.venv/bin/python -m bench.probes.gate_mixed {' '.join(sys.argv[1:])}`")
    print(f"{path.parent.name}; {len(sequences)} sequences, {results[0].positions} positions, "
          f"{time.perf_counter() - t0:.0f} s; {machine_line()}\n")
    times = [forward_times(candidates, n, args.time) for n in (1, 16)] if args.time else []
    print("| candidate | mean KL (nats) | p95 KL | greedy agreement |"
          + "".join(f" {n}-token forward |" for n in (1, 16) if times))
    print("|---|---|---|---|" + "---|" * len(times))
    for r in results:
        print(f"| {r.format} | {r.kl_mean:.5f} | {r.kl_p95:.5f} | {r.greedy_agreement:.2%} |"
              + "".join(f" {t[r.format] * 1e3:.2f} ms ({t[r.format] / t[FORMAT]:.2f}x) |" for t in times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
