"""Every architecture Keel implements (llama.ARCHITECTURES) decodes what transformers and llama.cpp decode.

The tiny models of testing/tinymodels.py (a GGUF and a transformers folder of the same weights):
Keel's greedy tokens over 32 steps, from its whole-sequence `forward` and from the engine's cached
pass (forward.py: the prompt in two chunks, then decode steps batched with another row), equal
transformers' (float32, the folder) and llama.cpp's (the GGUF, raw token ids, no BOS added).
F32 GGUFs: equal on every step. Q8_0 / Q4_1 GGUFs: Keel's gguf_f32 format (float32 activations on
the blocks) equals transformers on the dequantized weights on every step; Keel's gguf format and
llama.cpp both quantize the activations to 8 bits, so they are compared step by step along
llama.cpp's tokens (teacher-forced); see Q8_AGREEMENT for what they reach.
llama.cpp has no "mistral" architecture (its converter writes Mistral as "llama", dropping the
sliding window), so the windowed mistral model is compared with transformers only.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from services.inference.model import ggufmodel, llama
from services.inference.model.forward import LlamaRunner, Segment
from services.inference.model.loader import load_model
from shared.errors import InvalidInput
from testing.tinymodels import SPECS, tiny_model_files, write_foreign_gguf

STEPS = 32
ARCHS = tuple(SPECS)
CPP_ARCHS = tuple(a for a in ARCHS if a != "mistral")


def _prompt(seed: int, n: int = 20) -> list[int]:
    return torch.randint(100, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPT, OTHER = _prompt(1), _prompt(2, 13)


def forward_greedy(model, prompt: list[int], steps: int = STEPS) -> list[int]:
    """Argmax decoding by whole-sequence passes (Keel's llama.forward or transformers')."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def engine_greedy(model, prompt: list[int], forced: list[int] | None = None, steps: int = STEPS) -> list[int]:
    """Argmax decoding through forward.py's runner: the prompt in two chunks, then one decode step per
    token, in a batch with another row (OTHER) decoding its own tokens. `forced`: feed these tokens
    instead of the argmax (teacher forcing); the argmaxes are returned either way."""
    runner = LlamaRunner(model, block_tokens=16, pool_tokens=512)
    mine, other = runner.new_cache(len(prompt) + steps), runner.new_cache(len(OTHER) + steps)
    cut = len(prompt) * 3 // 5
    runner.forward([Segment(mine, prompt[:cut])])
    logits = runner.forward([Segment(mine, prompt[cut:]), Segment(other, OTHER)])
    out, other_next = [], int(logits[1].argmax())
    for step in range(steps):
        out.append(int(logits[0].argmax()))
        if step + 1 == steps:
            break
        feed = out[-1] if forced is None else forced[step]
        logits = runner.forward([Segment(other, [other_next]), Segment(mine, [feed])]).flip(0)
        other_next = int(logits[1].argmax())
    return out


def llamacpp_greedy(path, prompt: list[int], steps: int = STEPS) -> list[int]:
    import llama_cpp

    # F32 KV cache (type 0): llama.cpp's default F16 cache rounds the keys and values.
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=2, seed=0, verbose=False, logits_all=False,
                          type_k=0, type_v=0)
    vocab, out = llm.n_vocab(), []
    llm.reset()
    llm.eval(list(prompt))  # raw ids: no BOS prepended
    for _ in range(steps):
        out.append(int(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,)).argmax()))
        llm.eval([out[-1]])
    llm.close()
    return out


@pytest.fixture(scope="module")
def transformers_greedy():
    from transformers import AutoModelForCausalLM

    cache = {}

    def run(files) -> list[int]:
        if files.hf not in cache:
            # bandit B615 does not apply: a local directory.
            model = AutoModelForCausalLM.from_pretrained(str(files.hf), dtype=torch.float32).eval()  # nosec B615
            cache[files.hf] = forward_greedy(model, PROMPT)
        return cache[files.hf]
    return run


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_keel_equals_transformers_and_llamacpp_on_every_step(arch, transformers_greedy):
    files = tiny_model_files(arch, "F32")
    reference = transformers_greedy(files)
    assert len(set(reference)) > 1, "degenerate decoding: the test would prove nothing"
    from_gguf = load_model(files.gguf)
    assert from_gguf.config.model_type == files.config.model_type
    assert forward_greedy(from_gguf, PROMPT) == reference
    assert engine_greedy(from_gguf, PROMPT) == reference
    assert forward_greedy(load_model(files.hf), PROMPT) == reference
    if arch in CPP_ARCHS:
        assert llamacpp_greedy(files.gguf, PROMPT) == reference


@pytest.mark.parametrize("arch", ARCHS)
def test_the_config_read_from_the_gguf_is_the_folders(arch):
    files = tiny_model_files(arch, "F32")
    from_gguf, _ = ggufmodel.read(files.gguf)
    from_json = load_model(files.hf).config
    same = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta", "tie_word_embeddings",
            "model_type", "attention_bias", "qk_norm", "sliding_window")
    assert {f: getattr(from_gguf, f) for f in same} == {f: getattr(from_json, f) for f in same}
    assert from_gguf.rms_norm_eps == pytest.approx(from_json.rms_norm_eps)
    if arch == "llama3":  # llama.cpp's converter writes the llama3 scaling as per-frequency divisors
        assert from_gguf.rope_scaling["rope_type"] == "freq_factors" and from_json.rope_scaling["rope_type"] == "llama3"
        torch.testing.assert_close(llama.inverse_frequencies(from_gguf), llama.inverse_frequencies(from_json))


