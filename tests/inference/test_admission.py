"""Admission against the memory budget, the bounded queue, and request validation."""
from __future__ import annotations

import asyncio
import math

import pytest

from services.inference import config as inference_config
from services.inference.engine.core import Engine, EngineConfig
from shared.config import ConfigError
from shared.errors import InvalidInput, NotReady, Overloaded, PreconditionFailed
from tests.inference.faults import FaultSpec, inject
from tests.inference.helpers import collect, prompt, request, tiny_config


@pytest.fixture
def budget_engine(make_engine, tiny_memory):
    """budget_engine(rows, prompt_tokens, max_tokens, **config): budget for `rows` such requests."""
    async def make(rows: float, prompt_tokens: int, max_tokens: int, **kw):
        budget = int(tiny_memory.static_bytes + rows * tiny_memory.request_bytes(prompt_tokens, max_tokens))
        engine = await make_engine(memory_budget_bytes=budget, **kw)
        assert engine.memory.request_bytes(prompt_tokens, max_tokens) == \
            tiny_memory.request_bytes(prompt_tokens, max_tokens)
        return engine
    return make


@pytest.mark.slow
@pytest.mark.asyncio
async def test_request_that_never_fits_names_the_largest_that_does(budget_engine):
    engine = await budget_engine(1.0, 100, 400)
    max_total = engine.memory.max_total_tokens(engine.config.memory_budget_bytes)
    # The budget was sized for 100 + 400 tokens, whose cache is charged in whole blocks.
    assert 100 < max_total <= engine.memory.cache_positions(500)
    with pytest.raises(PreconditionFailed) as e:
        await collect(engine, request("big", prompt(1, 100), max_tokens=max_total))
    assert e.value.reason == "REQUEST_EXCEEDS_MEMORY_BUDGET"
    assert int(e.value.metadata["max_total_tokens"]) == max_total
    tokens, _ = await collect(engine, request("fits", prompt(1, 100), max_tokens=max_total - 100))
    assert len(tokens) == max_total - 100


@pytest.mark.asyncio
async def test_second_request_waits_in_queue_then_runs(budget_engine):
    engine = await budget_engine(1.5, 20, 300)
    first = engine.generate(request("a", prompt(1, 20), max_tokens=300))
    await first.__anext__()
    second = asyncio.create_task(collect(engine, request("b", prompt(2, 20), max_tokens=5)))
    await asyncio.sleep(0.05)
    stats = engine.stats()
    assert stats.queue_depth == 1 and stats.running_batch_size == 1
    assert stats.memory.predicted_bytes <= stats.memory.budget_bytes
    async for _ in first:
        pass
    tokens, fin = await second
    assert len(tokens) == 5 and fin.queue_ms > 0


@pytest.mark.asyncio
async def test_full_queue_is_overloaded_with_a_retry_hint(budget_engine):
    engine = await budget_engine(1.5, 20, 300, max_queued_requests=1)
    first = engine.generate(request("a", prompt(1, 20), max_tokens=300))
    await first.__anext__()
    waiting = asyncio.create_task(collect(engine, request("b", prompt(2, 20), max_tokens=5)))
    await asyncio.sleep(0.05)
    with pytest.raises(Overloaded) as e:
        await collect(engine, request("c", prompt(3, 20), max_tokens=5))
    assert e.value.reason == "QUEUE_FULL" and e.value.retry_after_ms >= 50
    await first.aclose()
    assert len((await waiting)[0]) == 5


@pytest.mark.asyncio
async def test_queued_tokens_limit_applies(budget_engine):
    engine = await budget_engine(1.5, 20, 300, max_queued_tokens=30)
    first = engine.generate(request("a", prompt(1, 20), max_tokens=300))
    await first.__anext__()
    with pytest.raises(Overloaded) as e:
        await collect(engine, request("b", prompt(2, 20), max_tokens=11))  # 31 tokens > 30
    assert e.value.reason == "QUEUE_FULL"
    await first.aclose()


@pytest.mark.asyncio
async def test_queue_timeout_is_overloaded(budget_engine):
    engine = await budget_engine(1.5, 20, 3000, queue_timeout_ms=60)
    first = engine.generate(request("a", prompt(1, 20), max_tokens=3000))
    await first.__anext__()
    with pytest.raises(Overloaded) as e:
        await collect(engine, request("b", prompt(2, 20), max_tokens=5))
    assert e.value.reason == "QUEUE_TIMEOUT" and e.value.retry_after_ms > 0
    assert engine.stats().queue_depth == 0
    await first.aclose()


@pytest.mark.slow
@pytest.mark.asyncio
async def test_flood_never_exceeds_the_budget(budget_engine):
    """Measured (allocator-level) peak of every iteration stays within the budget under a flood."""
    engine = await budget_engine(2.5, 600, 60, memory_audit=True)
    budget = engine.config.memory_budget_bytes
    seen = []

    async def sample():
        while True:
            seen.append(engine.stats().memory.predicted_bytes)
            await asyncio.sleep(0.002)

    sampler = asyncio.create_task(sample())
    results = await asyncio.gather(*(collect(engine, request(f"f{i}", prompt(i, 600), max_tokens=60))
                                     for i in range(6)))
    sampler.cancel()
    assert all(len(tokens) == 60 for tokens, _ in results)
    assert max(seen) <= budget
    assert max(seen) > engine.memory.static_bytes + engine.memory.request_bytes(600, 60)  # 2 ran at once
    observed = engine.stats().memory.observed_peak_bytes
    assert engine.memory.static_bytes < observed <= budget


