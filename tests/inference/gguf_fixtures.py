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
