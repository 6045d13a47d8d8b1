"""keel::gguf_mm, the CPU matmul over GGUF Q4_1 / Q8_0 blocks: accuracy against float64, the same bits
on every ISA path, batch invariance (any M, any row position, 1 or 2 threads), bit-exact agreement
with a pure-torch emulation of its summation order, and clear errors on bad input."""
from __future__ import annotations

import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from services.inference.model.kernels import BLOCK, ISAS, SUPPORTED_TYPES, load
from shared.config import ROOT_DIR
from shared.modelfile import shipped_gguf

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernel")

Q4_1, Q8_0 = 3, 8
BATCHES = (*range(1, 18), 33, 64)


@pytest.fixture(scope="module")
def k():
    return load()


def random_blocks(ggml_type: int, n: int, K: int, seed: int = 0) -> torch.Tensor:
    """[n, K/32*bytes] uint8 of valid blocks: fp16 scales of a realistic size, random quants."""
    g = np.random.default_rng(seed)
    nb, bb = K // BLOCK, SUPPORTED_TYPES[ggml_type].block_bytes
    blocks = g.integers(0, 256, size=(n, nb, bb), dtype=np.uint8)
    d = (g.random((n, nb)) * 0.02 + 1e-4).astype(np.float16)
    blocks[:, :, 0:2] = d.view(np.uint8).reshape(n, nb, 2)
    if ggml_type == Q4_1:
        m = (-8 * d.astype(np.float32) * g.random((n, nb))).astype(np.float16)
        blocks[:, :, 2:4] = m.view(np.uint8).reshape(n, nb, 2)
    return torch.from_numpy(blocks.reshape(n, nb * bb))


def dequant(w: torch.Tensor, ggml_type: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(w.numpy(), ggml_type))


@pytest.fixture(scope="module")
def real():
    """name -> (blocks [N, K/32*bytes] uint8, ggml type, dequantized [N, K] float32) from the model file."""
    reader = gguf.GGUFReader(shipped_gguf())
    out = {}
    for t in reader.tensors:
        if t.name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"):
            w = torch.from_numpy(np.array(t.data))
            out[t.name] = (w, int(t.tensor_type), dequant(w, int(t.tensor_type)))
    assert sorted(out) == ["blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"]
    assert out["token_embd.weight"][1] == Q8_0 and out["blk.0.attn_q.weight"][1] == Q4_1
    return out


