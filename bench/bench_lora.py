"""LoRA adapters: the decode step of a mixed batch against the base-only step and PEFT, the warm-up
cost per adapter, and the stage's start with adapters, cold vs from the LoRA start-up record
(real model, float32, one torch thread).

Run:  .venv/bin/python -m bench.bench_lora [--steps 8] [--rank 8] [--targets q_proj,v_proj]
                                           [--peers keel,peft-mixed,warmup,stage]

Each peer runs in a fresh process (`--peer NAME`) and prints one JSON line; the parent prints the table.
  keel         Keel's runner: a decode step of 16 rows without adapters (keel-base) and of 16 rows with
               4 adapters and the base interleaved, slots 0..4 (keel-mixed), timed alternately
  peft-mixed   transformers + PEFT's unmerged forward, the same 16 rows and adapters (adapter_names per row)
  warmup       the stage's start-up check (lora/startup.check_adapters) of a registry holding 0, 1 and 2
               adapters: (t2 - t0) / 2 is the warm-up cost per adapter (check run, checks, slot loading;
               with one adapter or more, the base's own greedy check run is paid once), t2 - t1 the second.
               Each count is timed cold (no start-up record under its key: measured, and the record
               written) then cached (the same check again: one verified check row per adapter and one
               for the base, lora/startcache.py).
  stage        the inference stage's start (bootstrap.start_engine, engine.format float32) with a registry
               of 2 adapters, in fresh processes on one scratch var dir: a first start fills the engine's
               and the LoRA start-up records; then, alternately, starts without the LoRA record (engine
               warm, adapters measured: "cold") and with it ("cached"), `--starts` of each.
Every peer prefills the same 16 prompts of 32 tokens, then times `--steps` decode steps (median).
The adapters are real PEFT folders from testing/lora.py (seeded, lora_B non-zero).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from shared.modelfile import source as model_source

MODEL = model_source().cache_dir
ROWS, PROMPT, ADAPTERS = 16, 32, 4
PEERS = ("keel", "peft-mixed", "warmup", "stage")
ENGINE_KEY = "bench-lora"  # the warmup peer's record keys (the stage peer uses the engine's real fingerprint)


def prompts() -> list[list[int]]:
    return [[3 + (r * 7919 + i * 104729) % 49000 for i in range(PROMPT)] for r in range(ROWS)]


def adapters(model, root: Path, args, count: int = ADAPTERS) -> list[Path]:
    from testing.lora import make_adapter
    targets = tuple(args.targets.split(","))
    return [make_adapter(model, root / f"a{k}", seed=k, rank=args.rank, targets=targets, b_std=0.05)
            for k in range(count)]


def keel_steps(model, folders: list[Path], steps: int) -> tuple[list[float], list[float]]:
    """(base-only step times, mixed step times), measured alternately in one process so that load from
    other processes on the host weighs on both alike."""
    from services.inference.model.forward import LlamaRunner, Segment
    from testing.lora import load_slots
    runner = LlamaRunner(model)
    runner.calibrate_invariant_sizes(ROWS)
    runner.lora = load_slots(model, folders)
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
    from services.inference.lora.registration import register
    from services.inference.lora.registry import LoraConfig
    from services.inference.lora.startup import check_adapters, running_base
    from services.inference.model.digest import model_sha256
    from services.inference.model.forward import LlamaRunner
    sha = model_sha256(MODEL)
    runner = LlamaRunner(model)
    runner.calibrate_invariant_sizes(ROWS)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["KEEL_VAR_DIR"] = tmp  # the start-up record goes to tmp/warm
        cfg = LoraConfig(registry_dir=f"{tmp}/adapters")
        base = running_base(runner, MODEL, sha, "float32")
        for n in range(3):
            if n:
                register(folders[n - 1], f"a{n}", "1", base, cfg)
            # cold: no record under this key yet (the check measures and writes it); cached: reuses it
            for kind in ("cold", "cached"):
                t0, c0 = time.perf_counter(), time.process_time()
                table = check_adapters(cfg, runner, MODEL, sha, "float32", f"{ENGINE_KEY}-{n}")
                out[f"check_{n}_{kind}_s"] = time.perf_counter() - t0
                out[f"check_{n}_{kind}_cpu_s"] = time.process_time() - c0
                assert sum(s.state == "accepted" for s in table.states) == n
    for kind in ("cold", "cached", "cold_cpu", "cached_cpu"):
        out[f"per_adapter_{kind}_s"] = (out[f"check_2_{kind}_s"] - out[f"check_0_{kind}_s"]) / 2
        out[f"second_adapter_{kind}_s"] = out[f"check_2_{kind}_s"] - out[f"check_1_{kind}_s"]
    return out


def stage_config(var: Path):
    """config/inference.yaml with float32 on one thread, the real model and the scratch registry."""
    from dataclasses import replace

    from services.inference import config
    cfg = config.load()
    return replace(cfg, model_path=str(MODEL.resolve()), lora=replace(cfg.lora, registry_dir=str(var / "adapters")),
                   engine=replace(cfg.engine, format="float32", intra_op_threads=1))


def stage_setup(args, var: Path) -> None:
    """Register 2 adapters against the base the stage will run (float32) into the scratch registry."""
    from services.inference.lora.registration import register
    from services.inference.lora.startup import running_base
    from services.inference.model.digest import model_sha256
    from services.inference.model.forward import LlamaRunner
    from services.inference.model.loader import load_model
    cfg = stage_config(var)
    model = load_model(MODEL, "float32")
    runner = LlamaRunner(model)
    runner.calibrate_invariant_sizes(ROWS)
    base = running_base(runner, MODEL, model_sha256(MODEL), "float32")
    for k, folder in enumerate(adapters(model, var / "src", args, 2)):
        register(folder, f"a{k}", "1", base, cfg.lora)


def stage_start(var: Path) -> dict:
    """One start of the stage's engine, as the server does it; its phases and what the LoRA record gave."""
    from services.inference.bootstrap import start_engine
    from services.inference.model.digest import model_sha256
    seen = {}

    class Outcome(logging.Handler):
        def emit(self, record):
            seen.update(getattr(record, "start_cache", None) or {})

    logging.getLogger("services.inference.lora.startup").addHandler(Outcome(logging.INFO))
    logging.getLogger("services.inference.lora.startup").setLevel(logging.INFO)
    cfg = stage_config(var)
    t0, c0 = time.perf_counter(), time.process_time()
    started = start_engine(cfg, model_sha256(cfg.model_dir))
    return {"start_s": time.perf_counter() - t0, "start_cpu_s": time.process_time() - c0,
            "warm": started.warm, "phases_s": started.phases_s,
            "lora_base": seen.get("base"), "lora_adapters": seen.get("adapters")}


