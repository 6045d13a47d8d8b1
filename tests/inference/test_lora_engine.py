"""Requests with LoRA adapters through the engine: resolution, errors, mixed batches, no file reads."""
from __future__ import annotations

import asyncio
import sys

import pytest

from services.inference.engine.core import Engine
from services.inference.lora.registration import register
from services.inference.lora.registry import LoraConfig, load_registry
from shared.errors import NotFound, PreconditionFailed
from testing.lora import base_of, make_adapter
from tests.inference.helpers import collect, ids, prompt, request, tiny_config

_OPENS: list[tuple] | None = None


def _audit(event, args):
    if _OPENS is not None and event == "open":
        _OPENS.append(args)


sys.addaudithook(_audit)  # hooks cannot be removed: it records only while a test sets _OPENS


@pytest.fixture(scope="module")
def registry(tiny, tmp_path_factory):
    """A registry with two good adapters and one made against another base."""
    root = tmp_path_factory.mktemp("lora")
    cfg = LoraConfig(registry_dir=str(root / "registry"))
    base = base_of(tiny)
    register(make_adapter(tiny, root / "a", seed=1), "alpha", "1", base, cfg)
    register(make_adapter(tiny, root / "b", seed=2, rank=8, targets=("o_proj", "gate_proj", "down_proj")),
             "beta", "1", base, cfg)
    register(make_adapter(tiny, root / "c", seed=3), "gamma", "1", base_of(tiny, "another-base"), cfg)
    return cfg, base.check_prompts


async def _engine(tiny, cfg, **overrides) -> Engine:
    engine = Engine(tiny, tiny_config(**overrides))
    engine.warmup()
    engine.install_adapters(load_registry(cfg, base_of(tiny, runner=engine.primary_runner)))
    await engine.start()
    return engine


@pytest.mark.asyncio
async def test_requests_are_served_by_the_adapter_they_name(tiny, registry):
    cfg, check_prompts = registry
    engine = await _engine(tiny, cfg)
    try:
        from services.inference.lora import manifest
        golden = manifest.read(cfg.root / "alpha" / "1").golden_ids
        p = list(check_prompts.prompts[0])
        steps = check_prompts.continuation_tokens
        tokens, fin = await collect(engine, request("r1", p, steps, adapter="alpha"))
        assert tuple(ids(tokens)) == golden[0] and fin.adapter == "alpha@1"
        assert fin.span_attributes()["inference.adapter"] == "alpha@1"
        base_tokens, base_fin = await collect(engine, request("r2", p, steps))
        assert base_fin.adapter == "" and ids(base_tokens) != ids(tokens)
        _, fin = await collect(engine, request("r3", p, 2, adapter="beta@1"))
        assert fin.adapter == "beta@1"
    finally:
        await engine.stop(grace_s=0)


@pytest.mark.asyncio
async def test_unknown_and_refused_adapters_fail_and_never_fall_back(tiny, registry):
    engine = await _engine(tiny, registry[0])
    try:
        with pytest.raises(NotFound) as exc:
            await collect(engine, request("r1", prompt(1), 4, adapter="nobody"))
        assert exc.value.reason == "ADAPTER_NOT_FOUND"
        with pytest.raises(PreconditionFailed) as exc:
            await collect(engine, request("r2", prompt(1), 4, adapter="gamma@1"))
        assert exc.value.reason == "ADAPTER_REFUSED"
        assert exc.value.metadata["refusal_reason"] == "BASE_FINGERPRINT_MISMATCH"
    finally:
        await engine.stop(grace_s=0)


@pytest.mark.asyncio
async def test_mixed_concurrent_requests_equal_each_alone_and_read_no_file(tiny, registry):
    global _OPENS
    engine = await _engine(tiny, registry[0])
    try:
        names = ["", "alpha", "beta", "alpha@1", "", "beta", "alpha", ""]
        alone = [ids((await collect(engine, request(f"a{i}", prompt(i, 6 + i), 8, adapter=n)))[0])
                 for i, n in enumerate(names)]
        _OPENS = []
        together = await asyncio.gather(*(collect(engine, request(f"m{i}", prompt(i, 6 + i), 8, adapter=n))
                                          for i, n in enumerate(names)))
        opened, _OPENS = _OPENS, None
        assert [ids(t) for t, _ in together] == alone
        assert opened == []
        _OPENS = []
        open(__file__).close()  # the hook does see a file read
        assert _OPENS and _OPENS[0][0] == __file__
    finally:
        _OPENS = None
        await engine.stop(grace_s=0)


