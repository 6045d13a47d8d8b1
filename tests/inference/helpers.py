"""Helpers shared by the inference tests (requests, prompts, stream collection)."""
from __future__ import annotations

import torch

from services.inference.engine.core import Engine, EngineConfig, Finished, GenerationRequest, TokenEvent
from services.inference.engine.prefix import PrefixCache
from services.inference.formats import selection
from services.inference.model.kvpool import RowCache

# Long enough prompts that the tiny model's activations, not its fixed buffers, set the prefill peak.
TINY_PROBES = (16, 256, 1024)


def read_cache(cache: RowCache, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the keys and values at positions start..start+n-1, [layers, KV, n, D] each."""
    pool = cache.pool
    index = torch.tensor(pool.slots(cache, start, n))
    layers = [pool.layer(i) for i in range(pool.keys.shape[0])]
    return (torch.stack([k.index_select(1, index) for k, _ in layers]),
            torch.stack([v.index_select(1, index) for _, v in layers]))


def write_cache(cache: RowCache, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Store keys and values [layers, KV, n, D] at positions start..start+n-1 (the length is unchanged)."""
    pool = cache.pool
    index = torch.tensor(pool.slots(cache, start, keys.shape[2]))
    for i in range(keys.shape[0]):
        k, v = pool.layer(i)
        k.index_copy_(1, index, keys[i])
        v.index_copy_(1, index, values[i])


def clone_cache(cache: RowCache) -> RowCache:
    """A cache of its own in the same pool with the same contents and length (a row replayed alone)."""
    copy = cache.pool.allocate(cache.capacity)
    write_cache(copy, 0, *read_cache(cache, 0, cache.capacity))
    copy.length = cache.length
    return copy


# What `auto` reports for a format that passed its gate and was then measured on this host: timed,
# or refused for rows that are not batch-invariant here (aten's bfloat16 kernels are on some CPUs).
MEASURED_VERDICTS = (selection.TIMED, selection.NOT_ROW_INVARIANT, selection.STEP_NOT_INVARIANT)


def measured(reason: str, fmt: str) -> bool:
    """True when `auto`'s reason shows `fmt` measured on the host, not stopped before (no gate result)."""
    return any(f"{fmt}: {v}" in reason for v in MEASURED_VERDICTS)


def tiny_config(**overrides) -> EngineConfig:
    values = dict(memory_budget_bytes=400_000_000, max_context_tokens=4096, warmup_prompt_tokens=TINY_PROBES,
                  eos_token_ids=())
    values.update(overrides)
    return EngineConfig(**values)


def prompt(seed: int, length: int = 12) -> list[int]:
    """A deterministic prompt of ids in the tiny vocabulary."""
    return [3 + (seed * 7919 + i * 104729) % 49000 for i in range(length)]


def request(rid: str, ids: list[int], max_tokens: int = 10, **kw) -> GenerationRequest:
    return GenerationRequest(request_id=rid, prompt_ids=ids, max_tokens=max_tokens, **kw)


async def collect(engine: Engine, req: GenerationRequest) -> tuple[list[TokenEvent], Finished]:
    tokens, finished = [], None
    async for item in engine.generate(req):
        if isinstance(item, TokenEvent):
            tokens.append(item)
        else:
            finished = item
    return tokens, finished


def ids(tokens: list[TokenEvent]) -> list[int]:
    return [t.token_id for t in tokens]




def put(cache: PrefixCache, runner: str, adapter: str, ids: list[int], index: int, pool, blocks: list[int]) -> None:
    """What the engine does after a prefill chunk: the cache holds block `index` of the prompt."""
    cache.store(runner, cache.keys(adapter, ids)[index], pool, blocks)


def find(cache: PrefixCache, runner: str, adapter: str, ids: list[int]) -> list[list[int]]:
    """What the engine does at admission: the cached blocks the prompt starts with."""
    return cache.lookup(runner, cache.keys(adapter, ids), len(ids))
