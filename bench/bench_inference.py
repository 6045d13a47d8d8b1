"""Inference engine benchmark: Keel's continuous batching against Hugging Face `generate`.

Run (CPU):  .venv/bin/python -m bench.bench_inference [--sections all] [--write docs/bench/inference.md]
Run (CUDA): .venv/bin/python -m bench.bench_inference --gpu [--write docs/bench/inference-gpu.md]

Peer, same run, same prompts: `model.generate` on a static left-padded batch of the concurrency's size
(greedy, eos disabled on both sides so every request produces exactly --tokens tokens).
Sections: throughput (tokens/s, TTFT and inter-token latency at each concurrency), invariance (greedy
ids alone vs inside a batch over --invariance-prompts prompts), dtypes (greedy agreement with fp32,
perplexity on a fixed text, decode tokens/s at batch 1 and 16), memory (memory model vs the measured
allocator peak, prompts 16..2048), flood (budget for ~3.5 long requests, 16 submitted at once).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.inference.engine.core import Engine, EngineConfig, GenerationRequest, TokenEvent
from services.inference.formats.gateprompts import chat_prompts
from services.inference.model.loader import load_model
from services.inference.model.quant import QUANTIZED, quantize_linears
from shared.modelfile import source as model_source

MODEL = model_source().cache_dir
GATE_AGREEMENT = 0.8  # share of greedy tokens equal to fp32's, position by position
GATE_PPL = 1.05       # perplexity at most 5% above fp32's
PPL_TEXT = ("The history of science is the study of the development of science and scientific knowledge, "
            "including both the natural and social sciences. Science is a body of empirical, theoretical, and "
            "practical knowledge about the natural world, produced by scientists who emphasize the observation, "
            "explanation, and prediction of real-world phenomena. The earliest roots of science can be traced to "
            "Ancient Egypt and Mesopotamia in around 3000 to 1200 BCE. Their contributions to mathematics, "
            "astronomy, and medicine entered and shaped Greek natural philosophy of classical antiquity, whereby "
            "formal attempts were made to provide explanations of events in the physical world based on natural "
            "causes.")


NOTES = ("Keel runs in-process (no gRPC). The peer is `model.generate` on static left-padded batches of "
         "the same prompts (chat template, 35-45 tokens), greedy, eos disabled on both sides so every request "
         "yields exactly the asked number of tokens. tok/s counts generated tokens over the wall time of the "
         "whole set, prefills included. Keel's TTFT is per request from submission; the peer's is one "
         "`max_new_tokens=1` pass per batch. Figures from one run on a machine shared with other work: "
         "compare ratios within a table, not across runs.")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")


def engine_for(model, device: str, dtype: str, **kw) -> Engine:
    cfg = dict(memory_budget_bytes=16 * 2 ** 30, max_batch_size=64, eos_token_ids=(), device=device, format=dtype,
               max_queued_requests=4096, max_queued_tokens=10 ** 8, queue_timeout_ms=10 ** 7)
    cfg.update(kw)
    engine = Engine(model, EngineConfig(**cfg))
    engine.warmup()
    return engine


async def keel_run(engine: Engine, ids: list[list[int]], tokens: int, concurrency: int, seed: int = 0):
    """All prompts through the engine, at most `concurrency` in flight; returns outputs and timings."""
    gate = asyncio.Semaphore(concurrency)
    ttft, itl, outs = [], [], [None] * len(ids)

    async def one(i: int):
        async with gate:
            start = last = time.perf_counter()
            got = []
            async for ev in engine.generate(GenerationRequest(f"b{seed}-{i}", ids[i], tokens)):
                if isinstance(ev, TokenEvent):
                    now = time.perf_counter()
                    (itl if got else ttft).append(now - last if got else now - start)
                    last = now
                    got.append((ev.token_id, ev.logprob))
            outs[i] = got

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(len(ids))))
    wall = time.perf_counter() - t0
    return outs, {"tok_s": sum(map(len, outs)) / wall, "ttft_p50": pct(ttft, .5), "ttft_p99": pct(ttft, .99),
                  "itl_p50": pct(itl, .5), "itl_p99": pct(itl, .99)}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def hf_model(dtype: str, device: str) -> torch.nn.Module:
    """The peer's own model of the same files (Keel's load_model gives Keel's module, without generate)."""
    # bandit B615 does not apply: a local directory, never the Hub.
    return AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=getattr(torch, dtype)).to(device).eval()  # nosec B615


