"""keel::gguf_rows (kernels/gguf_mm.cpp), the block formats' embedding lookup: for every type the
kernels compute, the looked-up rows equal the reference's dequantization of the file-order blocks bit
for bit, read from the file's row order or (Q4_0..Q8_0) from blocks.pack_x16's layout, in any order
and with repeats; BlockEmbedding gives them in the ids' shape; malformed calls raise, naming the op."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from services.inference.model import blocks, kernels
from tests.inference.gguf_fixtures import dequantize_rows
from tests.inference.test_gguf_types import random_weights


@pytest.fixture(scope="module", autouse=True)
def library():
    kernels.load()


IDS = torch.tensor([0, 36, 5, 17, 5, 16, 15, 1])  # across x16 groups, repeated, out of order


@pytest.mark.parametrize("t", kernels.MM_TYPES, ids=lambda t: T(t).name)
def test_rows_are_the_references_dequantization_in_every_layout(t):
    K = 512 if t in kernels.K_TYPES else 96
    w = random_weights(t, 37, K, seed=t)
    want = dequantize_rows(w[IDS], t)
    assert torch.equal(torch.ops.keel.gguf_rows(w, IDS, t, False), want)
    if t in kernels.SUPPORTED_TYPES:
        assert torch.equal(torch.ops.keel.gguf_rows(blocks.pack_x16(w, t), IDS, t, True), want)


@pytest.mark.parametrize("x16", [False, True])
def test_block_embedding_looks_up_in_the_ids_shape(x16):
    w = random_weights(T.Q8_0, 37, 64, seed=1)
    emb = blocks.BlockEmbedding(blocks.pack_x16(w, T.Q8_0) if x16 else w, T.Q8_0, 64, x16)
    ids = IDS.reshape(2, 4)
    assert torch.equal(emb(ids), dequantize_rows(w[IDS], T.Q8_0).reshape(2, 4, 64))


@pytest.mark.parametrize("call, message", [
    (lambda w: torch.ops.keel.gguf_rows(w, torch.tensor([37]), T.Q8_0, False), "outside"),
    (lambda w: torch.ops.keel.gguf_rows(blocks.pack_x16(w, T.Q8_0), torch.tensor([48]), T.Q8_0, True), "outside"),
    (lambda w: torch.ops.keel.gguf_rows(w, torch.tensor([0]), T.Q4_K, True), "no x16 layout"),
    (lambda w: torch.ops.keel.gguf_rows(w, torch.tensor([0]), T.Q2_K, False), "unsupported"),
    (lambda w: torch.ops.keel.gguf_rows(w[:, :30].contiguous(), torch.tensor([0]), T.Q8_0, False), "whole"),
    (lambda w: torch.ops.keel.gguf_rows(w, torch.tensor([0], dtype=torch.int32), T.Q8_0, False), "ids"),
])
def test_malformed_calls_raise_naming_the_op(call, message):
    with pytest.raises(RuntimeError, match=message) as info:
        call(random_weights(T.Q8_0, 37, 64, seed=2))
    assert "keel::gguf_rows" in str(info.value)
