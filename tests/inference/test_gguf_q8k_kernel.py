"""keel::gguf_q8k_mm, the integer matmul over x16k-regrouped K-quant super-blocks (Q4_K, Q5_K, Q6_K)
with 8-bit activations: the same bits as a pure-torch emulation of its quantization and summation
order on every ISA path (the emulation's quants and scales checked against gguf-py's dequantization),
batch invariance, NaN reaching the outputs, accuracy, and clear errors on bad input."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from services.inference.model.kernels import K_TYPES, Q8_ISAS, load
from services.inference.model.superblocks import pack_x16k
from tests.inference.test_gguf_kernel import activations, assert_batch_invariant, dequant, fma32
from tests.inference.test_gguf_q8_kernel import quantize
from tests.inference.test_gguf_types import random_weights

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernel")

Q4_K, Q5_K, Q6_K = 12, 13, 14
BYTES = {Q4_K: 144, Q5_K: 176, Q6_K: 210}
SHAPES = ((37, 512), (5, 256), (16, 768))


@pytest.fixture(scope="module")
def k():
    return load()


def decode(w: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """File-order super-blocks -> (q [N, K] int64, dw, mw): Q4_K/Q5_K unsigned quants with dw = d * sc and
    mw = dmin * m per 32 elements [N, K/32]; Q6_K signed quants (q - 32) with dw = d * scale per 16
    [N, K/16] and mw None. Written from ggml's layouts, independently of the kernel and the packer."""
    b = w.numpy().reshape(w.shape[0], -1, BYTES[t])
    n, s = b.shape[:2]
    if t == Q6_K:
        ql, qh = b[..., :128].reshape(n, s, 2, 64), b[..., 128:192].reshape(n, s, 2, 32)
        q = np.empty((n, s, 2, 4, 32), np.int64)
        for rr in range(4):
            lo = (ql[..., 32 * (rr % 2):32 * (rr % 2) + 32] >> (4 * (rr // 2))) & 15
            q[:, :, :, rr] = lo | ((qh >> (2 * rr)) & 3) << 4
        d = b[..., 208:210].copy().view(np.float16).astype(np.float32)
        dw = d * b[..., 192:208].view(np.int8).astype(np.float32)
        return torch.from_numpy(q.reshape(n, -1) - 32), torch.from_numpy(dw.reshape(n, -1)), None
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
    dmin = b[..., 2:4].copy().view(np.float16).astype(np.float32)
    sc = b[..., 4:16]
    scale = np.concatenate([sc[..., 0:4] & 63, (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4)], -1)
    mins = np.concatenate([sc[..., 4:8] & 63, (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)], -1)
    qs = b[..., -128:].reshape(n, s, 4, 32)
    q = np.stack([qs & 15, qs >> 4], 3).reshape(n, s, 8, 32).astype(np.int64)
    if t == Q5_K:
        qh = b[..., 16:48]
        q |= np.stack([(qh >> i) & 1 for i in range(8)], 2).astype(np.int64) << 4
    return (torch.from_numpy(q.reshape(n, -1)), torch.from_numpy((d * scale).reshape(n, -1)),
            torch.from_numpy((dmin * mins).reshape(n, -1)))


def emulate(x: torch.Tensor, w: torch.Tensor, t: int) -> torch.Tensor:
    """The kernel's order in torch: per 32-block b (Q6_K: per 16 elements) an exact integer dot product,
    then acc = fma(dw * dx, isum, acc) and (Q4_K, Q5_K) acc = fma(-mw, sx, acc), in order."""
    q, dw, mw = decode(w, t)
    qx, dx, sx = quantize(x, fp16_scale=False)    # [M, K/32, 32], [M, K/32]
    n, nb = q.shape[0], qx.shape[1]
    acc = torch.zeros(x.shape[0], n)
    if t == Q6_K:
        isum = torch.einsum("mbj,nbj->mnb", qx.reshape(x.shape[0], 2 * nb, 16), q.view(n, 2 * nb, 16)).float()
        for i in range(2 * nb):
            acc = fma32(dw[None, :, i] * dx[:, None, i // 2], isum[:, :, i], acc)
        return acc
    isum = torch.einsum("mbj,nbj->mnb", qx, q.view(n, nb, 32)).float()
    for i in range(nb):
        acc = fma32(dw[None, :, i] * dx[:, None, i], isum[:, :, i], acc)
        acc = fma32((-mw[None, :, i]).expand_as(acc), sx[:, None, i].expand_as(acc), acc)
    return acc


def cases():
    for t in K_TYPES:
        for n, K in SHAPES:
            yield f"{t} {n}x{K}", random_weights(t, n, K, seed=n + t), t, n, K


def test_the_decode_is_ggmls_dequantization():
    """The emulation's quants and scales give gguf-py's reference weights exactly."""
    for label, w, t, n, K in cases():
        q, dw, mw = decode(w, t)
        per = 16 if t == Q6_K else 32
        W = dw.repeat_interleave(per, 1) * q.float()
        if mw is not None:
            W = W - mw.repeat_interleave(32, 1)
        assert torch.equal(W, dequant(w, t)), label


def test_packing_keeps_every_row_and_pads_the_last_group():
    w = random_weights(Q6_K, 21, 512, seed=1)
    packed = pack_x16k(w, Q6_K)
    assert packed.shape == (2, 2 * 3360) and packed.dtype == torch.uint8
    assert not packed[1].view(2, 3360)[:, 32 + 256:].reshape(-1, 16, 4)[:, 5:].any()  # rows 21..31: zero quants


@pytest.mark.slow
def test_every_isa_path_gives_the_emulations_bits(k):
    assert set(k.q8_isas) <= set(Q8_ISAS) and "portable" in k.q8_isas
    for label, w, t, n, K in cases():
        packed = pack_x16k(w, t)
        for M in (1, 3, 6):
            x = activations(M, K, seed=M)
            expected = emulate(x, w, t)
            for isa in k.q8_isas:
                assert torch.equal(k.matmul_q8k(x, packed, t, n, isa), expected), f"{label} M={M} {isa}"


@pytest.mark.slow
def test_close_to_the_float_weights(k):
    for label, w, t, n, K in cases():
        W = dequant(w, t).double()
        x = activations(4, K)
        err = (k.matmul_q8k(x, pack_x16k(w, t), t, n).double() - x.double() @ W.T).abs()
        assert (err / (x.double().abs() @ W.abs().T)).max() < 0.02, label  # 8-bit activations


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
def test_batch_invariance(k, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for t in K_TYPES:
            w = pack_x16k(random_weights(t, 40, 512, seed=t), t)
            for isa in k.q8_isas:
                assert_batch_invariant(lambda x: k.matmul_q8k(x, w, t, 40, isa), 512, f"{t} {isa}",
                                       batches=(1, 2, 3, 4, 5, 9, 17))
    finally:
        torch.set_num_threads(before)


def test_a_non_finite_activation_reaches_its_rows_outputs_only(k):
    w = random_weights(Q4_K, 16, 256, seed=2)
    x = activations(2, 256)
    x[1, 7] = float("nan")
    y = k.matmul_q8k(x, pack_x16k(w, Q4_K), Q4_K, 16)
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()


def test_errors_are_clear(k):
    w = pack_x16k(random_weights(Q4_K, 8, 256, seed=3), Q4_K)
    x = activations(2, 256)
    for args, message in (((x, w, 3, 8), "unsupported ggml_type 3"),
                          ((activations(2, 288), w, Q4_K, 8), "not a multiple of the super-block of 256"),
                          ((x, w, Q6_K, 8), r"w must be \[1, 3360\]"),
                          ((x, w, Q4_K, 17), r"w must be \[2, 2368\]")):
        with pytest.raises(RuntimeError, match=message):
            k.matmul_q8k(*args)
    with pytest.raises(ValueError, match="unknown isa 'sse'"):
        k.matmul_q8k(x, w, Q4_K, 8, "sse")
