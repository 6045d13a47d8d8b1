"""Model variants on the tiny model: preloaded at warm-up, switched between steps by the loop thread;
new requests start on the active variant, requests already running finish on theirs."""
from __future__ import annotations

import asyncio
import sys

import pytest

from services.inference import config as inference_config
from services.inference.engine.api import TokenEvent
from services.inference.engine.breaker import BreakerConfig
from services.inference.engine.core import Engine
from services.inference.engine.memory import static_bytes
from services.inference.engine.variants import Switch
from services.inference.model.loader import convert_model
from shared.config import ConfigError
from shared.errors import InvalidInput, NotReady
from tests.inference.faults import FaultSpec, inject
from tests.inference.helpers import collect, ids, prompt, request, tiny_config

VARIANTS = {"fallback": "int8"}


@pytest.fixture(scope="module")
def tiny_int8(tiny):
    return convert_model(tiny, "int8")


@pytest.mark.asyncio
async def test_after_a_switch_new_requests_run_on_the_variant_with_its_tokens(make_engine, tiny_int8):
    engine = await make_engine(variants=VARIANTS)
    int8_alone = await make_engine(model=tiny_int8, format="int8")
    before, fin = await collect(engine, request("a", prompt(1), max_tokens=12))
    assert (fin.variant, fin.format) == ("primary", "float32")

    assert await engine.set_variant("fallback", "test") == Switch("fallback", "primary")
    after, fin = await collect(engine, request("b", prompt(1), max_tokens=12))
    assert (fin.variant, fin.format) == ("fallback", "int8")
    reference, _ = await collect(int8_alone, request("c", prompt(1), max_tokens=12))
    assert ids(after) == ids(reference)
    assert engine.active_variant() == "fallback" and engine.stats().active_variant == "fallback"


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_request_running_during_the_switch_finishes_on_its_variant_with_the_same_tokens(make_engine):
    engine = await make_engine(variants=VARIANTS)
    faults = inject(engine)
    faults["alone"] = faults["old"] = FaultSpec(slow_step_ms=50)  # two seconds of steps: the switch lands while it runs
    alone, _ = await collect(engine, request("alone", prompt(2), max_tokens=40))

    order: list[tuple[str, object]] = []

    async def run(rid: str, stream):
        async for item in stream:
            order.append((rid, item))

    running = asyncio.create_task(run("old", engine.generate(request("old", prompt(2), max_tokens=40))))
    while not order:  # its first token is out: the row exists on the primary runner
        await asyncio.sleep(0.005)
    await engine.set_variant("fallback", "test")
    await run("new", engine.generate(request("new", prompt(3), max_tokens=4)))
    await running

    old = [e for rid, e in order if rid == "old"]
    new = [e for rid, e in order if rid == "new"]
    assert (old[-1].variant, old[-1].format) == ("primary", "float32")
    assert [e.token_id for e in old if isinstance(e, TokenEvent)] == ids(alone)
    assert (new[-1].variant, new[-1].format) == ("fallback", "int8")
    # the new request ran to its end while the old one was still running: they overlapped
    assert order.index(("new", new[-1])) < order.index(("old", old[-1]))


@pytest.mark.asyncio
async def test_setting_the_active_variant_again_changes_nothing_and_switching_back_restores_primary(make_engine):
    engine = await make_engine(variants=VARIANTS)
    assert await engine.set_variant("primary", "test") == Switch("primary", "primary")
    assert await engine.set_variant("fallback", "test") == Switch("fallback", "primary")
    assert await engine.set_variant("fallback", "test") == Switch("fallback", "fallback")
    assert engine.active_variant() == "fallback"
    assert await engine.set_variant("primary", "test") == Switch("primary", "fallback")
    _, fin = await collect(engine, request("a", prompt(4), max_tokens=3))
    assert (fin.variant, fin.format) == ("primary", "float32")


