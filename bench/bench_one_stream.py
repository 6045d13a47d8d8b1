"""One client, Keel beside llama.cpp on the same GGUF, in alternating rounds: the single-stream ratios of
issue 40 on a host whose speed drifts from minute to minute.

Run:  .venv/bin/python -m bench.bench_one_stream [--model PATH.gguf] [--requests 8] [--max-tokens 128]
      [--rounds 4] [--ignore-eos] [--format gguf] [--write FILE]

One mesh (`keelctl up` on free ports, format --format, formats.force with --model) stays up for the whole
run. Each round serves the same --requests chat prompts one at a time (greedy, --max-tokens each, eos
ignored with --ignore-eos) three ways: straight to the inference stage (pre-tokenized ids), through the
gateway's GenerateStream, and through llama-cpp-python on the same file in a fresh process of its own
(2 threads, the lengths Keel produced, the mesh idle beside it). Odd rounds start with Keel, even rounds
with llama.cpp, so a drift of the host's speed during the run falls on both sides alike.

Per round and system: tok/s = generated tokens / wall time of the set (prefill included) and the
inter-token time's median (decode alone). The ratios are Keel's over llama.cpp's of the same round; the
summary is their median over the rounds, with the smallest and largest. The mesh's CPU seconds during
llama.cpp's runs show what the idle mesh took from it.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

import grpc
import torch

from bench.bench_inference import machine
from bench.bench_serving import Job, Result, calls, cpu_seconds, drive, file_type, run_peer, serving_mesh, workload
from shared.modelfile import ENV as MODEL_ENV
from shared.modelfile import model_path

SYSTEMS = ("stage", "mesh", "llama-cpp")


def itl_p50_ms(r: Result) -> float:
    return statistics.median(r.itl) * 1e3 if r.itl else float("nan")


def cpu_flags() -> str:
    flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split()
    keep = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8")
    return " ".join(f for f in keep if f in flags) or "no AVX2"


async def keel_round(gateway: str, stage: str, token: str, jobs: list[Job], ignore_eos: bool,
                     lengths: dict[int, int] | None) -> dict[str, Result]:
    out = {}
    async with grpc.aio.insecure_channel(gateway) as gch, grpc.aio.insecure_channel(stage) as sch:
        for path, call in calls(gch, sch, token, ignore_eos).items():
            out[path] = await drive(jobs, 1, call)
            if lengths is not None and out[path].tokens != lengths:
                raise RuntimeError(f"{path}: lengths changed between rounds (greedy must repeat itself)")
    return out


def rounds(args, jobs: list[Job]) -> tuple[list[dict[str, Result]], list[float], list[float]]:
    """Every round's results, the load average at each round's start, and the mesh's CPU seconds per
    second during each llama.cpp run."""
    results, loads, idle_cpu = [], [], []
    with serving_mesh(args.format, 1, force=args.model is not None) as (gateway, stage, token, pids):
        asyncio.run(keel_round(gateway, stage, token, jobs[:2], args.ignore_eos, None))  # first-use effects
        lengths = None  # Keel's lengths, set by round 1 (Keel first), which llama.cpp then runs to
        for i in range(args.rounds):
            loads.append(os.getloadavg()[0])
            res: dict[str, Result] = {}
            order = ("keel", "llama-cpp") if i % 2 == 0 else ("llama-cpp", "keel")
            for side in order:
                if side == "keel":
                    res.update(asyncio.run(keel_round(gateway, stage, token, jobs, args.ignore_eos, lengths)))
                    lengths = lengths or res["stage"].tokens
                    continue
                before = cpu_seconds(pids)
                res["llama-cpp"] = run_peer("llama-cpp", file_type(model_path()), jobs, lengths)
                used = sum(cpu_seconds(pids).values()) - sum(before.values())
                idle_cpu.append(used / res["llama-cpp"].wall)
            results.append(res)
            print(f"round {i + 1}: " + ", ".join(f"{s} {res[s].tok_s:.1f} tok/s" for s in SYSTEMS), flush=True)
    return results, loads, idle_cpu


def spread(xs: list[float]) -> str:
    return f"**{statistics.median(xs):.2f}x** ({min(xs):.2f}-{max(xs):.2f})"


def report(args, jobs: list[Job], results: list[dict[str, Result]], loads: list[float],
           idle_cpu: list[float]) -> str:
    served = model_path()
    cmd = " ".join([".venv/bin/python", "-m", "bench.bench_one_stream"] + sys.argv[1:])
    tokens = sum(results[0]["stage"].tokens.values())
    lines = ["# One client, Keel beside llama.cpp in alternating rounds", "", f"Command: `{cmd}`",
             f"Machine: {machine()}; CPU flags {cpu_flags()}",
             f"Model: {served} ({file_type(served)}, {served.stat().st_size / 2**20:.0f} MiB); format {args.format}",
             f"Each round: {len(jobs)} requests, {tokens} generated tokens per system; load average at each "
             f"round's start: {', '.join(f'{x:.2f}' for x in loads)}; the idle mesh used "
             f"{max(idle_cpu):.2f} CPU-s/s at most during llama.cpp's runs.", "",
             "| round | first | " + " | ".join(f"{s} tok/s | {s} ITL p50 ms" for s in SYSTEMS) + " |",
             "|---" * (2 + 2 * len(SYSTEMS)) + "|"]
    for i, res in enumerate(results):
        lines.append(f"| {i + 1} | {'Keel' if i % 2 == 0 else 'llama.cpp'} | "
                     + " | ".join(f"{res[s].tok_s:.1f} | {itl_p50_ms(res[s]):.1f}" for s in SYSTEMS) + " |")
    lines += ["", "Keel over llama.cpp, median of the rounds (smallest-largest):", ""]
    for path in ("stage", "mesh"):
        tok = [r[path].tok_s / r["llama-cpp"].tok_s for r in results]
        itl = [itl_p50_ms(r["llama-cpp"]) / itl_p50_ms(r[path]) for r in results]
        lines.append(f"- {path}: tok/s {spread(tok)}; decode pace (llama.cpp's ITL p50 / Keel's) {spread(itl)}")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", type=Path, help="serve this GGUF (formats.force), else the configured model")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--ignore-eos", action="store_true", help="every request runs to its max_tokens")
    ap.add_argument("--format", default="gguf")
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.model:  # every stage of the mesh and the peer's process read the model from it
        os.environ[MODEL_ENV] = str(args.model.resolve())
    jobs = workload(args.requests, [args.max_tokens])
    out = report(args, jobs, *rounds(args, jobs))
    print(out)
    if args.write:
        args.write.write_text(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
