"""The ragged forward pass agrees with the model's whole pass and is batch invariant; model loading checks
input. (The model itself against transformers: test_llama.py.)"""
from __future__ import annotations

import pytest
import torch

from services.inference.model.forward import LlamaRunner, Segment
from services.inference.model.loader import convert_model, load_model
from shared.errors import InvalidInput
from testing.tiny import tiny_model
from tests.inference.helpers import prompt, read_cache


def test_prefill_logits_match_the_whole_pass(tiny):
    runner = LlamaRunner(tiny)
    ids = prompt(1, 40)
    with torch.no_grad():
        ref = tiny(torch.tensor([ids])).logits[0, -1]
    got = runner.prefill(ids, runner.new_cache(41))
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_decode_is_bitwise_batch_invariant(tiny):
    runner = LlamaRunner(tiny)
    assert runner.calibrate_invariant_sizes(16)
    prompts = [prompt(s, 3 + 4 * s) for s in range(7)]

    def run(batch):
        caches = [runner.new_cache(len(p) + 6) for p in batch]
        cur = [int(runner.prefill(p, c).argmax()) for p, c in zip(batch, caches)]
        steps = []
        for _ in range(5):
            logits = runner.decode(cur, caches)
            steps.append(logits)
            cur = logits.argmax(-1).tolist()
        return steps

    together = run(prompts)
    for i, p in enumerate(prompts):
        alone = run([p])
        assert all(torch.equal(a[0], t[i]) for a, t in zip(alone, together)), f"row {i} differs"


def test_prefill_mixed_with_decode_rows_is_bitwise_the_same(tiny):
    runner = LlamaRunner(tiny)
    runner.calibrate_invariant_sizes(16)
    old, new = prompt(1, 9), prompt(2, 23)
    c_old, c_new = runner.new_cache(20), runner.new_cache(30)
    first = int(runner.prefill(old, c_old).argmax())
    mixed = runner.forward([Segment(c_old, [first]), Segment(c_new, new)])
    s_old, s_new = runner.new_cache(20), runner.new_cache(30)
    runner.prefill(old, s_old)
    assert torch.equal(mixed[0], runner.decode([first], [s_old])[0])
    assert torch.equal(mixed[1], runner.prefill(new, s_new))
    assert (c_old.length, c_new.length) == (10, 23)


def chunked_prefill(runner: LlamaRunner, ids: list[int], chunk: int):
    cache = runner.new_cache(len(ids) + 4)
    for i in range(0, len(ids), chunk):
        logits = runner.forward([Segment(cache, ids[i:i + chunk])])[0]
    return logits, cache


def test_chunked_prefill_is_reproducible_and_close_to_a_whole_one(tiny):
    """What holds: the first layer's keys and values are bitwise those of a whole prefill (row-wise
    projections); later layers may differ in the last bits, as the host's SDPA kernels decide (the
    chunk's attention is a masked SDPA over the cached prefix, a different summation order from one
    causal SDPA), so the logits differ by ~1e-5, the greedy token is the same, and the same chunking
    always gives the same bits."""
    runner = LlamaRunner(tiny)
    runner.calibrate_invariant_sizes(16)
    ids = prompt(3, 300)
    whole_cache = runner.new_cache(304)
    whole = runner.prefill(ids, whole_cache)
    chunked, cache = chunked_prefill(runner, ids, 64)
    again, _ = chunked_prefill(runner, ids, 64)
    assert cache.length == 300 and torch.equal(chunked, again)
    assert torch.equal(read_cache(cache, 0, 300)[0][0], read_cache(whole_cache, 0, 300)[0][0])
    assert int(chunked.argmax()) == int(whole.argmax())
    assert (chunked - whole).abs().max() < 1e-4


def test_poisoned_row_does_not_touch_the_others(tiny):
    runner = LlamaRunner(tiny)
    runner.calibrate_invariant_sizes(16)
    prompts = [prompt(s) for s in range(4)]
    caches = [runner.new_cache(20) for _ in prompts]
    first = [int(runner.prefill(p, c).argmax()) for p, c in zip(prompts, caches)]
    clean_caches = [runner.new_cache(20) for _ in prompts]
    for p, c in zip(prompts, clean_caches):
        runner.prefill(p, c)
    def nan_row_2(_module, _args, out):
        out = out.clone()
        out[2] = float("nan")  # one token per decode row: row 2's hidden state
        return out

    handle = tiny.model.embed_tokens.register_forward_hook(nan_row_2)
    try:
        poisoned = runner.decode(first, caches)
    finally:
        handle.remove()
    clean = runner.decode(first, clean_caches)
    assert not torch.isfinite(poisoned[2]).any()
    for i in (0, 1, 3):
        assert torch.equal(poisoned[i], clean[i])


def test_bf16_conversion_keeps_the_original(tiny):
    bf16 = convert_model(tiny, "bfloat16")
    assert bf16.format == "bfloat16" and tiny.format == "float32"
    runner = LlamaRunner(bf16)
    assert runner.kv_bytes_per_token == LlamaRunner(tiny).kv_bytes_per_token // 2


@pytest.mark.parametrize("fmt,min_cosine", [("bfloat16", 0.99), ("float16", 0.99), ("int8", 0.9)])
def test_reduced_precision_logits_track_fp32(tiny, fmt, min_cosine):
    """On random weights int8's per-tensor error is large; a broken conversion would be uncorrelated."""
    fp32, low = LlamaRunner(tiny), LlamaRunner(convert_model(tiny, fmt))
    for seed in range(8):
        ids = prompt(seed, 20)
        a, b = fp32.prefill(ids, fp32.new_cache(20)), low.prefill(ids, low.new_cache(20))
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) > min_cosine
        assert int((a > a[b.argmax()]).sum()) < 50  # its top token is near the top of fp32's


def test_int8_model_cannot_be_converted_back(tiny):
    with pytest.raises(InvalidInput) as e:
        convert_model(convert_model(tiny, "int8"), "float32")
    assert e.value.reason == "UNSUPPORTED_FORMAT"


@pytest.mark.parametrize("fmt,device,reason", [("fp8", "cpu", "UNKNOWN_FORMAT"), ("int2", "cpu", "UNKNOWN_FORMAT"),
                                                 ("int8-dynamic", "cpu", "UNKNOWN_FORMAT"),
                                                 ("int8", "cuda", "UNSUPPORTED_FORMAT")])
def test_load_model_rejects_bad_format(fmt, device, reason, tmp_path):
    with pytest.raises(InvalidInput) as e:
        load_model(tmp_path, fmt, device)
    assert e.value.reason == reason


def test_load_model_reports_a_missing_model(tmp_path):
    with pytest.raises(InvalidInput) as e:
        load_model(tmp_path / "nothing")
    assert e.value.reason == "MODEL_NOT_FOUND"


def test_tiny_model_is_small_deterministic_and_full_vocab():
    a, b, c = tiny_model(seed=3), tiny_model(seed=3), tiny_model(seed=4)
    assert a.config.vocab_size == 49152 and a.config.num_hidden_layers == 2
    assert torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert not a.training