@pytest.mark.asyncio
async def test_an_unknown_variant_is_refused_with_its_reason_and_changes_nothing(make_engine):
    engine = await make_engine(variants=VARIANTS)
    with pytest.raises(InvalidInput) as err:
        await engine.set_variant("int4-small", "test")
    assert err.value.reason == "UNKNOWN_VARIANT" and "fallback" in str(err.value)
    assert engine.active_variant() == "primary"


@pytest.mark.asyncio
async def test_variants_are_listed_by_name_with_their_format(make_engine):
    engine = await make_engine(variants={"fallback": "int8", "small": "bfloat16"})
    assert dict(engine.variants) == {"primary": "float32", "fallback": "int8", "small": "bfloat16"}


@pytest.mark.asyncio
async def test_a_switch_and_generation_on_the_variant_open_no_file(make_engine):
    engine = await make_engine(variants=VARIANTS)
    static = engine.memory.static_bytes
    opened: list = []
    watching = [True]

    def hook(event, args):
        if watching[0] and event == "open":
            opened.append(args[0])

    sys.addaudithook(hook)  # hooks cannot be removed: this one stops recording at the end of the test
    try:
        await engine.set_variant("fallback", "test")
        _, fin = await collect(engine, request("a", prompt(5), max_tokens=6))
        await engine.set_variant("primary", "test")
        await collect(engine, request("b", prompt(5), max_tokens=6))
    finally:
        watching[0] = False
    assert fin.format == "int8" and opened == []
    assert engine.memory.static_bytes == static


@pytest.mark.slow
def test_the_memory_model_counts_each_preloaded_format_once(tiny, tiny_int8):
    bf16 = convert_model(tiny, "bfloat16")
    plain = Engine(tiny, tiny_config())
    plain.warmup()
    shared = Engine(tiny, tiny_config(variants={"fallback": "int8", "cheap": "bfloat16"},
                                      breaker=BreakerConfig(fallback_format="bfloat16")))
    shared.warmup()
    assert plain.memory.static_bytes == static_bytes(tiny)
    assert shared.memory.static_bytes == static_bytes(tiny) + static_bytes(tiny_int8) + static_bytes(bf16)
    # admission predicts against the static bytes of every preloaded variant
    assert shared.stats().memory.predicted_bytes == shared.memory.static_bytes


@pytest.mark.asyncio
async def test_breaker_level_two_overrides_the_variant_format_and_keeps_the_variant_name(make_engine):
    from tests.inference.test_breaker import FAST_TRIP, trip
    engine = await make_engine(variants=VARIANTS, breaker=FAST_TRIP)
    await engine.set_variant("fallback", "test")
    trip(engine, 2)
    _, fin = await collect(engine, request("a", prompt(6), max_tokens=3))
    assert (fin.variant, fin.format, fin.breaker_level) == ("fallback", "bfloat16", 2)


@pytest.mark.parametrize("name", ["primary", "Bad Name", ""])
def test_a_bad_variant_name_is_a_config_error(name):
    with pytest.raises(ConfigError, match=f"field 'engine.variants' breaks rule 'pattern'.*'{name}'"):
        inference_config.load(environ={"KEEL_INFERENCE_ENGINE__VARIANTS": f"{{'{name}': int8}}"})


@pytest.mark.asyncio
async def test_a_stopped_engine_refuses_a_switch(make_engine):
    engine = await make_engine(variants=VARIANTS)
    await engine.stop(grace_s=0)
    with pytest.raises(NotReady):
        await engine.set_variant("fallback", "test")


@pytest.mark.parametrize("bad", [{"prefix_cache_bytes": 400_000_000},
                                 {"prefix_cache_bytes": 10**6, "prefill_tokens_per_iteration": 24,
                                  "kv_block_tokens": 16}])
def test_the_rules_between_engine_settings_are_still_checked_next_to_the_variants(bad):
    with pytest.raises(InvalidInput) as err:
        tiny_config(variants=VARIANTS, **bad)
    assert err.value.reason == "INVALID_CONFIG"
