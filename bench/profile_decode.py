"""Where one decode step of the inference engine spends its time: a batch of B rows with P-token
contexts, one token each, timed against its floor (the same step's linear layers alone: every
projection and MLP layer at the step's padded batch, lm_head on its rows, nothing else), then
profiled by operator (torch.profiler). At batch 1 it also sets the step's effective memory bandwidth
(bytes of weights it reads, blocks for gguf, plus the KV cache it attends over, divided by the step's
time) against a STREAM-like copy (a 256 MiB tensor copied; read + write counted) timed right after
each of five rounds of steps: a batch-1 step is bound by bandwidth, so the copy is its physical limit.

Run: .venv/bin/python -m bench.profile_decode [--format gguf] [--batch 16] [--context 40] [--steps 20]
     [--model FILE.gguf]
     [--aten-layers]   (a block format without its layer ops, as before kernels/layer_ops.cpp)
     [--op-by-op]      (a block format's layers op by op, as before kernels/layer.cpp)
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.bench_inference import machine
from services.inference.engine.memory import static_bytes
from services.inference.model.blocks import KernelRMSNorm
from services.inference.model.forward import LlamaRunner
from services.inference.model.llama import RMSNorm
from services.inference.model.loader import load_model
from shared.modelfile import source as model_source

ROOT = Path(__file__).resolve().parent.parent


def timed_ms(fn, steps: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps * 1e3


@torch.inference_mode()
def matmul_only(runner: LlamaRunner, batch: int):
    """The decode step's floor: each layer's seven linear modules on a [padded batch, in] input
    of the runner's dtype, then lm_head on the batch's rows (the modules the step calls, any format)."""
    core, rows = runner.model.model, runner.padded_size(batch)
    hidden = torch.randn(rows, runner.model.config.hidden_size).to(runner.dtype)
    wide = torch.randn(rows, core.layers[0].mlp.down_proj.in_features).to(runner.dtype)

    def run() -> None:
        for layer in core.layers:
            attn, mlp = layer.self_attn, layer.mlp
            fused = [m for m in (getattr(attn, "qkv", None), getattr(mlp, "gate_up", None)) if m is not None]
            separate = (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj) if not fused else ()
            for lin in (*fused, *separate, attn.o_proj):  # the calls the step makes (gguf fuses two groups)
                lin(hidden)
            mlp.down_proj(wide)
        runner.model.lm_head(hidden)  # the step's lm_head sees its padded rows too
    return run


def copy_gb_s(repeats: int = 5) -> float:
    """A STREAM-like copy: GB/s of a 256 MiB float32 tensor copied (read + write), best of `repeats`."""
    src = torch.ones(64 * 2**20)
    dst = torch.empty_like(src)
    best = min(timed_ms(lambda: dst.copy_(src), 1) for _ in range(repeats))
    return 2 * src.nbytes / (best / 1e3) / 1e9


def bandwidth_rounds(step, moved: int, steps: int, rounds: int = 5) -> list[tuple[float, float]]:
    """(step GB/s, copy GB/s) of `rounds` rounds, each timing `steps` steps and then the copy: the
    bandwidth a host lends moves by up to 2x from minute to minute, so each ratio is taken in one window."""
    out = []
    for _ in range(rounds):
        ms = timed_ms(step, steps)
        out.append((moved / (ms / 1e3) / 1e9, copy_gb_s(3)))
    return out


def step_bytes(runner: LlamaRunner, context: int) -> int:
    """Bytes one batch-1 decode step reads: every weight once, and its row's keys and values."""
    return static_bytes(runner.model) + context * runner.kv_bytes_per_token


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--format", default="gguf", help="the weight format (model/loader.py FORMATS)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=40)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", type=Path, help="a GGUF file (default: the shipped model)")
    ap.add_argument("--aten-layers", action="store_true",
                    help="a block format's norms, rotary and attention on aten ops instead of its layer ops")
    ap.add_argument("--op-by-op", action="store_true",
                    help="a block format's layers op by op (as a step with LoRA terms runs them), not in two calls")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model or model_source().cache_dir, args.format)
    if args.aten_layers:  # before the runner looks its layers' modules up
        for m in list(model.modules()):  # KernelRMSNorm -> llama.RMSNorm with the same weight
            for name, child in m.named_children():
                if isinstance(child, KernelRMSNorm):
                    norm = RMSNorm(child.weight.shape[0], child.variance_epsilon)
                    norm.weight = child.weight
                    setattr(m, name, norm)
    runner = LlamaRunner(model)
    runner.layer_ops = runner.layer_ops and not args.aten_layers
    if args.op_by_op:
        runner.layers = [replace(layer, blocks=None) for layer in runner.layers]
    if args.format == "float32":
        runner.calibrate_invariant_sizes(args.batch)  # as the engine does: padded to an invariant size
    caches = [runner.new_cache(args.context + (args.steps + 3) * 8 + 8) for _ in range(args.batch)]
    for c in caches:
        runner.prefill(list(range(10, 10 + args.context)), c)

    def step() -> None:
        runner.decode([5] * args.batch, caches)

    ms = timed_ms(step, args.steps)
    floor = timed_ms(matmul_only(runner, args.batch), args.steps)
    with torch.profiler.profile() as prof:
        for _ in range(5):
            step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    print(f"{args.format}, batch {args.batch}, context {args.context}: {ms:.1f} ms per decode step "
          f"({args.batch / ms * 1e3:.0f} tok/s); its linear layers alone {floor:.1f} ms: step / matmul-only "
          f"{ms / floor:.2f}x. Machine: {machine()}")
    if args.batch == 1:
        moved = step_bytes(runner, args.context)
        rounds = bandwidth_rounds(step, moved, args.steps)
        ratios = sorted(s / c for s, c in rounds)
        print(f"batch 1: {moved / 1e6:.1f} MB read per step; {len(rounds)} rounds of {args.steps} steps, each "
              f"followed by a 256 MiB copy: step GB/s / copy GB/s "
              + ", ".join(f"{s:.1f}/{c:.1f}" for s, c in rounds)
              + f"; step / copy bandwidth median {ratios[len(ratios) // 2]:.0%} (range "
                f"{ratios[0]:.0%}-{ratios[-1]:.0%})")
    print("| operator | share of self CPU time | calls per step |\n|---|---|---|")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:14]:
        print(f"| {e.key} | {e.self_cpu_time_total / total:.1%} | {e.count // 5} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
