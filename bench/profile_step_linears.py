"""Where a batch-1 decode step's time goes, by matrix: each linear layer's kernel call timed on its own,
in the order the step makes them (so each streams its blocks from memory as in the step), summed over
the layers by role, with its bytes and GB/s against a STREAM-like copy timed in the same run; the rest
of the step (norms, rotary, attention, adds, the calls' dispatch) is the whole step's time less the
linears'. The median of `--rounds` rounds, each: `--steps` steps, the step by role, then the copy.

Run: .venv/bin/python -m bench.profile_step_linears [--model FILE.gguf] [--format gguf] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.lib.machine import machine_line
from bench.profile_decode import copy_gb_s, timed_ms
from services.inference.model.blocks import BlockLinear
from services.inference.model.forward import LlamaRunner
from services.inference.model.loader import load_model
from shared.modelfile import source as model_source

TYPE_NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 0: "F32",
              1: "F16", 30: "BF16"}


def step_linears(runner: LlamaRunner) -> list[tuple[str, BlockLinear]]:
    """(role, module) for each kernel call of a decode step's linears, in the step's order."""
    out = []
    for layer in runner.model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [("qkv", attn.qkv)] if getattr(attn, "qkv", None) is not None else \
            [("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj)]
        out += [*qkv, ("o", attn.o_proj), ("gate_up", mlp.gate_up), ("down", mlp.down_proj)]
    return out + [("head", runner.model.lm_head)]


@torch.inference_mode()
def by_role(calls: list[tuple[str, BlockLinear]], steps: int) -> dict[str, float]:
    """Seconds per step of each role's calls, each call timed alone."""
    inputs = {id(m): torch.randn(1, m.in_features) for _, m in calls}
    total: dict[str, float] = defaultdict(float)
    for _ in range(steps):
        for role, m in calls:
            x = inputs[id(m)]
            t0 = time.perf_counter()
            m(x)
            total[role] += time.perf_counter() - t0
    return {role: t / steps for role, t in total.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", type=Path, help="a GGUF file (default: the shipped model)")
    ap.add_argument("--format", default="gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    runner = LlamaRunner(load_model(args.model or model_source().cache_dir, args.format))
    calls = step_linears(runner)
    cache = runner.new_cache(40 + (args.steps + 3) * args.rounds + 8)
    runner.prefill(list(range(10, 50)), cache)
    rows = []
    for _ in range(args.rounds):
        step_s = timed_ms(lambda: runner.decode([5], [cache]), args.steps) / 1e3
        rows.append((step_s, by_role(calls, args.steps), copy_gb_s(3)))
    step_s = statistics.median(r[0] for r in rows)
    copy = statistics.median(r[2] for r in rows)
    roles = dict.fromkeys(role for role, _ in calls)
    print(f"batch-1 step {step_s * 1e3:.2f} ms (rounds: {', '.join(f'{r[0] * 1e3:.2f}' for r in rows)}); "
          f"copy {copy:.1f} GB/s (rounds: {', '.join(f'{r[2]:.1f}' for r in rows)})")
    print("| matrix | type | shape (out x in) | calls | bytes per step | ms per step | share of step | GB/s "
          "| of copy |")
    print("|---|---|---|---|---|---|---|---|---|")
    linear_s = 0.0
    for role in roles:
        mods = [m for r, m in calls if r == role]
        nbytes = sum(m.blocks.numel() for m in mods)
        s = statistics.median(r[1][role] for r in rows)
        linear_s += s
        types = "/".join(sorted({TYPE_NAMES.get(m.ggml_type, str(m.ggml_type)) for m in mods}))
        print(f"| {role} | {types} | {mods[0].out_features} x {mods[0].in_features} | {len(mods)} | "
              f"{nbytes / 1e6:.1f} MB | {s * 1e3:.2f} | {s / step_s:.0%} | {nbytes / s / 1e9:.1f} | "
              f"{nbytes / s / 1e9 / copy:.0%} |")
    print(f"| rest of the step (norms, rotary, attention, adds, dispatch) | | | | | {(step_s - linear_s) * 1e3:.2f} "
          f"| {(step_s - linear_s) / step_s:.0%} | | |")
    nbytes = sum(m.blocks.numel() for _, m in calls)
    print(f"| all linears | | | {len(calls)} | {nbytes / 1e6:.1f} MB | {linear_s * 1e3:.2f} | {linear_s / step_s:.0%} "
          f"| {nbytes / linear_s / 1e9:.1f} | {nbytes / linear_s / 1e9 / copy:.0%} |")
    print(f"| whole step | | | | | {step_s * 1e3:.2f} | 100% | {nbytes / step_s / 1e9:.1f} | "
          f"{nbytes / step_s / 1e9 / copy:.0%} |")
    print(machine_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
