"""The LoRA term in the forward pass: PEFT's unmerged outputs, and batch invariance with mixed adapters."""
from __future__ import annotations

import random

import pytest
import torch

from services.inference.model.forward import LlamaRunner, Segment
from testing.lora import load_slots, make_adapter, peft_logits
from tests.inference.helpers import clone_cache, prompt

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGET_SETS = (ALL, ("q_proj", "v_proj"), ("o_proj", "down_proj", "up_proj"), ("k_proj", "gate_proj"))


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return [make_adapter(tiny, root / f"a{i}", seed=i, rank=4 + 4 * (i % 2), targets=t)
            for i, t in enumerate(TARGET_SETS)]


@pytest.fixture(scope="module")
def runner(tiny, adapters):
    r = LlamaRunner(tiny)
    r.calibrate_invariant_sizes(16)
    r.lora = load_slots(tiny, adapters)
    return r


def test_matches_peft_unmerged_forward_at_every_position(tiny, runner, adapters):
    ids = prompt(3, 10)
    for slot, folder in enumerate(adapters, start=1):
        ref = peft_logits(tiny, folder, ids)
        cache = runner.new_cache(16)
        got = runner.forward([Segment(cache, ids[:6], slot)])[0]
        torch.testing.assert_close(got, ref[5], rtol=1e-4, atol=1e-4)
        for pos in range(6, 10):  # decode steps reuse the adapted keys and values in the cache
            got = runner.forward([Segment(cache, [ids[pos]], slot)])[0]
            torch.testing.assert_close(got, ref[pos], rtol=1e-4, atol=1e-4)
        assert not torch.allclose(ref[-1], runner.forward([Segment(runner.new_cache(16), ids)])[0], atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_alone_equals_the_same_row_in_a_mixed_batch_of_16(runner, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rng = random.Random(threads)
        slots = [i % 5 for i in range(16)]  # 4 adapters and the base, interleaved
        rng.shuffle(slots)
        caches = [runner.new_cache(40) for _ in slots]
        tokens = [int(runner.forward([Segment(c, prompt(i, 5 + i), s)])[0].argmax()) for i, (c, s) in
                  enumerate(zip(caches, slots))]
        same = compared = 0
        for _ in range(13):
            alone = [runner.forward([Segment(clone_cache(c), [t], s)])[0] for c, t, s in zip(caches, tokens, slots)]
            batch = runner.forward([Segment(c, [t], s) for c, t, s in zip(caches, tokens, slots)])
            same += sum(torch.equal(a, b) for a, b in zip(alone, batch))
            compared += len(slots)
            tokens = [int(row.argmax()) for row in batch]
        assert compared >= 200 and same == compared
    finally:
        torch.set_num_threads(old)


def test_a_prefill_chunk_with_an_adapter_is_the_same_beside_decoding_rows(runner):
    ids = prompt(7, 20)
    alone = runner.forward([Segment(runner.new_cache(32), ids, 2)])
    others = [runner.new_cache(32) for _ in range(5)]
    for i, c in enumerate(others):
        runner.forward([Segment(c, prompt(10 + i, 4), i % 5)])
    mixed = runner.forward([Segment(c, [5 + i], i % 5) for i, c in enumerate(others)]
                           + [Segment(runner.new_cache(32), ids, 2)])
    assert torch.equal(alone[0], mixed[-1])


def test_base_rows_are_untouched_by_adapter_rows_in_their_batch(tiny, runner):
    plain = LlamaRunner(tiny)
    plain.invariant_sizes = runner.invariant_sizes
    ids = prompt(4, 9)
    want = plain.forward([Segment(plain.new_cache(16), ids)])[0]
    got = runner.forward([Segment(runner.new_cache(16), prompt(5, 9), 1), Segment(runner.new_cache(16), ids, 0),
                          Segment(runner.new_cache(16), prompt(6, 3), 3)])[1]
    assert torch.equal(want, got)


def test_slot_stacks_are_counted_in_bytes(runner):
    lora = runner.lora
    assert lora.count == 5
    assert lora.nbytes == sum(a.nbytes + b.nbytes for a, b in lora.stacks.values()) + lora.scaling.nbytes
    assert lora.nbytes > 0 and lora.transient_bytes > 0


def test_an_adapter_gives_the_same_bits_whatever_else_is_loaded(tiny, adapters, runner):
    """Ranks 4 and 8 on the same projections: a row never pays for another adapter's rank."""
    ids = prompt(8, 12)
    alone = LlamaRunner(tiny)
    alone.invariant_sizes = runner.invariant_sizes
    for slot, folder in enumerate(adapters, start=1):
        alone.lora = load_slots(tiny, [folder])
        want = alone.forward([Segment(alone.new_cache(16), ids, 1)])[0]
        assert torch.equal(want, runner.forward([Segment(runner.new_cache(16), ids, slot)])[0])


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "gguf"])
def test_adapters_on_other_weight_formats_stay_batch_invariant(tiny, adapters, fmt, tmp_path):
    """gguf: unmerged beside the quantized blocks, the LoRA term added to the fused projections' parts."""
    from services.inference.model.loader import convert_model, load_model
    from tests.inference.gguf_fixtures import write_tiny_gguf
    model = load_model(write_tiny_gguf(tiny, tmp_path), "gguf") if fmt == "gguf" else convert_model(tiny, fmt)
    r = LlamaRunner(model)
    r.calibrate_invariant_sizes(16)
    r.lora = load_slots(model, adapters)
    slots = [i % 5 for i in range(16)]
    caches = [r.new_cache(16) for _ in slots]
    r.forward([Segment(c, prompt(i, 4), s) for i, (c, s) in enumerate(zip(caches, slots))])
    alone = [r.forward([Segment(clone_cache(c), [7], s)])[0] for c, s in zip(caches, slots)]
    batch = r.forward([Segment(c, [7], s) for c, s in zip(caches, slots)])
    assert all(torch.equal(a, b) for a, b in zip(alone, batch))
    same_prompt = [r.forward([Segment(r.new_cache(8), prompt(0, 4), s)])[0] for s in (0, 1)]
    assert not torch.equal(*same_prompt)  # the adapter changes this format's output
