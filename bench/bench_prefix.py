"""Prefix cache: time to first token of a request whose 300-token prefix is cached, against the same
request without a hit, in one engine and one run (real model, fp32, one torch thread).

Run:  .venv/bin/python -m bench.bench_prefix [--chunk 64] [--rounds 5]

Each round makes a fresh 300-token prefix (so the first request on it misses), sends a request with
that prefix and a 20-token suffix (miss), then another request with the same prefix and another suffix
(hit: the prefix's full chunks come from the cache). Both requests are alone in the engine and ask for
one token, so TTFT is the prefill. Also timed: the same miss on an engine with chunking off (a whole
prefill in one pass), the peer of the chunked numbers. Prints the medians and the ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics

import torch

from services.inference.engine.core import Engine, EngineConfig, GenerationRequest
from services.inference.model.loader import load_model
from shared.modelfile import source as model_source

PREFIX, SUFFIX = 300, 20


def ids(seed: int, n: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 49000 for i in range(n)]


async def ttft_ms(engine: Engine, rid: str, prompt: list[int]) -> float:
    async for item in engine.generate(GenerationRequest(rid, prompt, max_tokens=1)):
        if hasattr(item, "ttft_ms"):
            return item.ttft_ms
    raise RuntimeError("no Finished")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = load_model(model_source().cache_dir, "float32")
    common = dict(memory_budget_bytes=3 * 2**30, warmup_prompt_tokens=(16, 64), warmup_max_tokens=16)
    cached = Engine(model, EngineConfig(**common, prefill_tokens_per_iteration=args.chunk,
                                        prefix_cache_bytes=256 * 2**20))
    whole = Engine(model, EngineConfig(**common))
    for engine in (cached, whole):
        engine.warmup()
        await engine.start()
    miss, hit, unchunked = [], [], []
    await ttft_ms(cached, "warm", ids(999, PREFIX + SUFFIX))
    for r in range(args.rounds):
        prefix = ids(100 + r, PREFIX)
        miss.append(await ttft_ms(cached, f"m{r}", prefix + ids(200 + r, SUFFIX)))
        hit.append(await ttft_ms(cached, f"h{r}", prefix + ids(300 + r, SUFFIX)))
        unchunked.append(await ttft_ms(whole, f"w{r}", prefix + ids(200 + r, SUFFIX)))
    med = {k: statistics.median(v) for k, v in (("miss", miss), ("hit", hit), ("unchunked", unchunked))}
    print(f"chunk {args.chunk}, prefix {PREFIX} + suffix {SUFFIX} tokens, {args.rounds} rounds, medians (ms):")
    print(f"  miss (chunked) {med['miss']:.1f}  hit {med['hit']:.1f}  miss (whole prefill) {med['unchunked']:.1f}")
    print(f"  hit / miss = {med['hit'] / med['miss']:.3f}   hit / whole-prefill miss = "
          f"{med['hit'] / med['unchunked']:.3f}   hit rate {cached.stats().prefix_cache.hit_rate:.3f}")
    for engine in (cached, whole):
        await engine.stop(grace_s=0)


if __name__ == "__main__":
    asyncio.run(main())
