"""keel::gguf_q8_mm on Q4_0, Q5_0 and Q5_1 (the types llama.cpp's quantizer writes where a K-quant
does not fit a row): every path gives the bits of a torch emulation of its order, whose quants and
scales reproduce gguf-py's dequantization exactly; the x16 layout round-trips; batch invariance."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from services.inference.model import blocks
from services.inference.model.kernels import Q8_ISAS, load
from tests.inference.gguf_fixtures import dequantize_rows, unpack_x16
from tests.inference.test_gguf_kernel import activations, assert_batch_invariant, dequant, fma32
from tests.inference.test_gguf_q8_kernel import quantize
from tests.inference.test_gguf_types import random_weights

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernel")

Q4_0, Q5_0, Q5_1 = 2, 6, 7
LAYOUT = {Q4_0: (18, 0, None, 8), Q5_0: (22, 0, 2, 16), Q5_1: (24, 2, 4, 0)}  # bytes, m at, qh at, offset
TYPES = tuple(LAYOUT)


@pytest.fixture(scope="module")
def k():
    return load()


def decode(w: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """File-order blocks -> (q - offset [N, K] int64, d [N, K/32], m [N, K/32] or None), from ggml's layout."""
    size, m_at, qh_at, off = LAYOUT[t]
    b = w.numpy().reshape(w.shape[0], -1, size)
    qs = b[..., -16:].astype(np.int64)
    q = np.concatenate([qs & 15, qs >> 4], -1)
    if qh_at is not None:
        qh = b[..., qh_at:qh_at + 4].copy().view(np.uint32).astype(np.int64)  # [N, nb, 1]
        q |= ((qh >> np.arange(32)) & 1) << 4
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
    m = None if not m_at else torch.from_numpy(b[..., m_at:m_at + 2].copy().view(np.float16).astype(np.float32)[..., 0])
    return torch.from_numpy((q - off).reshape(w.shape[0], -1)), torch.from_numpy(d), m


def emulate(x: torch.Tensor, w: torch.Tensor, t: int) -> torch.Tensor:
    q, dw, mw = decode(w, t)
    qx, dx, sx = quantize(x)
    n, nb = q.shape[0], qx.shape[1]
    isum = torch.einsum("mbj,nbj->mnb", qx, q.view(n, nb, 32)).float()
    acc = torch.zeros(x.shape[0], n)
    for i in range(nb):
        acc = fma32(dw[None, :, i] * dx[:, None, i], isum[:, :, i], acc)
        if mw is not None:
            acc = fma32(mw[None, :, i].expand_as(acc), sx[:, None, i].expand_as(acc), acc)
    return acc


def cases():
    for t in TYPES:
        for n, K in ((37, 512), (16, 96), (3, 32)):
            yield f"{t} {n}x{K}", random_weights(t, n, K, seed=n + t), t, n, K


def test_the_decode_is_ggmls_dequantization():
    for label, w, t, n, K in cases():
        q, d, m = decode(w, t)
        W = d.repeat_interleave(32, 1) * q.float()
        if m is not None:
            W = W + m.repeat_interleave(32, 1)
        assert torch.equal(W, dequant(w, t)), label
        assert torch.equal(dequantize_rows(w, t), W), label  # the embedding's lookup


def test_x16_round_trips():
    for label, w, t, n, K in cases():
        packed = blocks.pack_x16(w, t)
        rows = torch.arange(n)
        assert torch.equal(unpack_x16(packed, rows, t), w), label


@pytest.mark.slow
def test_every_isa_path_gives_the_emulations_bits(k):
    for label, w, t, n, K in cases():
        packed = blocks.pack_x16(w, t)
        for M in (1, 3, 6):
            x = activations(M, K, seed=M)
            expected = emulate(x, w, t)
            for isa in k.q8_isas:
                assert torch.equal(k.matmul_q8(x, packed, t, n, isa), expected), f"{label} M={M} {isa}"


@pytest.mark.slow
def test_batch_invariance(k):
    for t in TYPES:
        w = blocks.pack_x16(random_weights(t, 40, 256, seed=t), t)
        for isa in k.q8_isas:
            assert_batch_invariant(lambda x: k.matmul_q8(x, w, t, 40, isa), 256, f"{t} {isa}", batches=(1, 2, 3, 5, 17))


@pytest.mark.parametrize("threads", [1, 2])
def test_one_call_for_several_weights_gives_each_weights_own_bits(k, threads):
    """keel::gguf_q8_mm_many (a layer's q, k, v of mixed types in one region) against a call per weight,
    on every path; widths that end inside a group, and one of none."""
    parts = [(Q5_0, 40), (Q4_0, 17), (Q5_1, 0), (Q5_0, 96)]
    ws = [blocks.pack_x16(random_weights(t, n, 256, seed=n + t), t) if n else
          torch.zeros(0, 256 // 32 * 16 * LAYOUT[t][0], dtype=torch.uint8) for t, n in parts]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for M in (1, 3, 6):
            x = activations(M, 256, seed=M)
            for isa in k.q8_isas:
                got = torch.ops.keel.gguf_q8_mm_many(x, ws, [t for t, _ in parts], [n for _, n in parts],
                                                     Q8_ISAS.index(isa))
                for (t, n), w, y in zip(parts, ws, got):
                    assert torch.equal(y, k.matmul_q8(x, w, t, n, isa)), f"{t} n={n} M={M} {isa}"
    finally:
        torch.set_num_threads(before)
