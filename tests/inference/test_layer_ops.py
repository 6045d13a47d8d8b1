"""Keel's layer ops (kernels/layer_ops.cpp) against their definitions: RMSNorm bit for bit against an
emulation of its fixed order, the rotary embedding and cache write bit for bit against the aten
formula, decode attention close to the aten computation and bitwise independent of its batch-mates,
the table's padding and the thread count; malformed calls raise, naming the op."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from services.inference.model import kernels
from services.inference.model.forward import _rope
from services.inference.model.llama import RMSNorm

KV, G, D, BT = 3, 3, 64, 16  # SmolLM2's KV heads, query heads per KV head, head size; block tokens
H = KV * G


@pytest.fixture(scope="module", autouse=True)
def library():
    kernels.load()


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def lanes_sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """The op's order for sum_j x_j^2 of each row [N, E]: element j into lane j % 16, lanes in order
    of j, then halves added pairwise (8, 4, 2, 1)."""
    sq = x * x
    acc = torch.zeros(x.shape[0], 16)
    for j in range(0, x.shape[1] - x.shape[1] % 16, 16):
        acc = acc + sq[:, j:j + 16]
    for j in range(x.shape[1] - x.shape[1] % 16, x.shape[1]):
        acc[:, j % 16] = acc[:, j % 16] + sq[:, j]
    for w in (8, 4, 2, 1):
        acc = acc[:, :w] + acc[:, w:2 * w]
    return acc[:, 0]


@pytest.mark.parametrize("e", [576, 64, 37])
def test_rms_norm_is_its_fixed_order_bit_for_bit_and_tracks_rmsnorm(e):
    gen = torch.Generator().manual_seed(e)
    x, w, eps = torch.randn(7, e, generator=gen) * 3, torch.randn(e, generator=gen), 1e-5
    ss = lanes_sum_of_squares(x).numpy()  # the scalar steps in numpy float32: one IEEE rounding each
    r = torch.from_numpy(np.float32(1) / np.sqrt(ss / np.float32(e) + np.float32(eps)))
    assert torch.equal(torch.ops.keel.rms_norm(x, w, eps), w * (x * r[:, None]))
    ref = RMSNorm(e, eps)
    ref.weight.data.copy_(w)
    torch.testing.assert_close(torch.ops.keel.rms_norm(x, w, eps), ref(x), rtol=1e-5, atol=1e-6)


def test_rms_norm_reads_row_views_and_keeps_nan_in_its_row():
    x = torch.randn(4, 2 * 576)[:, :576]  # a row stride of 1152
    x[2, 5] = float("nan")
    y = torch.ops.keel.rms_norm(x, torch.ones(576), 1e-5)
    assert torch.isnan(y[2]).all() and torch.isfinite(y[[0, 1, 3]]).all()
    assert torch.equal(y[[0, 1, 3]], torch.ops.keel.rms_norm(x[[0, 1, 3]].contiguous(), torch.ones(576), 1e-5))


def rotary(n: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (100000 ** (torch.arange(0, D, 2).float() / D))
    f = torch.arange(start, start + n)[:, None].float() * inv
    emb = torch.cat((f, f), dim=-1)
    return emb.cos(), emb.sin()  # [N, D]


def test_rope_store_is_the_aten_formula_bit_for_bit_and_writes_only_its_slots():
    n, slots = 5, torch.tensor([17, 3, 40, 41, 100])
    qkv = torch.randn(n, (H + 2 * KV) * D)
    q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)  # column views, as forward.py passes them
    cos, sin = rotary(n, 7)
    keys, values = torch.full((KV, 8 * BT, D), 2.0), torch.full((KV, 8 * BT, D), 3.0)
    rq = torch.ops.keel.rope_store(q, k, v, cos, sin, slots, keys, values)
    assert torch.equal(rq, _rope(q.reshape(n, H, D), cos[:, None], sin[:, None]).reshape(n, H * D))
    assert torch.equal(keys[:, slots].transpose(0, 1), _rope(k.reshape(n, KV, D), cos[:, None], sin[:, None]))
    assert torch.equal(values[:, slots].transpose(0, 1), v.reshape(n, KV, D))
    others = torch.ones(8 * BT, dtype=torch.bool)
    others[slots] = False
    assert (keys[:, others] == 2.0).all() and (values[:, others] == 3.0).all()


def pool(blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(KV, blocks * BT, D, generator=gen), torch.randn(KV, blocks * BT, D, generator=gen)
    keys[:, :BT] = 0  # block 0: the padding block
    values[:, :BT] = 0
    return keys, values


def attend(q, keys, values, tables: list[list[int]], lengths: list[int], rows: list[int], width: int | None = None,
           isa: str | None = None) -> torch.Tensor:
    width = width or max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    out = torch.zeros(q.shape[0], q.shape[1])
    torch.ops.keel.decode_attention_(out, torch.tensor(rows), q, keys, values, table, torch.tensor(lengths), BT,
                                     keys.shape[-1] ** -0.5,
                                     -1 if isa is None else kernels.ISAS.index(isa))
    return out


def reference(q_row, keys, values, table: list[int], length: int) -> torch.Tensor:
    slots = torch.tensor([table[p // BT] * BT + p % BT for p in range(length)])
    k, v = keys[:, slots].double(), values[:, slots].double()                 # [KV, L, D]
    p = torch.softmax(q_row.double().view(KV, G, D) @ k.transpose(-1, -2) * D ** -0.5, dim=-1)
    return (p @ v).reshape(H * D).float()


def test_decode_attention_tracks_the_softmax_over_each_rows_own_positions():
    keys, values = pool(12, 0)
    tables, lengths = [[2, 5, 1], [7, 3], [11]], [40, 20, 1]
    q = torch.randn(3, H * D)
    out = attend(q, keys, values, tables, lengths, [0, 1, 2])
    for r in range(3):
        torch.testing.assert_close(out[r], reference(q[r], keys, values, tables[r], lengths[r]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_threads", [1, 2])
def test_a_rows_attention_is_bitwise_the_same_alone_and_in_any_batch(threads, n_threads):
    threads(n_threads)
    keys, values = pool(40, 1)
    gen = torch.Generator().manual_seed(2)
    rows = 12
    tables = [torch.randperm(39, generator=gen)[:1 + r % 5].add(1).tolist() for r in range(rows)]
    lengths = [BT * (len(t) - 1) + 1 + (r * 7) % BT for r, t in enumerate(tables)]
    q = torch.randn(rows, H * D, generator=gen)
    alone = [attend(q[r:r + 1], keys, values, [tables[r]], [lengths[r]], [0])[0] for r in range(rows)]
    for size in (2, 5, 12):
        members = torch.randperm(rows, generator=gen)[:size].tolist()
        spread = torch.zeros(3 * size, H * D)  # the batch's queries at scattered token rows
        at = torch.randperm(3 * size, generator=gen)[:size].tolist()
        spread[at] = q[members]
        out = attend(spread, keys, values, [tables[m] for m in members], [lengths[m] for m in members], at,
                     width=8)  # tables padded past the longest
        for m, a in zip(members, at):
            assert torch.equal(out[a], alone[m])
        untouched = torch.ones(3 * size, dtype=torch.bool)
        untouched[at] = False
        assert (out[untouched] == 0).all()


@pytest.mark.parametrize("d", [D, 48, 40])  # 40: not whole 16s, every isa runs the portable code
def test_every_attention_path_gives_the_portable_bits(d):
    gen = torch.Generator().manual_seed(d)
    keys, values = torch.randn(KV, 10 * BT, d, generator=gen), torch.randn(KV, 10 * BT, d, generator=gen)
    q = torch.randn(4, H * d, generator=gen)
    tables, lengths = [[3, 1], [2], [5, 6, 7], [9]], [20, 1, 40, 16]
    portable = attend(q, keys, values, tables, lengths, [0, 1, 2, 3], isa="portable")
    for isa in kernels.load().isas:
        assert torch.equal(attend(q, keys, values, tables, lengths, [0, 1, 2, 3], isa=isa), portable), isa


def test_a_non_finite_key_reaches_only_the_rows_that_attend_to_it():
    keys, values = pool(6, 3)
    keys[1, 2 * BT + 4] = float("nan")  # block 2, position 4, KV head 1
    q = torch.randn(2, H * D)
    out = attend(q, keys, values, [[2], [3]], [10, 10], [0, 1])
    assert torch.isnan(out[0, G * D:2 * G * D]).all() and torch.isfinite(out[0, :G * D]).all()
    assert torch.isfinite(out[1]).all()


@pytest.mark.parametrize("call,message", [
    (lambda k, v: torch.ops.keel.rms_norm(torch.randn(2, 8).double(), torch.ones(8), 1e-5), "float32"),
    (lambda k, v: torch.ops.keel.rms_norm(torch.randn(2, 8), torch.ones(9), 1e-5), "w has 9"),
    (lambda k, v: torch.ops.keel.rope_store(torch.randn(1, H * D), torch.randn(1, KV * D), torch.randn(1, KV * D),
                                            *rotary(1, 0), torch.tensor([10 ** 6]), k, v), "outside the pool"),
    (lambda k, v: torch.ops.keel.rope_store(torch.randn(1, H * D), torch.randn(1, D), torch.randn(1, D),
                                            *rotary(1, 0), torch.tensor([0]), k, v), "must agree"),
    (lambda k, v: attend(torch.randn(1, H * D), k, v, [[1]], [BT + 1], [0]), "length"),
    (lambda k, v: attend(torch.randn(1, H * D), k, v, [[99]], [3], [0]), "block 99"),
    (lambda k, v: attend(torch.randn(1, H * D), k, v, [[1]], [3], [5]), "row 5"),
    (lambda k, v: torch.ops.keel.decode_attention_(torch.zeros(1, H * D), torch.tensor([0]), torch.randn(1, H * D),
                                                   k, v, torch.tensor([[1]]), torch.tensor([3]), BT, 0.1, 7),
     "unknown isa 7"),
])
def test_malformed_calls_raise_naming_the_op(call, message):
    keys, values = pool(4, 4)
    with pytest.raises(RuntimeError, match=message) as info:
        call(keys, values)
    assert "keel::" in str(info.value)