@pytest.mark.asyncio
async def test_slots_are_counted_by_the_memory_model(tiny, registry, tiny_memory):
    engine = await _engine(tiny, registry[0])
    try:
        slots = engine.adapters.slots
        assert engine.memory.static_bytes == tiny_memory.static_bytes + slots.nbytes
        assert engine.stats().memory.predicted_bytes >= engine.memory.static_bytes
    finally:
        await engine.stop(grace_s=0)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_the_prefix_cache_never_hands_base_blocks_to_an_adapter(tiny, registry):
    p = prompt(3, 40)
    plain = await _engine(tiny, registry[0])
    try:
        want = ids((await collect(plain, request("w", p, 6, adapter="alpha")))[0])
    finally:
        await plain.stop(grace_s=0)
    cached = await _engine(tiny, registry[0], prefix_cache_bytes=50_000_000, prefill_tokens_per_iteration=8,
                          kv_block_tokens=8)
    try:
        await collect(cached, request("b", p, 6))  # stores the base model's blocks of p
        assert ids((await collect(cached, request("x", p, 6, adapter="alpha")))[0]) == want
    finally:
        await cached.stop(grace_s=0)


class _Context:
    def time_remaining(self):
        return None


@pytest.mark.asyncio
async def test_servicer_lists_adapters_and_echoes_the_one_that_served(tiny, registry):
    from prometheus_client import CollectorRegistry

    from keel.common.v1 import common_pb2
    from keel.inference.v1 import inference_pb2
    from services.inference.servicer import InferenceServicer
    from shared.metrics import metrics_for

    engine = await _engine(tiny, registry[0])
    metrics = CollectorRegistry()
    servicer = InferenceServicer(engine, metrics_for("inference", metrics))
    try:
        listed = await servicer.ListAdapters(inference_pb2.ListAdaptersRequest(), None)
        assert listed.base_fingerprint == engine.adapters.base_fingerprint and len(listed.base_fingerprint) == 64
        rows = {(a.id, a.version): a for a in listed.adapters}
        assert (rows[("alpha", "1")].state, rows[("alpha", "1")].slot) == ("accepted", 1)
        assert (rows[("gamma", "1")].state, rows[("gamma", "1")].reason) == ("refused", "BASE_FINGERPRINT_MISMATCH")
        assert rows[("gamma", "1")].slot == 0 and "weights_sha256" in rows[("gamma", "1")].detail
        req = inference_pb2.GenerateRequest(prompt_ids=prompt(2), adapter="beta",
                                            sampling=common_pb2.SamplingParams(max_tokens=3))
        events = [ev async for ev in servicer.Generate(req, _Context())]
        assert events[-1].finished.adapter == "beta@1"
        assert metrics.get_sample_value("keel_inference_adapter_requests_total", {"adapter": "beta@1"}) == 1
        assert metrics.get_sample_value("keel_inference_adapter_tokens_total", {"adapter": "beta@1"}) == 3
    finally:
        await engine.stop(grace_s=0)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_an_adapter_that_is_not_a_string_is_invalid(tiny, registry):
    from shared.errors import InvalidInput
    engine = await _engine(tiny, registry[0])
    try:
        with pytest.raises(InvalidInput) as exc:
            await collect(engine, request("r", prompt(1), 2, adapter=7))
        assert exc.value.reason == "INVALID_ADAPTER_NAME"
    finally:
        await engine.stop(grace_s=0)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_variant_switch_moves_base_requests_but_not_adapter_requests(tiny, registry):
    """An adapter was checked against the primary format at start: a request naming it stays there
    (same tokens as before the switch), while a base request moves to the active variant."""
    cfg, check_prompts = registry
    engine = await _engine(tiny, cfg, variants={"fallback": "int8"})
    try:
        p, steps = list(check_prompts.prompts[0]), check_prompts.continuation_tokens
        before, _ = await collect(engine, request("r1", p, steps, adapter="alpha"))
        await engine.set_variant("fallback", "test")
        after, fin = await collect(engine, request("r2", p, steps, adapter="alpha"))
        assert (fin.variant, fin.format, fin.adapter) == ("primary", "float32", "alpha@1")
        assert ids(after) == ids(before)
        _, base_fin = await collect(engine, request("r3", p, 4))
        assert (base_fin.variant, base_fin.format) == ("fallback", "int8")
    finally:
        await engine.stop(grace_s=0)
