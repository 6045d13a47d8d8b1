"""Every GGUF weight type people download, made by llama.cpp's own quantizer (testing/quantized.py) from
the wide tiny llama (hidden 256: the K-quants fit), served by the gguf and gguf_f32 formats end to end:

* gguf_f32's logits equal the float32 model of the same file (gguf-py's dequantization) to float rounding;
* gguf's greedy tokens agree with llama.cpp's on the same file, step by step along llama.cpp's tokens;
* a row alone and the same row in a batch give the same bits, on both formats;
* a type Keel does not compute (llama.cpp's Q3_K_M mixes Q3_K, Q4_K and Q5_K) is refused at load,
  naming a tensor of that type.
"""
from __future__ import annotations

import dataclasses
import shutil

import gguf
import pytest
import torch

from services.inference.model import blocks
from services.inference.model.forward import LlamaRunner, Segment
from services.inference.model.loader import load_model
from shared import ggufmeta
from shared.errors import InvalidInput
from testing import quantized
from tests.inference.test_architectures import OTHER, _prompt, engine_greedy, llamacpp_greedy

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernel")

T = gguf.GGMLQuantizationType
# What llama.cpp's quantizer writes for the wide tiny llama (its 2D tensors): the mixes are the files'.
MIXES = {"F32": {"F32"}, "F16": {"F16"}, "BF16": {"BF16"}, "Q8_0": {"Q8_0"}, "Q4_0": {"Q4_0", "Q6_K"},
         "Q4_1": {"Q4_1", "Q6_K"}, "Q5_0": {"Q5_0", "Q6_K"}, "Q5_1": {"Q5_1", "Q6_K"},
         "Q4_K_M": {"Q4_K", "Q6_K"}, "Q5_K_M": {"Q5_K", "Q6_K"}, "Q6_K": {"Q6_K"}}
# Measured (2-core host, llama-cpp-python 0.3.36), 2 prompts x 32 steps teacher-forced on llama.cpp's
# tokens: gguf 64 F32, 63 F16, 58 BF16, 64 Q8_0, 64 Q4_0, 60 Q4_1, 62 Q5_0, 63 Q5_1, 50 Q4_K_M, 50 Q5_K_M,
# 54 Q6_K of 64; gguf_f32 51, 49, 55 on the K-quant files. llama.cpp rounds the activations too (to bf16
# against BF16 weights, to Q8_K superblocks against the K-quants, which Keel's kernel quantizes per
# 32-block), and this random model's logits have many near-ties, so "most steps", not every one.
AGREEMENT = 0.7


def _types(path, tensor: str | None = None) -> set[str]:
    """The block types of the file's matrices (or of the one named), from its header: gguf-py's reader
    would parse the 49k-token vocabulary too, seconds per file."""
    return {gguf.GGMLQuantizationType(t.ggml_type).name for name, t in ggufmeta.read(path).tensors.items()
            if (len(t.shape) == 2 if tensor is None else name == tensor)}


@pytest.mark.parametrize("ftype", quantized.SERVED)
def test_llama_cpp_writes_the_mix_the_type_names(ftype):
    assert _types(quantized.tiny(ftype)) == MIXES[ftype]


@pytest.mark.parametrize("ftype", quantized.SERVED)
def test_gguf_f32_logits_are_the_dequantized_models(ftype):
    path = quantized.tiny(ftype)
    x = torch.tensor([_prompt(3)])
    with torch.inference_mode():
        want = load_model(path, "float32")(x).logits
        got = load_model(path, blocks.EXACT_FORMAT)(x).logits
    assert ((got - want).norm() / want.norm()).item() < 2e-5


@pytest.mark.parametrize("ftype", quantized.SERVED)
def test_gguf_agrees_with_llama_cpp_step_by_step(ftype):
    path = quantized.tiny(ftype)
    model = load_model(path, blocks.FORMAT)
    agree = total = 0
    for seed in (1, 2):
        prompt = _prompt(seed)
        ref = llamacpp_greedy(path, prompt)
        assert len(set(ref)) > 1, "degenerate decoding: the test would prove nothing"
        agree += sum(a == b for a, b in zip(engine_greedy(model, prompt, forced=ref), ref))
        total += len(ref)
    assert agree / total >= AGREEMENT, f"{agree}/{total}"


def _steps(runner: LlamaRunner, prompt: list[int], batch: bool) -> list[torch.Tensor]:
    """The row's logits after its prefill and two decode steps, alone or beside another row."""
    mine = runner.new_cache(len(prompt) + 2)
    other = runner.new_cache(len(OTHER) + 2) if batch else None
    feed, out = [Segment(mine, prompt)], []
    if batch:
        feed.append(Segment(other, OTHER))
    with torch.inference_mode():
        for step in range(3):
            logits = runner.forward(feed)
            out.append(logits[0].clone())
            feed = [Segment(mine, [int(logits[0].argmax())])]
            if batch:
                feed.append(Segment(other, [int(logits[1].argmax())]))
    return out


@pytest.mark.parametrize("fmt", blocks.FORMATS)
@pytest.mark.parametrize("ftype", quantized.SERVED)
def test_a_row_alone_and_in_a_batch_gives_the_same_bits(ftype, fmt):
    runner = LlamaRunner(load_model(quantized.tiny(ftype), fmt), block_tokens=16, pool_tokens=512)
    prompt = _prompt(4)
    for alone, batched in zip(_steps(runner, prompt, False), _steps(runner, prompt, True)):
        assert torch.equal(alone, batched)


@pytest.mark.parametrize("fmt", blocks.FORMATS)
def test_a_type_keel_does_not_compute_is_refused_naming_the_tensor(fmt):
    path = quantized.tiny("Q3_K_M")
    assert "Q3_K" in _types(path)
    with pytest.raises(InvalidInput) as err:
        load_model(path, fmt)
    e = err.value
    assert e.reason == "UNSUPPORTED_BLOCK_TYPE" and "Q3_K" in e.metadata["types"].split(",")
    tensor = e.metadata["tensors"].split(",")[e.metadata["types"].split(",").index("Q3_K")]
    assert f"{tensor} is Q3_K" in str(e) and fmt in str(e)
    assert _types(path, tensor) == {"Q3_K"}


@pytest.mark.parametrize("fmt", blocks.FORMATS)
@pytest.mark.parametrize("ftype", ["Q6_K", "Q8_0", "F16"])
def test_the_composed_layer_calls_give_the_op_by_op_bits(ftype, fmt):
    """kernels/layer.cpp picks each weight's kernel from its type as blocks.layout does (x16k, x16, rows)."""
    model = load_model(quantized.tiny(ftype), fmt)
    composed = LlamaRunner(model, block_tokens=16, pool_tokens=512)
    assert all(layer.blocks is not None for layer in composed.layers)
    op_by_op = LlamaRunner(model, block_tokens=16, pool_tokens=512)
    op_by_op.layers = [dataclasses.replace(layer, blocks=None) for layer in op_by_op.layers]
    prompt = _prompt(5)
    for a, b in zip(_steps(composed, prompt, True), _steps(op_by_op, prompt, True)):
        assert torch.equal(a, b)