@pytest.mark.parametrize("arch,change", [("mistral", "window"), ("llama3", "rope")])
def test_the_window_and_the_rope_scaling_change_the_tokens(arch, change, transformers_greedy):
    """Without these the models would decode something else: the parity above does test them."""
    files = tiny_model_files(arch, "F32")
    model = load_model(files.gguf)
    if change == "window":
        for layer in model.model.layers:
            layer.self_attn.window = None
    else:
        config = load_model(files.hf).config
        config.rope_scaling = None
        model.model.rotary_emb.inv_freq = llama.inverse_frequencies(config)
    assert forward_greedy(model, PROMPT) != transformers_greedy(files)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("arch", ARCHS)
def test_blocks_with_float32_activations_equal_transformers_on_the_dequantized_weights(arch, qtype,
                                                                                     transformers_greedy):
    files = tiny_model_files(arch, qtype)
    reference = transformers_greedy(files)
    assert len(set(reference)) > 1
    model = load_model(files.gguf, "gguf_f32")
    assert engine_greedy(model, PROMPT) == reference
    assert forward_greedy(load_model(files.gguf), PROMPT) == reference  # float32, dequantized from the GGUF


# Measured (2-core host, llama-cpp-python 0.3.36), 4 prompts x 32 steps: the gguf format agrees with
# llama.cpp on 128/128/128/128 steps (llama, llama3, qwen2, qwen3), gguf_f32 on 117/112/109/117. Its
# activation blocks are ggml's block_q8_0 (fp16 scale, id = 127 / max|x|; q8act.h), so the final
# logits differ from llama.cpp's by ~1e-6 (the float sums' order), where the fp32 scale Keel had
# before differed by up to 0.25 and agreed on 120-123. Issue 39 asks for >= 99%.
Q8_AGREEMENT = 0.99


@pytest.mark.slow
@pytest.mark.parametrize("arch", CPP_ARCHS)
def test_q8_0_keel_gguf_agrees_with_llamacpp_step_by_step(arch):
    """Both quantize the activations to 8 bits per 32-value block, so a near-tie among the 49152
    logits may break differently: compared along llama.cpp's tokens, step by step (teacher-forced).
    The 8-bit format must agree at least as often as float32 activations on the same blocks do."""
    files = tiny_model_files(arch, "Q8_0")
    q8, exact = load_model(files.gguf, "gguf"), load_model(files.gguf, "gguf_f32")
    agree = {"gguf": 0, "gguf_f32": 0}
    total = 0
    for seed in range(1, 5):
        prompt = _prompt(seed)
        ref = llamacpp_greedy(files.gguf, prompt)
        assert len(set(ref)) > 1
        for name, model in (("gguf", q8), ("gguf_f32", exact)):
            agree[name] += sum(a == b for a, b in zip(engine_greedy(model, prompt, forced=ref), ref))
        total += len(ref)
    assert agree["gguf"] / total >= Q8_AGREEMENT, f"{agree}/{total}"
    assert agree["gguf"] >= agree["gguf_f32"], f"{agree}/{total}"


@pytest.mark.slow
@pytest.mark.parametrize("arch", CPP_ARCHS)
def test_q8_0_keel_gguf_logits_are_llamacpps_to_float_rounding(arch):
    """The same 8-bit activation blocks as ggml's block_q8_0 (q8act.h): the last position's logits
    after a prompt equal llama.cpp's up to the float sums' order (measured <= 2e-6 at a std of 4; an
    fp32 activation scale gave up to 0.25)."""
    import llama_cpp

    files = tiny_model_files(arch, "Q8_0")
    llm = llama_cpp.Llama(model_path=str(files.gguf), n_ctx=128, n_threads=2, seed=0, verbose=False,
                          type_k=0, type_v=0)
    runner = LlamaRunner(load_model(files.gguf, "gguf"), block_tokens=16, pool_tokens=512)
    try:
        for prompt in (PROMPT[:1], PROMPT):
            llm.reset()
            llm.eval(list(prompt))
            want = torch.from_numpy(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),)).copy())
            with torch.inference_mode():
                got = runner.forward([Segment(runner.new_cache(len(prompt)), prompt)])[0].float()
            assert (got - want).abs().max() < 1e-4 * want.std(), (arch, len(prompt))
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ["gpt2", "falcon"])
@pytest.mark.parametrize("fmt", ["float32", "gguf"])
def test_an_architecture_keel_does_not_implement_is_refused_in_one_line(arch, fmt, tmp_path):
    path = write_foreign_gguf(tmp_path / f"{arch}.gguf", arch)
    with pytest.raises(InvalidInput) as e:
        load_model(path, fmt)
    message = str(e.value)
    assert e.value.reason == "UNSUPPORTED_MODEL" and "\n" not in message
    assert f"'{arch}'" in message and "llama, mistral, qwen2, qwen3" in message
