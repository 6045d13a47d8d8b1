"""A GGUF of the tiny model, written as llama.cpp writes one, beside its float32 reference.

`write_tiny_gguf(tiny, folder)` quantizes the tiny model's linears to Q4_1 and its embedding to Q8_0
(gguf-py's own quantizer), with the query/key rows interleaved as llama.cpp's converter stores them,
then writes what `make model` leaves: config.json, model.safetensors holding the exact dequantization
of those blocks (the float32 reference of the gguf format) and keel-source.json naming the GGUF.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize, quantize

from services.inference.model import blocks, kernels
from testing.tiny import save_model

Q = gguf.GGMLQuantizationType
_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary interleave of a query/key weight's rows (convert_hf_to_gguf.py)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(tiny: torch.nn.Module, folder: Path, linear_type: Q = Q.Q4_1,
                    types: dict[str, Q] | None = None) -> Path:
    """The model folder; `types` overrides the block type of single GGUF tensors by name."""
    cfg = tiny.config
    types = types or {}
    folder.mkdir(parents=True, exist_ok=True)
    reference = copy.deepcopy(tiny)
    writer = gguf.GGUFWriter(str(folder / "tiny.gguf"), "llama")
    writer.add_block_count(cfg.num_hidden_layers)

    def put(name: str, w: torch.Tensor, qtype: Q) -> np.ndarray:
        """Adds the tensor in `qtype` blocks; returns what they dequantize to."""
        qtype = types.get(name, qtype)
        data = w.detach().float().numpy()
        if qtype == Q.F32:
            writer.add_tensor(name, data)
            return data
        blocks = quantize(data, qtype)
        writer.add_tensor(name, blocks, raw_dtype=qtype)
        return dequantize(blocks, qtype)

    state = reference.state_dict()
    with torch.no_grad():
        emb = put("token_embd.weight", state["model.embed_tokens.weight"], Q.Q8_0)
        reference.model.embed_tokens.weight.copy_(torch.from_numpy(emb))
        put("output_norm.weight", state["model.norm.weight"], Q.F32)
        for i, layer in enumerate(reference.model.layers):
            put(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight, Q.F32)
            put(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight, Q.F32)
            for module, short in _NAMES.items():
                lin = layer.get_submodule(module)
                w = lin.weight.detach().float().numpy()
                heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(short)
                stored = _permute(w, heads) if heads else w
                back = put(f"blk.{i}.{short}.weight", torch.from_numpy(stored), linear_type)
                if heads:  # undo the interleave: the reference keeps transformers' row order
                    back = back.reshape(heads, back.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
                lin.weight.copy_(torch.from_numpy(np.ascontiguousarray(back)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_model(reference, folder)
    (folder / "keel-source.json").write_text(json.dumps({"gguf": str(folder / "tiny.gguf")}))
    return folder


def unpack_x16(packed: torch.Tensor, rows: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The file-order blocks [R, K/32 * B] of weight rows `rows` [R] of an x16 matrix (blocks.pack_x16's
    inverse, by torch ops)."""
    kind = kernels.SUPPORTED_TYPES[ggml_type]
    bb, scales = kind.block_bytes, kind.scale_bytes
    nb = packed.shape[1] // (blocks.ROWS * bb)
    units = packed[rows // blocks.ROWS].view(-1, nb, blocks.ROWS * bb)               # [R, nb, 16 B]
    at, lane = torch.arange(len(rows)), rows % blocks.ROWS
    head = units[..., :blocks.ROWS * scales].reshape(-1, nb, scales // 2, blocks.ROWS, 2)[at, :, :, lane]
    qs = units[..., blocks.ROWS * scales:].reshape(-1, nb, (bb - scales) // 4, blocks.ROWS, 4)[at, :, :, lane]
    return torch.cat((head.reshape(len(rows), nb, -1), qs.reshape(len(rows), nb, -1)), dim=-1).reshape(len(rows), -1)


def dequantize_rows(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """uint8 [R, bytes per row] -> float32 [R, K], bit for bit the reference's dequantization (gguf-py's,
    or for Q4_1 and Q8_0 its formula by torch ops): what keel::gguf_rows must give."""
    r = blocks.shape[0]
    if ggml_type not in (Q.Q4_1, Q.Q8_0):  # the reference itself (gguf-py) for the other types
        values = dequantize(blocks.numpy(), Q(ggml_type))
        return torch.from_numpy(values.astype(np.float32, copy=False)).reshape(r, -1)
    kind = kernels.SUPPORTED_TYPES[ggml_type]
    b = blocks.reshape(r, -1, kind.block_bytes)                        # [R, K/32, B]
    d = b[..., 0:2].contiguous().view(torch.float16).float()           # [R, K/32, 1]
    if kind.name == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()           # [R, K/32, 32]
        return (d * q).reshape(r, -1)
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    qs = b[..., 4:]                                                    # [R, K/32, 16]
    q = torch.cat((qs & 15, qs >> 4), dim=-1).float()                  # [R, K/32, 32]
    return (d * q + m).reshape(r, -1)
