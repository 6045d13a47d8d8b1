"""keel::gguf_q8_mm, the matmul over x16-interleaved GGUF blocks with 8-bit activations: the same bits
as a pure-torch emulation of its quantization and summation order on every ISA path, batch invariance
(any M, any row position, 1 or 2 threads), NaN reaching the outputs, accuracy, the x16 layout's round
trip, and clear errors on bad input."""
from __future__ import annotations

import shutil

import pytest
import torch

from services.inference.model import blocks
from services.inference.model.kernels import BLOCK, Q8_ISAS, SUPPORTED_TYPES, load
from tests.inference.gguf_fixtures import unpack_x16
from tests.inference.test_gguf_kernel import (  # noqa: F401
    Q4_1,
    Q8_0,
    activations,
    assert_batch_invariant,
    dequant,
    fma32,
    random_blocks,
    real,
)

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernel")

BATCHES = (*range(1, 18), 33)


@pytest.fixture(scope="module")
def k():
    return load()


def quantize(x: torch.Tensor, fp16_scale: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's activation blocks: q [M, K/32, 32] int64, dx and sx [M, K/32] float32.
    fp16_scale (gguf_q8_mm, q8act.h's Scale::ggml): ggml's block_q8_0 / q8_1, d = max|x| / 127,
    q = round(x * (127 / max|x|)), dx = h(d), sx = h(d * sum q), and q = 0 where dx is 0; h(v) is
    fp16(v), or v where fp16 cannot hold it. Otherwise (gguf_q8k_mm, Scale::fp32): dx = d,
    q = round(x * (1 / dx)), sx = dx * sum q."""
    xb = x.view(x.shape[0], -1, BLOCK)
    finite = torch.isfinite(xb).all(-1)
    amax = xb.abs().amax(-1)
    d = torch.where(finite, amax / 127.0, torch.nan)
    def h(v: torch.Tensor) -> torch.Tensor:
        return torch.where(v.abs() < 65520, v.half().float(), v)
    if fp16_scale:
        dx = h(d)
        inv = torch.where(finite & (dx != 0), 127.0 / amax, torch.zeros(()))
    else:
        dx = d
        inv = torch.where(finite & (dx != 0), 1.0 / dx, torch.zeros(()))
    q = torch.where(finite[..., None], torch.round(xb * inv[..., None]).clamp(-127, 127), 0).to(torch.int64)
    sx = d * q.sum(-1).float()
    return q, dx, h(sx) if fp16_scale else sx


def emulate(x: torch.Tensor, w: torch.Tensor, ggml_type: int, fp16_scale: bool = True) -> torch.Tensor:
    """The kernel's order in torch on file-order blocks w [N, K/32 * B]: per block an exact integer dot
    product, then acc = fma(dw * dx, isum, acc) and (Q4_1) acc = fma(mw, sx, acc), block after block."""
    n, nb = w.shape[0], x.shape[1] // BLOCK
    b = w.view(n, nb, SUPPORTED_TYPES[ggml_type].block_bytes)
    dw = b[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
    if ggml_type == Q4_1:
        mw = b[..., 2:4].contiguous().view(torch.float16).float()[..., 0]
        qs = b[..., 4:].to(torch.int64)
        qw = torch.cat((qs & 15, qs >> 4), -1)
    else:
        qw = b[..., 2:].contiguous().view(torch.int8).to(torch.int64)
    q, dx, sx = quantize(x, fp16_scale)
    isum = torch.einsum("mbj,nbj->mnb", q, qw).float()  # exact: |isum| < 2^24
    acc = torch.zeros(x.shape[0], n)
    for i in range(nb):
        acc = fma32(dw[None, :, i] * dx[:, None, i], isum[:, :, i], acc)
        if ggml_type == Q4_1:
            acc = fma32(mw[None, :, i].expand_as(acc), sx[:, None, i].expand_as(acc), acc)
    return acc


def cases(real):
    """(label, file-order blocks, type) for random blocks (row counts off the groups of 16 too) and the model's."""
    for t, (n, K) in ((Q4_1, (72, 576)), (Q4_1, (19, 1536)), (Q8_0, (45, 576)), (Q8_0, (3, 32))):
        yield f"random {SUPPORTED_TYPES[t].name} {n}x{K}", random_blocks(t, n, K, seed=n), t
    for name, (w, t, _) in real.items():
        yield name, w, t


def test_x16_packing_round_trips_every_row(real):
    for label, w, t in cases(real):
        packed = blocks.pack_x16(w, t)
        assert packed.shape == (-(-w.shape[0] // 16), w.shape[1] * 16) and packed.nbytes >= w.nbytes, label
        rows = torch.arange(w.shape[0])
        assert torch.equal(unpack_x16(packed, rows, t), w), label
        assert torch.equal(unpack_x16(packed, rows.flip(0)[:5], t), w.flip(0)[:5]), label


@pytest.mark.slow
def test_every_isa_path_gives_the_emulations_bits(k, real):
    assert set(k.q8_isas) <= set(Q8_ISAS) and "portable" in k.q8_isas
    for label, w, t in cases(real):
        n, K = w.shape[0], w.shape[1] // SUPPORTED_TYPES[t].block_bytes * BLOCK
        packed = blocks.pack_x16(w, t)
        x = activations(3, K, seed=3)
        want = emulate(x, w, t) if n < 10000 else None
        outs = {isa: k.matmul_q8(x, packed, t, n, isa) for isa in k.q8_isas if n < 10000 or isa != "portable"}
        for isa, y in outs.items():
            assert torch.equal(y, want if want is not None else outs[k.q8_isas[0]]), f"{label}: {isa}"
        ref = x.double() @ dequant(w, t).double().T
        err = ((outs[k.q8_isas[0]].double() - ref).norm() / ref.norm()).item()
        assert err < 0.02, f"{label}: relative error {err:.3g} (8-bit activations)"


def test_every_path_quantizes_ties_zero_blocks_and_extremes_as_the_emulation(k):
    """Activation blocks that the random ones rarely hold: halves (rounding ties go to even), an
    all-zero block (dx = 0), a block whose max is one tiny value (fp16(d) = 0), one whose fp16 dx is
    subnormal, and one of huge values (d past fp16's range)."""
    K = 5 * BLOCK
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(9))
    x[:, :BLOCK] = torch.tensor([127.0] + [h + 0.5 for h in range(-15, 16)])  # dx = 1: every x * id a tie
    x[0, BLOCK:2 * BLOCK] = 0.0
    x[1, BLOCK:2 * BLOCK] = 0.0
    x[1, BLOCK + 7] = 1e-30
    x[2, 2 * BLOCK:3 * BLOCK] *= 3e37  # d far past fp16's range: kept fp32 (ggml's would be inf)
    x[:, 3 * BLOCK:4 * BLOCK] *= 1e-4  # d ~ 2e-6: a subnormal fp16
    w = random_blocks(Q4_1, 32, K, seed=9)
    q, dx, _ = quantize(x)
    assert (dx[1, 1] == 0 and (q[1, 1] == 0).all() and dx[2, 2] > 1e35 and (dx[:, 3] < 6.1e-5).all()
            and torch.isfinite(dx).all())
    want = emulate(x, w, Q4_1)
    for isa in k.q8_isas:
        assert torch.equal(k.matmul_q8(x, blocks.pack_x16(w, Q4_1), Q4_1, 32, isa), want), isa


def test_the_emulation_tells_orders_apart(k):
    w = random_blocks(Q4_1, 48, 1536, seed=5)
    x = activations(2, 1536, seed=5)
    y = k.matmul_q8(x, blocks.pack_x16(w, Q4_1), Q4_1, 48)
    assert torch.equal(y, emulate(x, w, Q4_1))
    assert not torch.equal(y, x @ dequant(w, Q4_1).T)
    assert not torch.equal(y, emulate(x * (1 + 2 ** -10), w, Q4_1))  # an fp16 scale rounding apart
    assert not torch.equal(y, emulate(x, w, Q4_1, fp16_scale=False))  # fp32 scales (gguf_q8k_mm's)


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
def test_batch_invariance(k, real, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for label, w, t in cases(real):
            n, K = w.shape[0], w.shape[1] // SUPPORTED_TYPES[t].block_bytes * BLOCK
            packed = blocks.pack_x16(w, t)
            for isa in [i for i in k.q8_isas if n < 10000 or i != "portable"]:
                assert_batch_invariant(lambda x: k.matmul_q8(x, packed, t, n, isa), K, f"{label} {isa}", BATCHES)
    finally:
        torch.set_num_threads(before)


def test_a_non_finite_activation_reaches_its_rows_outputs_only(k):
    w = random_blocks(Q4_1, 32, 64, seed=2)
    x = activations(3, 64, seed=2)
    x[1, 40] = torch.nan
    x[2, 3] = torch.inf
    for isa in k.q8_isas:
        y = k.matmul_q8(x, blocks.pack_x16(w, Q4_1), Q4_1, 32, isa)
        assert torch.isfinite(y[0]).all() and torch.isnan(y[1:]).all(), isa


def test_errors_are_clear(k):
    w = blocks.pack_x16(random_blocks(Q4_1, 8, 64), Q4_1)  # [1, 640]
    x = activations(2, 64)
    bad = [
        ((x.double(), w, Q4_1, 8), "x must be float32"),
        ((activations(2, 48), w, Q4_1, 8), "not a multiple of the block size"),
        ((x, w, Q4_1, 17), r"w must be \[2, 640\]"),
        ((x, w, Q8_0, 8), r"w must be \[1, 1088\]"),
        ((x, w, 12, 8), "unsupported ggml_type 12"),
    ]
    for args, message in bad:
        with pytest.raises(RuntimeError, match=message):
            k.matmul_q8(*args)
    with pytest.raises(ValueError, match="unknown isa 'sse'"):
        k.matmul_q8(x, w, Q4_1, 8, "sse")
    assert k.matmul_q8(x[:0], w, Q4_1, 8).shape == (0, 8)