@torch.inference_mode()
def hf_run(model, ids: list[list[int]], tokens: int, batch: int, device: str) -> dict:
    """The peer: static left-padded batches through model.generate, greedy, fixed length."""
    gen_tokens, ttft, t0 = 0, [], time.perf_counter()
    for i in range(0, len(ids), batch):
        chunk = ids[i:i + batch]
        width = max(map(len, chunk))
        x = torch.tensor([[2] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        t1 = time.perf_counter()
        model.generate(x, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=2)
        sync(device)
        ttft.append(time.perf_counter() - t1)
        out = model.generate(x, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=2)
        sync(device)
        gen_tokens += (out.shape[1] - width) * len(chunk)
    wall = time.perf_counter() - t0 - sum(ttft)  # the separate TTFT passes are not part of throughput
    return {"tok_s": gen_tokens / wall, "ttft_p50": pct(ttft, .5), "ttft_p99": pct(ttft, .99)}


async def throughput(model, ids, args, dtype: str, device: str, lines: list[str]) -> None:
    engine = engine_for(model, device, dtype)
    await engine.start()
    lines += [f"\n### Throughput, {dtype}, {args.tokens} tokens per request\n",
              "| concurrency | requests | keel tok/s | HF static tok/s | keel / HF | keel TTFT p50 / p99 ms "
              "| keel ITL p50 / p99 ms | HF TTFT p50 / p99 ms |", "|---|---|---|---|---|---|---|---|"]
    peer = hf_model(dtype, device)
    for c in args.concurrency:
        n = max(2 * c, 4)
        _, k = await keel_run(engine, ids[:n], args.tokens, c)
        h = hf_run(peer, ids[:n], args.tokens, c, device)
        lines.append(f"| {c} | {n} | {k['tok_s']:.1f} | {h['tok_s']:.1f} | {k['tok_s'] / h['tok_s']:.2f}x | "
                     f"{k['ttft_p50']:.0f} / {k['ttft_p99']:.0f} | {k['itl_p50']:.0f} / {k['itl_p99']:.0f} | "
                     f"{h['ttft_p50']:.0f} / {h['ttft_p99']:.0f} |")
        print(lines[-1], flush=True)
    await engine.stop(0)
    plain = engine_for(model, device, dtype, batch_invariant=False)
    await plain.start()
    _, k = await keel_run(plain, ids[:4], args.tokens, 1)
    await plain.stop(0)
    lines.append(f"\nWithout batch-invariance padding (`batch_invariant=False`), concurrency 1: {k['tok_s']:.1f} "
                 f"tok/s, ITL p50 {k['itl_p50']:.0f} ms (padding a single row to 4 costs this much).")
    print(lines[-1], flush=True)


async def invariance(model, ids, args, device: str, lines: list[str], dtype: str = "float32") -> list[list[int]]:
    engine = engine_for(model, device, dtype, max_batch_size=16)
    await engine.start()
    n = args.invariance_prompts
    alone, _ = await keel_run(engine, ids[:n], args.invariance_tokens, 1)
    batched, _ = await keel_run(engine, ids[:n], args.invariance_tokens, 16, seed=1)
    await engine.stop(0)
    same_ids = sum(a == b for a, b in zip(([t for t, _ in o] for o in alone), ([t for t, _ in o] for o in batched)))
    same_bits = sum(a == b for a, b in zip(alone, batched))
    lines += [f"\n### Batch invariance ({dtype}, greedy, {args.invariance_tokens} tokens)\n",
              f"{n} prompts, each run alone and then 16 at a time: identical token ids for {same_ids}/{n} "
              f"({100 * same_ids / n:.1f}%); identical logprobs, bit for bit, for {same_bits}/{n}."]
    print(lines[-1], flush=True)
    return [[t for t, _ in o] for o in alone]


async def determinism(model, ids, device: str, lines: list[str]) -> None:
    """The same seeded sampling request 10 times, alone and with 15 other requests in flight."""
    engine = engine_for(model, device, "float32", max_batch_size=16)
    await engine.start()
    req = lambda i: GenerationRequest(f"d{i}", ids[0], 32, temperature=0.8, top_p=0.95, seed=7)  # noqa: E731
    runs = []
    for i in range(10):
        others = [asyncio.create_task(keel_run(engine, ids[1 + j:2 + j], 32, 1, seed=100 * i + j))
                  for j in range(15 if i % 2 else 0)]
        got = [(ev.token_id, ev.logprob) async for ev in engine.generate(req(i)) if isinstance(ev, TokenEvent)]
        await asyncio.gather(*others)
        runs.append(got)
    await engine.stop(0)
    same = sum([t for t, _ in r] == [t for t, _ in runs[0]] for r in runs)
    diff = max(abs(a[1] - b[1]) for r in runs for a, b in zip(r, runs[0]))
    lines += ["\n### Determinism (fp32, temperature 0.8, top_p 0.95, seed 7, 32 tokens)\n",
              f"10 runs (odd runs with 15 other requests in the batch): identical ids {same}/10, "
              f"max logprob difference {diff:.2e}."]
    print(lines[-1], flush=True)


def perplexity(model, tok, device: str) -> float:
    ids = torch.tensor([tok(PPL_TEXT)["input_ids"]], device=device)
    with torch.inference_mode():
        return float(torch.exp(model(ids, labels=ids).loss))


async def dtypes(ids, tok, args, device: str, fp32_greedy, lines: list[str]) -> None:
    lines += [f"\n### dtypes (quality gate over {args.quality_prompts} prompts, {args.invariance_tokens} tokens)\n",
              f"Gate: greedy tokens agreeing with fp32 >= {GATE_AGREEMENT:.0%} and perplexity within "
              f"{GATE_PPL - 1:.0%} of fp32's.\n",
              "| dtype | identical to fp32 (prompts) | tokens agreeing with fp32 | perplexity | gate | "
              "keel decode tok/s b1 / b16 | HF tok/s b1 / b16 |", "|---|---|---|---|---|---|---|"]
    ppl_fp32 = None
    n = args.quality_prompts
    names = ["float32", "bfloat16"] + (["int8"] if device == "cpu" else [])
    for dtype in names:
        model = load_model(MODEL, dtype, device)
        engine = engine_for(model, device, dtype, max_batch_size=16)
        await engine.start()
        outs, _ = await keel_run(engine, ids[:n], args.invariance_tokens, 16)
        greedy = [[t for t, _ in o] for o in outs]
        # the peer runs the same weight format: its Linears swapped as load_model swaps Keel's
        peer = quantize_linears(hf_model("float32", device), dtype) if dtype in QUANTIZED else hf_model(dtype, device)
        speeds = []
        for c in (1, 16):
            _, k = await keel_run(engine, ids[:max(2 * c, 4)], args.tokens, c, seed=c)
            speeds.append((k["tok_s"], hf_run(peer, ids[:max(2 * c, 4)], args.tokens, c, device)["tok_s"]))
        await engine.stop(0)
        same = sum(a == b for a, b in zip(greedy, fp32_greedy[:n]))
        agree = sum(x == y for a, b in zip(greedy, fp32_greedy) for x, y in zip(a, b))
        total = sum(len(b) for b in fp32_greedy[:n])
        ppl = perplexity(model, tok, device)
        ppl_fp32 = ppl_fp32 or ppl
        passed = agree / total >= GATE_AGREEMENT and ppl <= GATE_PPL * ppl_fp32
        lines.append(f"| {dtype} | {same}/{n} | {100 * agree / total:.1f}% | {ppl:.3f} | "
                     f"{'passes' if passed else 'fails'} | {speeds[0][0]:.1f} / {speeds[1][0]:.1f} | "
                     f"{speeds[0][1]:.1f} / {speeds[1][1]:.1f} |")
        print(lines[-1], flush=True)


async def memory(model, device: str, lines: list[str]) -> None:
    engine = engine_for(model, device, "float32", memory_audit=True, max_context_tokens=4096)
    await engine.start()
    mem = engine.memory
    lines += ["\n### Memory model vs measured peak (fp32, one request at a time, sampled, 8 tokens)\n",
              f"Measured at warmup: static {mem.static_bytes / 2**20:.1f} MiB, prefill "
              f"{mem.prefill_bytes_per_token / 1024:.1f} KiB per prompt token, decode "
              f"{mem.decode_bytes_per_token / 1024:.1f} KiB per generated token (cache: "
              f"{mem.kv_bytes_per_token / 1024:.1f} KiB), fixed {mem.fixed_bytes / 2**20:.2f} MiB.\n",
              "| prompt tokens | predicted MiB | measured peak MiB | error (total) | error (request share) |",
              "|---|---|---|---|---|"]
    for n in (16, 128, 512, 1024, 2048):
        ids = [3 + (i * 7919) % 49000 for i in range(n)]
        async for _ in engine.generate(GenerationRequest(f"m{n}", ids, 8, temperature=1.0, top_p=0.9)):
            pass
        seen = engine.stats().memory.observed_peak_bytes
        pred = mem.static_bytes + mem.request_bytes(n, 8)
        own_err = mem.request_bytes(n, 8) / (seen - mem.static_bytes) - 1
        lines.append(f"| {n} | {pred / 2**20:.1f} | {seen / 2**20:.1f} | {100 * (pred / seen - 1):+.1f}% | "
                     f"{100 * own_err:+.1f}% |")
        print(lines[-1], flush=True)
    await engine.stop(0)


def rss_peak_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


async def flood(model, device: str, lines: list[str]) -> None:
    """Twice: without the audit for process RSS (first, on a fresh heap), then with the allocator audit."""
    probe = engine_for(model, device, "float32")
    budget = int(probe.memory.static_bytes + 3.5 * probe.memory.request_bytes(512, 64))
    ids = [[3 + (i * 7919 + j) % 49000 for i in range(512)] for j in range(16)]
    results = {}
    for audit in (False, True):
        engine = engine_for(model, device, "float32", memory_budget_bytes=budget, memory_audit=audit)
        await engine.start()
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        rss0 = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        t0 = time.perf_counter()
        outs, _ = await keel_run(engine, ids, 64, 16, seed=int(audit))
        results[audit] = (time.perf_counter() - t0, sum(len(o) == 64 for o in outs),
                          engine.stats().memory.observed_peak_bytes, rss_peak_bytes() - rss0)
        await engine.stop(0)
    static = probe.memory.static_bytes
    seen, rss_growth = results[True][2], results[False][3]
    lines += ["\n### Flood of long requests (fp32, 16 x (512 prompt + 64 generated) submitted at once)\n",
              f"Budget {budget / 2**20:.1f} MiB (static {static / 2**20:.1f} MiB + room for 3.5 such requests), "
              f"so at most 3 run at a time. Finished: {results[True][1]}/16 in {results[True][0]:.1f} s with the "
              f"audit, {results[False][1]}/16 in {results[False][0]:.1f} s without.\n",
              f"- allocator-measured peak (static + caches + per-iteration transient, audit run): "
              f"{seen / 2**20:.1f} MiB = {100 * seen / budget:.1f}% of the budget",
              f"- process RSS growth (VmHWM after reset, run without audit): {rss_growth / 2**20:.1f} MiB against "
              f"{(budget - static) / 2**20:.1f} MiB of budget beyond the weights; weights + growth = "
              f"{100 * (static + rss_growth) / budget:.1f}% of the budget"]
    print("\n".join(lines[-3:]), flush=True)


def machine() -> str:
    model = next((ln.split(":", 1)[1].strip() for ln in subprocess.run(["lscpu"], capture_output=True, text=True)
                  .stdout.splitlines() if ln.startswith("Model name")), platform.processor())
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{model}, {os.cpu_count()} cores{gpu}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
            f"load average at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


async def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="CUDA mode: memory, determinism, throughput at 1/16/64")
    ap.add_argument("--sections", default="all",
                    help="comma list: throughput,invariance,determinism,dtypes,memory,flood")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--invariance-prompts", type=int, default=200)
    ap.add_argument("--invariance-tokens", type=int, default=16)
    ap.add_argument("--quality-prompts", type=int, default=200)
    ap.add_argument("--invariance-formats", type=lambda s: s.split(","), default=[],
                    help="comma list of further weight formats whose batch invariance is measured (e.g. bfloat16,int8)")
    ap.add_argument("--write", type=Path)
    args = ap.parse_args(argv)
    lines = await (run_gpu(args) if args.gpu else run_cpu(args, "cpu"))
    doc = ["# Inference benchmark" + (" (CUDA)" if args.gpu else ""), "",
           f"Command: `.venv/bin/python {' '.join(['-m', 'bench.bench_inference'] + (argv or sys.argv[1:]))}`",
           f"Machine: {machine()}", "", NOTES, *lines, ""]
    print("\n".join(doc))
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text("\n".join(doc))
    return 0


async def run_gpu(args) -> list[str]:
    """CUDA: memory model vs torch.cuda.max_memory_allocated, determinism, throughput at 1/16/64."""
    if not torch.cuda.is_available():
        raise SystemExit("--gpu needs CUDA")
    # bandit B615 does not apply: a local directory, never the Hub.
    ids = chat_prompts(AutoTokenizer.from_pretrained(str(MODEL / "hf-tokenizer")), 200)  # nosec B615
    lines: list[str] = []
    model = load_model(MODEL, "float32", "cuda")
    await memory(model, "cuda", lines)
    await determinism(model, ids, "cuda", lines)
    args.concurrency = [1, 16, 64]
    await throughput(model, ids, args, "float32", "cuda", lines)
    await throughput(load_model(MODEL, "bfloat16", "cuda"), ids, args, "bfloat16", "cuda", lines)
    return lines


async def run_cpu(args, device: str) -> list[str]:
    want = {"throughput", "invariance", "determinism", "dtypes", "memory", "flood"} if args.sections == "all" \
        else set(args.sections.split(","))
    # bandit B615 does not apply: a local directory, never the Hub.
    tok = AutoTokenizer.from_pretrained(str(MODEL / "hf-tokenizer"))  # nosec B615
    ids = chat_prompts(tok, max(200, args.invariance_prompts))
    model = load_model(MODEL, "float32", device)
    lines: list[str] = []
    if "throughput" in want:
        await throughput(model, ids, args, "float32", device, lines)
    fp32_greedy = None
    if "invariance" in want or "dtypes" in want:
        fp32_greedy = await invariance(model, ids, args, device, lines)
    for dtype in args.invariance_formats if "invariance" in want else ():
        await invariance(load_model(MODEL, dtype, device), ids, args, device, lines, dtype)
    if "determinism" in want:
        await determinism(model, ids, device, lines)
    if "dtypes" in want:
        await dtypes(ids, tok, args, device, fp32_greedy, lines)
    if "memory" in want:
        await memory(model, device, lines)
    if "flood" in want:
        await flood(model, device, lines)
    return lines


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
