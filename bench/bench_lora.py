"""LoRA adapters: the decode step of a mixed batch against the base-only step and PEFT, and the warm-up
cost per adapter (real model, float32, one torch thread).

Run:  .venv/bin/python -m bench.bench_lora [--steps 8] [--rank 8] [--targets q_proj,v_proj]

Each peer runs in a fresh process (`--peer NAME`) and prints one JSON line; the parent prints the table.
  keel         Keel's runner: a decode step of 16 rows without adapters (keel-base) and of 16 rows with
               4 adapters and the base interleaved, slots 0..4 (keel-mixed), timed alternately
  peft-mixed   transformers + PEFT's unmerged forward, the same 16 rows and adapters (adapter_names per row)
  warmup       the stage's start-up check (lora/startup.check_adapters) of a registry holding 0, 1 and 2
               adapters: (t2 - t0) / 2 is the warm-up cost per adapter (probe run, checks, slot loading;
               with one adapter or more, the base's own greedy probe run is paid once), t2 - t1 the second
Every peer prefills the same 16 prompts of 32 tokens, then times `--steps` decode steps (median).
The adapters are real PEFT folders from tests/inference/lora_fixtures.py (seeded, lora_B non-zero).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MODEL = Path("var/model")
ROWS, PROMPT, ADAPTERS = 16, 32, 4
PEERS = ("keel", "peft-mixed", "warmup")


def prompts() -> list[list[int]]:
    return [[3 + (r * 7919 + i * 104729) % 49000 for i in range(PROMPT)] for r in range(ROWS)]


def adapters(model, root: Path, args, count: int = ADAPTERS) -> list[Path]:
    from tests.inference.lora_fixtures import make_adapter
    targets = tuple(args.targets.split(","))
    return [make_adapter(model, root / f"a{k}", seed=k, rank=args.rank, targets=targets, b_std=0.05)
            for k in range(count)]


def keel_steps(model, folders: list[Path], steps: int) -> tuple[list[float], list[float]]:
    """(base-only step times, mixed step times), measured alternately in one process so that load from
    other processes on the host weighs on both alike."""
    from services.inference.forward import LlamaRunner, Segment
    from tests.inference.test_lora_forward import load
    runner = LlamaRunner(model)
    runner.calibrate_invariant_sizes(ROWS)
    runner.lora = load(model, folders)
    mixed = [r % (ADAPTERS + 1) for r in range(ROWS)]
    batches = {}
    for name, slots in (("base", [0] * ROWS), ("mixed", mixed)):
        caches = [runner.new_cache(PROMPT + steps + 1) for _ in range(ROWS)]
        logits = runner.forward([Segment(c, p, s) for c, p, s in zip(caches, prompts(), slots)])
        batches[name] = (caches, slots, logits.argmax(-1).tolist())
    times = {"base": [], "mixed": []}
    for _ in range(steps):
        for name, (caches, slots, tokens) in batches.items():
            t0 = time.perf_counter()
            logits = runner.forward([Segment(c, [t], s) for c, t, s in zip(caches, tokens, slots)])
            times[name].append(time.perf_counter() - t0)
            batches[name] = (caches, slots, logits.argmax(-1).tolist())
    return times["base"], times["mixed"]


@torch.inference_mode()
def peft_steps(model, folders: list[Path], steps: int) -> list[float]:
    from peft import PeftModel
    peft_model = PeftModel.from_pretrained(model, str(folders[0]), adapter_name="a0")
    for k, folder in enumerate(folders[1:], start=1):
        peft_model.load_adapter(str(folder), adapter_name=f"a{k}")
    peft_model.eval()
    names = ["__base__" if r % (ADAPTERS + 1) == 0 else f"a{r % (ADAPTERS + 1) - 1}" for r in range(ROWS)]
    out = peft_model(torch.tensor(prompts()), use_cache=True, adapter_names=names)
    past, times = out.past_key_values, []
    for _ in range(steps):
        tokens = out.logits[:, -1].argmax(-1)[:, None]
        t0 = time.perf_counter()
        out = peft_model(tokens, past_key_values=past, use_cache=True, adapter_names=names)
        past = out.past_key_values
        times.append(time.perf_counter() - t0)
    return times


def warmup_cost(model, folders: list[Path]) -> dict:
    from services.inference.forward import LlamaRunner
    from services.inference.lora.registration import register
    from services.inference.lora.registry import LoraConfig
    from services.inference.lora.startup import check_adapters, running_base
    from services.inference.warmcache import model_sha256
    sha = model_sha256(MODEL)
    runner = LlamaRunner(model)
    runner.calibrate_invariant_sizes(ROWS)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = LoraConfig(registry_dir=tmp)
        base = running_base(runner, MODEL, sha, "float32")
        for n in range(3):
            if n:
                register(folders[n - 1], f"a{n}", "1", base, cfg)
            t0 = time.perf_counter()
            table = check_adapters(cfg, runner, MODEL, sha, "float32")
            out[f"check_{n}_s"] = time.perf_counter() - t0
            assert sum(s.state == "accepted" for s in table.states) == n
    out["per_adapter_s"] = (out["check_2_s"] - out["check_0_s"]) / 2
    out["second_adapter_s"] = out["check_2_s"] - out["check_1_s"]
    return out


def run_peer(name: str, args) -> dict:
    from services.inference.model import load_model
    torch.set_num_threads(1)
    model = load_model(MODEL, "float32")
    with tempfile.TemporaryDirectory() as tmp:
        folders = adapters(model, Path(tmp), args, 2 if name == "warmup" else ADAPTERS)
        if name == "warmup":
            return {"peer": name, **warmup_cost(model, folders)}
        if name == "keel":
            base, mixed = keel_steps(model, folders, args.steps)
            return {"peer": name, "keel-base": _stats(base), "keel-mixed": _stats(mixed)}
        # PEFT wraps transformers' own Llama (the same weights): its cache and adapter_names need it.
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()  # nosec B615
        return {"peer": name, name: _stats(peft_steps(hf, folders, args.steps))}


def _stats(times: list[float]) -> dict:
    return {"step_ms": 1000 * statistics.median(times), "min_ms": 1000 * min(times)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", choices=PEERS)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default="q_proj,v_proj")
    args = ap.parse_args()
    if args.peer:
        print(json.dumps(run_peer(args.peer, args)), flush=True)
        return
    results = {}
    for peer in PEERS:
        cmd = [sys.executable, "-m", "bench.bench_lora", "--peer", peer, "--steps", str(args.steps),
               "--rank", str(args.rank), "--targets", args.targets]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[peer] = json.loads(done.stdout.strip().splitlines()[-1])
    steps = {**results["keel"], **results["peft-mixed"]}
    base = steps["keel-base"]["step_ms"]
    print(f"decode step, batch {ROWS}, {ADAPTERS} adapters (rank {args.rank}, {args.targets}) + base rows, "
          f"median of {args.steps} steps:")
    for peer in ("keel-base", "keel-mixed", "peft-mixed"):
        r = steps[peer]
        print(f"  {peer:<11} {r['step_ms']:8.1f} ms  (min {r['min_ms']:.1f})  x{r['step_ms'] / base:.2f} of keel-base")
    w = results["warmup"]
    print(f"start-up check: 0 adapters {w['check_0_s']:.2f} s, 1: {w['check_1_s']:.2f} s, 2: {w['check_2_s']:.2f} s;"
          f" per adapter {w['per_adapter_s']:.2f} s (the second one alone: {w['second_adapter_s']:.2f} s)")
    with open("/proc/loadavg") as f:
        print("load average:", f.read().split()[:3])


if __name__ == "__main__":
    main()