def cases(real):
    """(label, blocks, type, dequantized) for random blocks of both types and the model's tensors."""
    for t, (n, K) in ((Q4_1, (72, 576)), (Q4_1, (19, 1536)), (Q8_0, (45, 576)), (Q8_0, (3, 32))):
        w = random_blocks(t, n, K, seed=n)
        yield f"random {SUPPORTED_TYPES[t].name} {n}x{K}", w, t, dequant(w, t)
    for name, (w, t, W) in real.items():
        yield name, w, t, W


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The fp32 fused multiply-add fl(a*b + c), exactly: float64 holds a*b exactly; p + c is formed
    in float64 rounded to odd (TwoSum gives the rounding error; a nonzero error on an even result
    moves it to its odd neighbour toward the exact sum), which makes the final rounding to fp32
    the correctly rounded one (53 >= 2*24 + 2 bits)."""
    p, c = a.double() * b.double(), c.double()
    s = p + c
    bv = s - p
    err = (p - (s - bv)) + (c - bv)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.inf, -torch.inf).double()
    return torch.where((err != 0) & even, torch.nextafter(s, toward), s).float()


def emulate(x: torch.Tensor, W: torch.Tensor, fma=fma32) -> torch.Tensor:
    """The kernel's order in torch: 16 lanes per output, lane l takes elements l then l+16 of each
    block with an fma, block after block; then lanes l + l+8, + l+4, + l+2, + l+1."""
    M, K = x.shape
    N = W.shape[0]
    xb = x.reshape(M, 1, K // BLOCK, 2, 16).expand(M, N, -1, -1, -1)
    wb = W.reshape(1, N, K // BLOCK, 2, 16).expand(M, N, -1, -1, -1)
    acc = torch.zeros(M, N, 16)
    for b in range(K // BLOCK):
        for h in range(2):
            acc = fma(xb[:, :, b, h], wb[:, :, b, h], acc)
    for width in (8, 4, 2, 1):
        acc = acc[..., :width] + acc[..., width:2 * width]
    return acc[..., 0]


def activations(M: int, K: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(M, K, generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow
def test_close_to_float64_reference(k, real):
    for label, w, t, W in cases(real):
        x = activations(5, W.shape[1])
        ref = x.double() @ W.double().T
        scale = x.double().abs() @ W.double().abs().T  # the size of the terms summed
        y = k.matmul(x, w, t, W.shape[0])
        assert y.dtype == torch.float32 and y.shape == ref.shape, label
        err = ((y.double() - ref).abs() / scale.clamp(min=1e-30)).max().item()
        assert err < 1e-6, f"{label}: error {err:.3g} of sum |x w|"


@pytest.mark.slow
def test_every_isa_path_gives_the_same_bits(k, real):
    assert k.isa == k.isas[0] and "portable" in k.isas and set(k.isas) <= set(ISAS)
    for label, w, t, W in cases(real):
        for M in (1, 3, 6):
            x = activations(M, W.shape[1], seed=M)
            outs = {isa: k.matmul(x, w, t, W.shape[0], isa) for isa in k.isas}
            for isa, y in outs.items():
                assert torch.equal(y, outs["portable"]), f"{label} M={M}: {isa} differs from portable"


def assert_batch_invariant(mm, K, label, batches=BATCHES):
    """mm(x [M, K]) -> [M, n] gives every row the bits it gets alone, for each M in `batches`."""
    x = activations(max(batches), K, seed=7)
    alone = torch.cat([mm(x[i:i + 1]) for i in range(len(x))])
    for M in batches:
        for start in (0, len(x) - M):  # the same rows at the front and at the back of the input
            y = mm(x[start:start + M].contiguous())
            assert torch.equal(y, alone[start:start + M]), f"{label}: M={M} rows {start}.. differ from alone"


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
def test_batch_invariance(k, real, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for label, w, t, W in cases(real):
            n, K = W.shape
            # The portable path is slow (libm fma); on the 49152-row head the fast paths cover it.
            isas = k.isas if n < 10000 else [i for i in k.isas if i != "portable"]
            for isa in isas:
                assert_batch_invariant(lambda x: k.matmul(x, w, t, n, isa), K, f"{label} {isa}")
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_pure_torch_emulation_gives_the_same_bits(k, real):
    for label, w, t, W in cases(real):
        x = activations(3, W.shape[1], seed=3)
        assert torch.equal(k.matmul(x, w, t, W.shape[0]), emulate(x, W)), label


def test_emulation_tells_orders_apart(k):
    """The bit-exact comparison has teeth: unfused multiply-add, or the whole dot product summed
    another way, gives different bits on the same blocks."""
    w = random_blocks(Q4_1, 64, 1536, seed=5)
    W = dequant(w, Q4_1)
    x = activations(4, 1536, seed=5)
    y = k.matmul(x, w, Q4_1, 64)
    assert torch.equal(y, emulate(x, W))
    assert not torch.equal(y, emulate(x, W, fma=lambda a, b, c: c + a * b))
    assert not torch.equal(y, x @ W.T)


def test_errors_are_clear(k):
    w = random_blocks(Q4_1, 8, 64)
    x = activations(2, 64)
    bad = [
        ((x.double(), w, Q4_1, 8), "x must be float32"),
        ((x, w.to(torch.int8), Q4_1, 8), "w must be uint8"),
        ((activations(2, 128)[:, ::2], w, Q4_1, 8), "not contiguous"),
        ((x[0], w, Q4_1, 8), r"\[M, K\]"),
        ((activations(2, 48), w, Q4_1, 8), "not a multiple of the block size"),
        ((x, w[:, :20].contiguous(), Q4_1, 8), r"w must be \[8, 40\]"),
        ((x, w, Q4_1, 9), r"w must be \[9, 40\]"),
        ((x, w, Q8_0, 8), r"Q8_0 .* w must be \[8, 68\]"),
        ((x, w, 10, 8), "unsupported ggml_type 10"),
    ]
    for args, message in bad:
        with pytest.raises(RuntimeError, match=message):
            k.matmul(*args)
    with pytest.raises(RuntimeError, match="unknown isa 7"):
        torch.ops.keel.gguf_mm(x, w, Q4_1, 8, 7)
    for isa in set(ISAS) - set(k.isas):
        with pytest.raises(RuntimeError, match=f"cannot run the {isa} path"):
            k.matmul(x, w, Q4_1, 8, isa)
    with pytest.raises(ValueError, match="unknown isa 'sse'"):
        k.matmul(x, w, Q4_1, 8, "sse")
    assert k.matmul(x[:0], w, Q4_1, 8).shape == (0, 8)
    assert torch.equal(k.matmul(torch.ones(2, 0), torch.ones(8, 0, dtype=torch.uint8), Q4_1, 8), torch.zeros(2, 8))


@pytest.mark.slow
def test_a_later_process_loads_the_cached_build_quickly(k):
    code = ("import time, torch; from services.inference.model.kernels import load; t = time.perf_counter(); "
            "k = load(); print(time.perf_counter() - t, k.path)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT_DIR, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    seconds, path = out.stdout.split()
    assert path == str(k.path) and float(seconds) < 1.0
