"""The block formats' composed layer calls (kernels/layer.cpp) against the op-by-op chain that a step
with LoRA terms runs (forward.py): the same bits for the rotated queries, the pool, the attention
output and the layer's output, with 8-bit and float32 activations, with and without decode rows."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.inference.model import blocks, kernels
from tests.inference.test_gguf_kernel import Q4_1, Q8_0, random_blocks
from tests.inference.test_layer_ops import rotary

E, KV, G, D, FF, BT = 128, 2, 2, 64, 256, 16  # a small layer: hidden, KV heads, heads per KV head, head size, MLP
H = KV * G
SIZES = [H * D, KV * D, KV * D]


@pytest.fixture(scope="module", autouse=True)
def library():
    kernels.load()


def weights(q8: bool, seed: int, split: bool = False) -> dict:
    """name -> (blocks as the op takes them, ggml type, output width); the down projection in Q8_0.
    `split`: q, k and v as three weights (v in Q8_0, as llama.cpp's Q4_K_M files mix them) with biases
    (qwen2's), instead of one fused qkv."""
    qkv = {"q": (SIZES[0], E, Q4_1), "k": (SIZES[1], E, Q4_1), "v": (SIZES[2], E, Q8_0)} if split else \
        {"qkv": (sum(SIZES), E, Q4_1)}
    shapes = {**qkv, "o": (E, H * D, Q4_1), "gate_up": (2 * FF, E, Q4_1), "down": (E, FF, Q8_0)}
    out = {}
    for i, (name, (n, k, t)) in enumerate(shapes.items()):
        b = random_blocks(t, n, k, seed + i)
        out[name] = (blocks.pack_x16(b, t) if q8 else b, t, n)
    gen = torch.Generator().manual_seed(seed)
    out["bias"] = [torch.randn(n, generator=gen) for n in SIZES] if split else []
    return out


def qkv_args(w: dict) -> tuple[list, list, list]:
    """keel::layer_attention's qkv, qkv_types and qkv_bias."""
    parts = [w[p] for p in ("q", "k", "v")] if "q" in w else [w["qkv"]]
    return [b for b, _, _ in parts], [t for _, t, _ in parts], w["bias"]


def linear(x: torch.Tensor, w: tuple, q8: bool) -> torch.Tensor:
    b, t, n = w
    return (torch.ops.keel.gguf_q8_mm if q8 else torch.ops.keel.gguf_mm)(x, b, t, n, -1)


class Step:
    """A step of n tokens (of x's N' padded rows) at slots of a pool, the first `decoding` of them decode rows."""

    def __init__(self, n: int, padded: int, decoding: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.n, self.x = n, torch.randn(padded, E, generator=gen) * 2
        self.cos, self.sin = rotary(n, 5)
        self.slots = torch.tensor([3 * BT + 5 + i for i in range(n)])
        self.keys, self.values = torch.randn(KV, 8 * BT, D, generator=gen), torch.randn(KV, 8 * BT, D, generator=gen)
        self.out = torch.zeros(padded, H * D)
        self.rows = torch.arange(decoding)
        self.table = torch.tensor([[1, 2, 3, 4]] * decoding).view(decoding, 4)
        self.lengths = torch.tensor([3 * BT + 6 + i for i in range(decoding)])
        self.norms = torch.randn(E, generator=gen), torch.randn(E, generator=gen)

    def clone(self) -> Step:
        other = object.__new__(Step)
        other.__dict__ = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()}
        other.norms = tuple(t.clone() for t in self.norms)
        return other


def op_by_op(s: Step, w: dict, q8: bool, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """forward.py's chain for one layer (KernelRMSNorm, fused projections split by columns, NO_LORA)."""
    h = torch.ops.keel.rms_norm(s.x, s.norms[0], eps)
    if "q" in w:  # BlockLinear.forward of each projection: the product, then its bias
        q, k, v = (linear(h, w[p], q8) + b for p, b in zip("qkv", w["bias"]))
    else:
        q, k, v = linear(h, w["qkv"], q8).split(SIZES, dim=-1)
    q = torch.ops.keel.rope_store(q[:s.n], k[:s.n], v[:s.n], s.cos, s.sin, s.slots, s.keys, s.values)
    if s.rows.numel():
        torch.ops.keel.decode_attention_(s.out, s.rows, q, s.keys, s.values, s.table, s.lengths, BT, D ** -0.5, -1)
    x = s.x + linear(s.out, w["o"], q8)
    gate, up = linear(torch.ops.keel.rms_norm(x, s.norms[1], eps), w["gate_up"], q8).split([FF, FF], dim=-1)
    return q, x + linear(F.silu(gate) * up, w["down"], q8)


def composed(s: Step, w: dict, q8: bool, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.ops.keel.layer_attention(s.x, s.norms[0], eps, *qkv_args(w), SIZES, q8, s.n, s.cos, s.sin, s.slots,
                                       s.keys, s.values, s.out, s.rows, s.table, s.lengths, BT, D ** -0.5)
    return q, torch.ops.keel.layer_mlp(s.x, s.out, *w["o"], s.norms[1], eps, *w["gate_up"], *w["down"], q8)


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
@pytest.mark.parametrize("q8", [True, False], ids=["q8", "f32"])
@pytest.mark.parametrize("n,padded,decoding", [(3, 4, 3), (1, 1, 1), (5, 8, 0), (4, 4, 2)])
def test_the_composed_calls_give_the_bits_of_the_op_by_op_chain(q8, n, padded, decoding, split):
    w, step = weights(q8, seed=n, split=split), Step(n, padded, decoding, seed=padded)
    ref, got = step.clone(), step.clone()
    want_q, want_x = op_by_op(ref, w, q8, 1e-5)
    got_q, got_x = composed(got, w, q8, 1e-5)
    assert torch.equal(got_q, want_q) and torch.equal(got_x, want_x)
    assert torch.equal(got.keys, ref.keys) and torch.equal(got.values, ref.values) and torch.equal(got.out, ref.out)
    assert not torch.equal(got.keys, step.keys)  # the step wrote its tokens' keys
    assert (got.out[:decoding] != 0).any() == (decoding > 0)  # attention ran for the decode rows only
    assert not torch.equal(got_x, step.x)


def test_a_change_anywhere_in_the_layer_changes_its_output():
    """The comparison above can fail: another eps in the second norm alone gives other bits."""
    w, step = weights(True, seed=1), Step(3, 4, 3, seed=2)
    _, want = op_by_op(step.clone(), w, True, 1e-5)
    s = step.clone()
    torch.ops.keel.layer_attention(s.x, s.norms[0], 1e-5, *qkv_args(w), SIZES, True, s.n, s.cos, s.sin, s.slots,
                                   s.keys, s.values, s.out, s.rows, s.table, s.lengths, BT, D ** -0.5)
    other = torch.ops.keel.layer_mlp(s.x, s.out, *w["o"], s.norms[1], 1e-3, *w["gate_up"], *w["down"], True)
    assert not torch.equal(other, want)


def test_malformed_calls_raise_naming_the_op():
    w, s = weights(True, seed=3), Step(2, 2, 2, seed=4)
    with pytest.raises(RuntimeError, match="keel::layer_attention: sizes"):
        torch.ops.keel.layer_attention(s.x, s.norms[0], 1e-5, *qkv_args(w), SIZES[:2], True, s.n, s.cos, s.sin,
                                       s.slots, s.keys, s.values, s.out, s.rows, s.table, s.lengths, BT, 0.1)
    with pytest.raises(RuntimeError, match="keel::layer_attention: n = 3"):
        torch.ops.keel.layer_attention(s.x, s.norms[0], 1e-5, *qkv_args(w), SIZES, True, 3, s.cos, s.sin,
                                       s.slots, s.keys, s.values, s.out, s.rows, s.table, s.lengths, BT, 0.1)
    with pytest.raises(RuntimeError, match="keel::layer_attention: qkv must be one fused weight or three"):
        torch.ops.keel.layer_attention(s.x, s.norms[0], 1e-5, [w["qkv"][0]] * 2, [Q4_1] * 2, [], SIZES, True, s.n,
                                       s.cos, s.sin, s.slots, s.keys, s.values, s.out, s.rows, s.table, s.lengths,
                                       BT, 0.1)
    with pytest.raises(RuntimeError, match="keel::layer_attention: qkv_bias must be empty or one per weight"):
        torch.ops.keel.layer_attention(s.x, s.norms[0], 1e-5, *qkv_args(w)[:2], [torch.zeros(3)] * 2, SIZES, True,
                                       s.n, s.cos, s.sin, s.slots, s.keys, s.values, s.out, s.rows, s.table,
                                       s.lengths, BT, 0.1)
    with pytest.raises(RuntimeError, match="keel::layer_mlp: gate_up has an odd width"):
        torch.ops.keel.layer_mlp(s.x, s.out, *w["o"], s.norms[1], 1e-5, w["gate_up"][0], Q4_1, 2 * FF - 1,
                                 *w["down"], True)
    with pytest.raises(RuntimeError, match="keel::gguf_q8_mm"):  # a part's own checks still hold
        torch.ops.keel.layer_mlp(s.x, s.out, w["o"][0], Q4_1, E + 16, s.norms[1], 1e-5, *w["gate_up"],
                                 *w["down"], True)
