"""The K-quant super-blocks (Q4_K, Q5_K, Q6_K) regrouped by 16 rows for Keel's integer kernel
(kernels/gguf_q8k.cpp, `x16k`): the same values as the file's blocks, laid out so one 64-byte load
gives the kernel 4 quants of 16 rows (one int32 lane per row). Layouts: gguf_q8k.cpp's header.

A weight [N, K] of K/256 super-blocks per row becomes [ceil(N/16), K/256 * U] uint8 (U = 16 rows'
share of a super-block: Q4_K 2368, Q5_K 2880, Q6_K 3360 bytes); rows past N are zero. Q4_K and Q5_K
keep their 6-bit scales and mins unpacked (16 bytes per row and super-block where the file packs
them into 12), the only bytes that differ from the file's.
"""
from __future__ import annotations

import numpy as np
import torch

Q4_K, Q5_K, Q6_K = 12, 13, 14
ROWS = 16
BYTES = {Q4_K: 144, Q5_K: 176, Q6_K: 210}  # the file's bytes per row and super-block of 256
UNIT = {Q4_K: 2368, Q5_K: 2880, Q6_K: 3360}


def _chunks(q: np.ndarray) -> np.ndarray:
    """[G, 16, S, n] bytes per row -> [G, S, n/4 chunks, 16 rows, 4]: chunk c holds row r's bytes 4c..4c+3."""
    g, r, s, n = q.shape
    return q.reshape(g, r, s, n // 4, 4).transpose(0, 2, 3, 1, 4)


def _rows_last(a: np.ndarray) -> np.ndarray:
    """[G, 16, S, k...] per row -> [G, S, k..., 16]."""
    return np.moveaxis(a, 1, -1)


def _scale_min(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 packed bytes [..., 12] -> 6-bit scales and mins [..., 8] (ggml's get_scale_min_k4)."""
    d, m, md = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scale = np.concatenate([d & 63, (md & 15) | ((d >> 6) << 4)], -1)
    mins = np.concatenate([m & 63, (md >> 4) | ((m >> 6) << 4)], -1)
    return scale, mins


def pack_x16k(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """[N, K/256 * B] uint8 (the file's rows) -> [ceil(N/16), K/256 * U] uint8 (x16k)."""
    n, width = blocks.shape
    s = width // BYTES[ggml_type]
    g = -(-n // ROWS)
    b = np.zeros((g * ROWS, s, BYTES[ggml_type]), np.uint8)
    b[:n] = blocks.numpy().reshape(n, s, BYTES[ggml_type])
    b = b.reshape(g, ROWS, s, -1)
    if ggml_type == Q6_K:
        ql, qh, scales, d = b[..., :128], b[..., 128:192], b[..., 192:208], b[..., 208:210]
        parts = [_rows_last(d.reshape(g, ROWS, s, 1, 2)).transpose(0, 1, 2, 4, 3),  # [G, S, 1, 16, 2]
                 _rows_last(scales),                                                # [G, S, 16, 16]
                 _chunks(ql),                                                       # h, r', c = 32 chunks
                 _chunks(qh)]                                                       # h, c = 16 chunks
    else:
        d, dmin, packed = b[..., 0:2], b[..., 2:4], b[..., 4:16]
        scale, mins = _scale_min(packed)
        parts = [_rows_last(d.reshape(g, ROWS, s, 1, 2)).transpose(0, 1, 2, 4, 3),
                 _rows_last(dmin.reshape(g, ROWS, s, 1, 2)).transpose(0, 1, 2, 4, 3),
                 _rows_last(scale), _rows_last(mins)]
        if ggml_type == Q5_K:
            parts.append(_chunks(b[..., 16:48]))
        parts.append(_chunks(b[..., -128:]))
    unit = np.concatenate([p.reshape(g, s, -1) for p in parts], -1)
    assert unit.shape[-1] == UNIT[ggml_type]
    return torch.from_numpy(np.ascontiguousarray(unit.reshape(g, s * UNIT[ggml_type])))
