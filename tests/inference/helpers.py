"""Helpers shared by the inference tests (requests, prompts, stream collection)."""
from __future__ import annotations

from services.inference.engine import Engine, EngineConfig, Finished, GenerationRequest, TokenEvent

# Long enough prompts that the tiny model's activations, not its fixed buffers, set the prefill peak.
TINY_PROBES = (16, 256, 1024)


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