def run_peer(name: str, args) -> dict:
    from services.inference.model.loader import load_model
    torch.set_num_threads(1)
    if name.startswith("stage"):
        if name == "stage-setup":
            stage_setup(args, Path(os.environ["KEEL_VAR_DIR"]))
        return {"peer": name, **stage_start(Path(os.environ["KEEL_VAR_DIR"]))}
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


def _peer(peer: str, args, env: dict | None = None) -> dict:
    cmd = [sys.executable, "-m", "bench.bench_lora", "--peer", peer, "--steps", str(args.steps),
           "--rank", str(args.rank), "--targets", args.targets]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def stage_starts(args) -> dict:
    """The stage peers on one scratch var dir: setup (and a first, fully cold start), then cold/cached pairs."""
    out = {"cold": [], "cached": []}
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "KEEL_VAR_DIR": tmp}
        out["first"] = _peer("stage-setup", args, env)
        for _ in range(args.starts):
            for record in Path(tmp, "warm").glob("lora-*.json"):
                record.unlink()
            out["cold"].append(_peer("stage-start", args, env))
            out["cached"].append(_peer("stage-start", args, env))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", choices=(*PEERS[:3], "stage-setup", "stage-start"))
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default="q_proj,v_proj")
    ap.add_argument("--starts", type=int, default=1, help="stage starts of each kind (cold, cached)")
    args = ap.parse_args()
    if args.peer:
        print(json.dumps(run_peer(args.peer, args)), flush=True)
        return
    peers = args.peers.split(",")
    results = {p: stage_starts(args) if p == "stage" else _peer(p, args) for p in peers}
    if "keel" in results and "peft-mixed" in results:
        steps = {**results["keel"], **results["peft-mixed"]}
        base = steps["keel-base"]["step_ms"]
        print(f"decode step, batch {ROWS}, {ADAPTERS} adapters (rank {args.rank}, {args.targets}) + base rows, "
              f"median of {args.steps} steps:")
        for peer in ("keel-base", "keel-mixed", "peft-mixed"):
            r = steps[peer]
            print(f"  {peer:<11} {r['step_ms']:8.1f} ms  (min {r['min_ms']:.1f})  x{r['step_ms'] / base:.2f} of "
                  "keel-base")
    if "warmup" in results:
        w = results["warmup"]
        print("start-up check of 0 / 1 / 2 adapters, per added adapter, and the second one alone "
              "(wall s; process CPU s):")
        for kind in ("cold", "cached", "cold_cpu", "cached_cpu"):
            print(f"  {kind:<10} {w[f'check_0_{kind}_s']:.2f} / {w[f'check_1_{kind}_s']:.2f} / "
                  f"{w[f'check_2_{kind}_s']:.2f} s; per adapter {w[f'per_adapter_{kind}_s']:.2f} s; "
                  f"second {w[f'second_adapter_{kind}_s']:.2f} s")
        for unit in ("", "_cpu"):
            print(f"  cached / cold, 2 adapters{unit}: "
                  f"x{w[f'check_2_cached{unit}_s'] / w[f'check_2_cold{unit}_s']:.2f}")
    if "stage" in results:
        r = results["stage"]
        print(f"stage start with 2 adapters (fresh process each; first start, engine cold: "
              f"{r['first']['start_s']:.1f} s, adapters {r['first']['phases_s']['adapters']:.2f} s):")
        for kind in ("cold", "cached"):
            runs = r[kind]
            print(f"  LoRA {kind:<6} start " + ", ".join(f"{x['start_s']:.2f}" for x in runs) + " s (CPU "
                  + ", ".join(f"{x['start_cpu_s']:.2f}" for x in runs) + " s); adapters phase "
                  + ", ".join(f"{x['phases_s']['adapters']:.2f}" for x in runs) + f" s; record: {runs[0]['lora_base']}"
                  f" {runs[0]['lora_adapters']}")
        cold = statistics.median(x["phases_s"]["adapters"] for x in r["cold"])
        cached = statistics.median(x["phases_s"]["adapters"] for x in r["cached"])
        print(f"  adapters phase, cached / cold (medians): x{cached / cold:.2f}")
    with open("/proc/loadavg") as f:
        print("load average:", f.read().split()[:3])


if __name__ == "__main__":
    main()