BAD_REQUESTS = [
    (dict(prompt_ids=[]), "EMPTY_PROMPT"),
    (dict(prompt_ids=[1, 49152]), "TOKEN_OUT_OF_RANGE"),
    (dict(prompt_ids=[1, -1]), "TOKEN_OUT_OF_RANGE"),
    (dict(prompt_ids=[1, 2.0]), "TOKEN_OUT_OF_RANGE"),
    (dict(prompt_ids=[True]), "TOKEN_OUT_OF_RANGE"),
    (dict(max_tokens=0), "MAX_TOKENS_INVALID"),
    (dict(max_tokens=4096), "CONTEXT_LENGTH_EXCEEDED"),
    (dict(temperature=-0.1), "TEMPERATURE_OUT_OF_RANGE"),
    (dict(temperature=math.nan), "TEMPERATURE_OUT_OF_RANGE"),
    (dict(temperature=math.inf), "TEMPERATURE_OUT_OF_RANGE"),
    (dict(top_p=0.0), "TOP_P_OUT_OF_RANGE"),
    (dict(top_p=1.5), "TOP_P_OUT_OF_RANGE"),
    (dict(top_k=-1), "TOP_K_OUT_OF_RANGE"),
    (dict(seed=-5), "SEED_OUT_OF_RANGE"),
    (dict(seed=2 ** 63), "SEED_OUT_OF_RANGE"),
    (dict(stop_token_ids=(99999,)), "TOKEN_OUT_OF_RANGE"),
    (dict(deadline=math.nan), "INVALID_DEADLINE"),
    (dict(request_id=""), "MISSING_REQUEST_ID"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("fields,reason", BAD_REQUESTS, ids=[r for _, r in BAD_REQUESTS])
async def test_bad_requests_are_invalid_input(shared_engine, fields, reason):
    engine = shared_engine
    base = dict(request_id="r", prompt_ids=[5, 6, 7], max_tokens=4)
    base.update(fields)
    with pytest.raises(InvalidInput) as e:
        await collect(engine, request(base.pop("request_id"), base.pop("prompt_ids"), **base))
    assert e.value.reason == reason
    assert engine.stats().running_batch_size == 0 and engine.stats().queue_depth == 0


@pytest.mark.asyncio
async def test_generate_before_start_is_not_ready(tiny):
    engine = Engine(tiny, tiny_config())
    with pytest.raises(NotReady) as e:
        await collect(engine, request("r", prompt(1)))
    assert e.value.reason == "WARMING_UP"
    with pytest.raises(NotReady):
        await engine.start()  # warmup() has not run


def test_budget_smaller_than_the_model_is_refused(tiny):
    engine = Engine(tiny, tiny_config(memory_budget_bytes=1_000_000))
    with pytest.raises(InvalidInput) as e:
        engine.warmup()
    assert e.value.reason == "BUDGET_TOO_SMALL"


@pytest.mark.parametrize("field,value", [("max_batch_size", "0"), ("max_batch_size", "65"),
                                         ("memory_budget_bytes", "1000"), ("queue_timeout_ms", "0"),
                                         ("max_queued_requests", "-1"), ("format", "fp8"),
                                         ("warmup_prompt_tokens", "[]"), ("intra_op_threads", "0")])
def test_bad_config_is_rejected(field, value):
    """Each field's bounds are the config schema's: the stage's config load refuses the value."""
    with pytest.raises(ConfigError, match=f"field 'engine.{field}' breaks rule"):
        inference_config.load(environ={f"KEEL_INFERENCE_ENGINE__{field.upper()}": value})


def test_a_format_the_device_cannot_run_is_rejected():
    with pytest.raises(InvalidInput) as e:
        EngineConfig(memory_budget_bytes=10 ** 9, format="int4", device="cuda")
    assert e.value.reason == "UNSUPPORTED_FORMAT"


def test_model_format_must_match_config(tiny):
    with pytest.raises(InvalidInput) as e:
        Engine(tiny, tiny_config(format="bfloat16"))
    assert e.value.reason == "FORMAT_MISMATCH"


@pytest.mark.slow
@pytest.mark.asyncio
async def test_full_queue_refuses_without_waiting_for_the_running_step(budget_engine):
    """Each step of the running request sleeps 2 s; a request that finds the queue full is refused
    within the step, not after it (no step ends in between: the streamed-token count is unchanged)."""
    engine = await budget_engine(1.5, 20, 300, max_queued_requests=1)
    inject(engine)["a"] = FaultSpec(slow_step_ms=2000)
    first = engine.generate(request("a", prompt(1, 20), max_tokens=300))
    await first.__anext__()
    waiting = asyncio.create_task(collect(engine, request("b", prompt(2, 20), max_tokens=5)))
    for _ in range(500):  # b is queued at the loop's next iteration
        if engine.stats().queue_depth == 1:
            break
        await asyncio.sleep(0.01)
    before = engine.stats()
    assert before.queue_depth == 1 and before.retry_after_ms >= 50
    with pytest.raises(Overloaded) as e:
        await collect(engine, request("c", prompt(3, 20), max_tokens=5))
    assert engine.stats().counters.tokens == before.counters.tokens, "the refusal waited for a step"
    assert e.value.reason == "QUEUE_FULL" and e.value.retry_after_ms == before.retry_after_ms
    assert e.value.metadata == {"queued_requests": "1", "queued_tokens": "25"}
    await first.aclose()
    assert len((await waiting)[0]) == 5
    assert engine.stats().counters.failed["QUEUE_FULL"] == 1
