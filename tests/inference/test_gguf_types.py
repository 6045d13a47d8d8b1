"""keel::gguf_mm on every ggml block type it computes (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q4_K, Q5_K, Q6_K): each path gives the bits of a pure-torch emulation of its summation order over
gguf-py's dequantization (the reference), close to float64, batch invariant; other types refused."""
from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch

from services.inference.model.kernels import MM_TYPES, load
from tests.inference.test_gguf_kernel import activations, assert_batch_invariant, dequant, emulate

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernel")

T = gguf.GGMLQuantizationType
# Byte offsets of each type's fp16 scales inside its block (the rest of a block is any bytes).
HALVES = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q4_K: (0, 2),
          T.Q5_K: (0, 2), T.Q6_K: (208,)}


@pytest.fixture(scope="module")
def k():
    return load()


def random_weights(t: int, n: int, K: int, seed: int) -> torch.Tensor:
    """[n, K/E*bytes] uint8 of valid blocks of type t: random quants, scales of a realistic size
    (the mins of Q4_1/Q5_1 negative, as the quantizer makes them)."""
    g = np.random.default_rng(seed)
    if t in (T.F32, T.F16, T.BF16):
        v = (g.standard_normal((n, K)) * 0.05).astype(np.float32)
        if t == T.F32:
            return torch.from_numpy(v.view(np.uint8).copy())
        if t == T.F16:
            return torch.from_numpy(v.astype(np.float16).view(np.uint8).copy())
        return torch.from_numpy((v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).copy())
    elems, size = gguf.GGML_QUANT_SIZES[T(t)]
    nb = K // elems
    blocks = g.integers(0, 256, size=(n, nb, size), dtype=np.uint8)
    for i, off in enumerate(HALVES[T(t)]):
        h = (g.random((n, nb)) * 0.02 + 1e-4) * (-1 if i == 1 and t in (T.Q4_1, T.Q5_1) else 1)
        blocks[:, :, off:off + 2] = h.astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    return torch.from_numpy(blocks.reshape(n, nb * size))


def cases():
    for t in MM_TYPES:
        for n, K in ((37, 512), (5, 256)):
            yield f"{T(t).name} {n}x{K}", random_weights(t, n, K, seed=n + t), t, n, K


def test_the_kernel_computes_the_types_ggml_files_use():
    assert {T(t).name for t in MM_TYPES} == {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                                             "Q4_K", "Q5_K", "Q6_K"}


@pytest.mark.slow
def test_every_path_gives_the_emulated_bits(k):
    for label, w, t, n, K in cases():
        W = dequant(w, t)
        assert W.shape == (n, K), label
        for M in (1, 5):
            x = activations(M, K, seed=M)
            expected = emulate(x, W)
            for isa in k.isas:
                assert torch.equal(k.matmul(x, w, t, n, isa), expected), f"{label} M={M} {isa}"


@pytest.mark.slow
def test_close_to_float64(k):
    for label, w, t, n, K in cases():
        W = dequant(w, t).double()
        x = activations(3, K)
        err = ((k.matmul(x, w, t, n).double() - x.double() @ W.T).abs() / (x.double().abs() @ W.abs().T)).max()
        assert err < 1e-6, f"{label}: error {err:.3g} of sum |x w|"


@pytest.mark.slow
def test_batch_invariant_on_the_superblock_types(k):
    for t in (T.Q4_K, T.Q5_K, T.Q6_K, T.BF16):
        w = random_weights(t, 24, 512, seed=3)
        for isa in k.isas:
            assert_batch_invariant(lambda x: k.matmul(x, w, t, 24, isa), 512, f"{T(t).name} {isa}",
                                   batches=(1, 2, 3, 5, 9, 17))


def test_types_it_does_not_compute_are_refused_by_name(k):
    x = activations(2, 256)
    for t in (T.Q2_K, T.Q3_K, T.IQ4_NL):
        assert t not in MM_TYPES
        with pytest.raises(RuntimeError, match=f"unsupported ggml_type {int(t)} .*Q6_K"):
            k.matmul(x, torch.zeros(4, 256, dtype=torch.uint8), int(t), 4)


def test_superblock_types_need_whole_superblocks(k):
    w = random_weights(T.Q4_K, 4, 256, seed=1)
    with pytest.raises(RuntimeError, match="K = 288 is not a multiple of Q4_K's block of 256"):
        k.matmul(activations(1, 288), w, int(T.Q4_K), 4)
    with pytest.raises(RuntimeError, match=r"w must be \[4, 288\] \(144 bytes per 256\)"):
        k.matmul(activations(1, 512), w, int(T.Q4_K), 4)
