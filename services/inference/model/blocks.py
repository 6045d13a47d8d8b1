"""Weight formats `gguf` and `gguf_f32`: the model file's own quantized blocks, multiplied by Keel's C++ kernels.

Each weight matrix keeps its file's ggml type (a llama.cpp Q4_K_M file mixes Q4_K, Q6_K and, where the
rows are not whole super-blocks, Q5_0 / Q8_0; the shipped SmolLM2 is Q4_1 linears with a Q8_0
embedding), so the weights are the float32 reference's (the exact dequantization of those blocks).
The two formats differ in the activations the kernel multiplies them with (`layout` picks per weight):
  gguf      8-bit activations per 32-element block and integer dot products, as llama.cpp computes:
            Q4_0..Q8_0 on kernels/gguf_q8.cpp (blocks interleaved by 16 rows, `pack_x16`), Q4_K..Q6_K
            on kernels/gguf_q8k.cpp (superblocks.pack_x16k); F32/F16/BF16 have no integer kernel and
            run as in gguf_f32
  gguf_f32  float32 activations against the dequantized blocks (kernels/gguf_mm.cpp, every type): only
            the summation order differs from the float32 GEMM; the blocks in the file's row order
A type keel::gguf_mm does not compute (Q2_K, Q3_K, IQ*...) is refused at load, naming a tensor of it.

Block layout (ggml; a weight [N out, K in] is N rows of K / 32 blocks, stored as uint8 [N, K/32 * B]):
  Q4_1, B = 20: fp16 d, fp16 m, uint8 qs[16]; element j = qs[j] & 15, element j + 16 = qs[j] >> 4;
                w = d * q + m
  Q8_0, B = 34: fp16 d, int8 qs[32]; w = d * q
Both products d * q are exact in float32, so a dequantized block equals the reference bit for bit.
x16, for the 8-bit kernel (the same bytes, regrouped; a weight [N, K] becomes [ceil(N/16), K/32 * 16 B]):
  group g, block b: the 16 rows' d (16 fp16), for Q4_1 their m (16 fp16), then chunks of 64 bytes,
  chunk c holding row r's qs[4c..4c+3] at 4r..4r+3 (Q4_1: c = 0..3; Q8_0: c = 0..7). Rows past N are
  zero blocks. One 64-byte load gives the kernel 4 quants of 16 rows, one int32 lane per row.

The modules keep the Llama layout of llama.py (forward.py, the LoRA term, the gate see the same
attributes): `BlockLinear` replaces nn.Linear, `BlockEmbedding` nn.Embedding and `KernelRMSNorm` RMSNorm
(kernels/layer_ops.cpp, as are the rotary embedding and decode attention forward.py runs for these
formats). Each layer also holds its query/key/value blocks as one [Nq + Nk + Nv, ...] matrix
(`self_attn.qkv`) and gate/up as one (`mlp.gate_up`), with q_proj, k_proj, v_proj, gate_proj and up_proj
as row views of them: forward.py runs one kernel call for each fused matrix. The kernels' order per
output element depends only on K (services/inference/model/kernels), so a fused call gives the bits of
the separate ones (x16 parts are fused only when each is whole groups of 16 rows).

llama.cpp stores the query and key rows of each head interleaved for its rotary layout
(convert_hf_to_gguf.py's permute, llama and mistral only); the loader puts them back in the reference's
order (ggufmodel.row_order). qwen2's q/k/v biases (F32) are added after the block product
(`BlockLinear.bias`, the fused matrix holding them stacked), qwen3's per-head q/k norms are KernelRMSNorm
modules (self_attn.q_norm, k_norm); a layer with q/k norms runs forward.py's op-by-op path (`LayerArgs.of`).

Entry points: `load_gguf(path, format)` reads the config and the tensors from the GGUF itself
(ggufmodel.py); `load(model_dir, format)` is `make model`'s folder: the config from its config.json,
the GGUF named by its keel-source.json, the tensor table from its gguf-index.json.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from torch import nn

from services.inference.model import ggufindex, ggufmodel, kernels, llama
from services.inference.model.ggufmodel import TensorFile
from services.inference.model.llama import LlamaForCausalLM, ModelConfig
from services.inference.model.superblocks import pack_x16k
from shared.errors import InvalidInput

FORMAT = "gguf"          # 8-bit activations (gguf_q8.cpp, gguf_q8k.cpp) where the type has an integer kernel
EXACT_FORMAT = "gguf_f32"  # float32 activations (gguf_mm.cpp)
FORMATS = (FORMAT, EXACT_FORMAT)
ROWS = 16  # weight rows per x16 group

# Keel's module names for the GGUF's tensor names of layer i.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def layout(ggml_type: int, q8: bool) -> str:
    """How a weight of `ggml_type` is held and multiplied in format gguf (`q8`) or gguf_f32:
    "x16" (pack_x16, keel::gguf_q8_mm), "x16k" (superblocks.pack_x16k, keel::gguf_q8k_mm), or "rows", the
    file's row order on keel::gguf_mm with float32 activations: every type in gguf_f32, and in gguf the
    float types (F32, F16, BF16), which have no integer kernel. kernels/layer.cpp makes the same choice."""
    if q8 and ggml_type in kernels.SUPPORTED_TYPES:
        return "x16"
    if q8 and ggml_type in kernels.K_TYPES:
        return "x16k"
    return "rows"


_OPS = {"x16": "gguf_q8_mm", "x16k": "gguf_q8k_mm", "rows": "gguf_mm"}


def pack(blocks: torch.Tensor, ggml_type: int, q8: bool) -> torch.Tensor:
    """File-order blocks [N, bytes per row] (uint8; float32 rows for F32) -> the layout of `layout`."""
    if blocks.dtype != torch.uint8:  # an F32 weight, as ggufindex.read gives it: its bytes
        blocks = blocks.contiguous().view(torch.uint8)
    kind = layout(ggml_type, q8)
    return blocks if kind == "rows" else (pack_x16 if kind == "x16" else pack_x16k)(blocks, ggml_type)


class BlockLinear(nn.Module):
    """y = x @ W.T with W [out_features, in_features] kept as GGUF blocks (uint8) in the layout that
    `layout(ggml_type, q8)` names: the file's row order [out, bytes per row], x16 [ceil(out/16),
    in/32 * 16 B] or x16k [ceil(out/16), in/256 * U].

    `owner` False: the blocks are a row view of a fused matrix that owns them (counted once)."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, in_features: int, out_features: int, q8: bool,
                 owner: bool = True, bias: torch.Tensor | None = None):
        super().__init__()
        self.bias = bias  # float32 [out] added to each product (qwen2's q/k/v), or None
        self.in_features, self.out_features, self.ggml_type, self.q8 = in_features, out_features, ggml_type, q8
        self.layout = layout(ggml_type, q8)
        if owner:
            self.register_buffer("blocks", blocks, persistent=False)
        else:
            self.blocks = blocks
        # The op and its arguments as plain attributes: a buffer's lookup goes through nn.Module.__getattr__.
        self._op = getattr(torch.ops.keel, _OPS[self.layout])
        self._args = (blocks, ggml_type, out_features, -1)  # isa -1: the best path this CPU runs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] float32 -> [..., out] float32."""
        if x.dim() == 2 and x.is_contiguous():  # the engine's steps: no reshapes to dispatch
            y = self._op(x, *self._args)
        else:
            y = self._op(x.reshape(-1, self.in_features).contiguous(), *self._args)
            y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"type={GGMLQuantizationType(self.ggml_type).name}, layout={self.layout}")


class BlockEmbedding(nn.Module):
    """Rows of a GGUF-block matrix (file order [V, bytes per row], or x16 when `x16`), dequantized per
    looked-up token to float32 by one call of keel::gguf_rows (kernels/gguf_mm.cpp: the reference's
    dequantization bit for bit, read from either layout in place)."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, embedding_dim: int, x16: bool):
        super().__init__()
        self.ggml_type, self.embedding_dim, self.x16 = ggml_type, embedding_dim, x16
        self.register_buffer("blocks", blocks, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., E] float32."""
        rows = torch.ops.keel.gguf_rows(self.blocks, ids.reshape(-1).long().contiguous(), self.ggml_type, self.x16)
        return rows.reshape(*ids.shape, self.embedding_dim)


class KernelRMSNorm(nn.Module):
    """llama.RMSNorm in one call of keel::rms_norm (kernels/layer_ops.cpp): x [..., E] float32 -> [..., E]."""

    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight, self.variance_epsilon = weight, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return torch.ops.keel.rms_norm(x, self.weight, self.variance_epsilon)
        y = torch.ops.keel.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.variance_epsilon)
        return y.reshape(x.shape)


def pack_x16(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """File-order blocks [N, K/32 * B] -> x16 [ceil(N/16), K/32 * 16 B] (module docstring)."""
    n, row_bytes = blocks.shape
    kind = kernels.SUPPORTED_TYPES[ggml_type]
    bb, scales = kind.block_bytes, kind.scale_bytes
    nb, g = row_bytes // bb, -(-n // ROWS)
    padded = torch.zeros(g * ROWS, row_bytes, dtype=torch.uint8)
    padded[:n] = blocks
    b = padded.view(g, ROWS, nb, bb).transpose(1, 2)                   # [G, nb, 16, B]
    head = b[..., :scales].reshape(g, nb, ROWS, scales // 2, 2).transpose(2, 3)  # [G, nb, scale, 16, 2]
    qs = b[..., scales:].reshape(g, nb, ROWS, -1, 4).transpose(2, 3)   # [G, nb, chunks, 16, 4]
    return torch.cat((head.reshape(g, nb, -1), qs.reshape(g, nb, -1)), dim=-1).reshape(g, -1).contiguous()


def gguf_file(model_dir: Path) -> Path:
    """The GGUF the model directory was prepared from (its keel-source.json, model/modelcache.py)."""
    try:
        named = json.loads((model_dir / "keel-source.json").read_text())["gguf"]
    except (OSError, ValueError, KeyError) as exc:
        raise InvalidInput(f"{model_dir} does not name the GGUF it was made from (keel-source.json); "
                           "run `make model`", reason="MODEL_NOT_FOUND", metadata={"path": str(model_dir)}) from exc
    if not named:
        raise InvalidInput("the gguf formats compute on a GGUF's blocks; this model is a Hugging Face folder",
                           reason="UNSUPPORTED_FORMAT", metadata={"format": FORMAT})
    return Path(named)


def check_file(model: Path, format: str) -> None:
    """InvalidInput unless `format` can load `model` (a prepared folder, or a GGUF file as load_gguf takes
    one): a GGUF whose every tensor is of a type the kernels compute, read from its tensor table, no weights."""
    if model.suffix == ".gguf" and model.is_file():
        _check_types(model, ggufmodel.TensorFile.of(model, ggufmodel.header(model)).entries, format)
        return
    path = gguf_file(model)
    _check_types(path, ggufindex.index(model, path), format)


def _check_types(path: Path, table: dict, format: str) -> None:
    """InvalidInput UNSUPPORTED_BLOCK_TYPE naming a tensor of each type of `table` (the GGUF at `path`)
    that keel::gguf_mm does not compute (Q2_K, Q3_K, IQ*, TQ*...): both formats take every type it does."""
    first: dict[str, str] = {}
    for name, e in table.items():
        if e.ggml_type not in kernels.MM_TYPES:
            first.setdefault(GGMLQuantizationType(e.ggml_type).name, name)
    if first:
        names = ", ".join(GGMLQuantizationType(k).name for k in kernels.MM_TYPES)
        found = ", ".join(f"{tensor} is {t}" for t, tensor in sorted(first.items()))
        raise InvalidInput(f"{path.name} holds tensors of GGUF types the {format} format does not compute on "
                           f"({found}; it takes {names})",
                           reason="UNSUPPORTED_BLOCK_TYPE",
                           metadata={"types": ",".join(sorted(first)),
                                     "tensors": ",".join(first[t] for t in sorted(first))})


def load(model_dir: Path, format: str = FORMAT) -> LlamaForCausalLM:
    """The model of `model_dir`'s config.json with its weights as the blocks of its GGUF (CPU), for the
    kernel of `format` (one of FORMATS)."""
    kernels.load()  # KernelUnavailable here, before any work, when the kernel cannot be built
    config = ModelConfig.from_json(json.loads((model_dir / "config.json").read_text()))
    path = gguf_file(model_dir)
    return _build(config, TensorFile(path, ggufindex.index(model_dir, path)), format)


def load_gguf(path: str | Path, format: str = FORMAT) -> LlamaForCausalLM:
    """The model of a GGUF file, its config from the file's metadata (ggufmodel.py), its weights as the
    file's blocks (CPU), for the kernel of `format` (one of FORMATS)."""
    kernels.load()
    config, tensors = ggufmodel.read(path)
    return _build(config, tensors, format)


def _build(config: ModelConfig, source: TensorFile, format: str) -> LlamaForCausalLM:
    q8 = format == FORMAT
    _check_types(source.path, source.entries, format)

    def tensor(name: str) -> tuple[torch.Tensor, int]:
        data, rows = torch.from_numpy(source.read(name)), ggufmodel.row_order(config, name)
        return (data if rows is None else data[rows].contiguous()), source.type(name)

    def bias(name: str) -> torch.Tensor | None:
        return tensor(name)[0] if config.attention_bias else None

    def norm(name: str) -> KernelRMSNorm:
        return KernelRMSNorm(nn.Parameter(tensor(name)[0], requires_grad=False), config.rms_norm_eps)

    def linear(part: tuple[torch.Tensor, int], in_features: int) -> BlockLinear:
        b, t = part
        return BlockLinear(pack(b, t, q8), t, in_features, b.shape[0], q8)

    model = llama.uninitialised(config)  # its float matrices are never written, and replaced below
    e, heads = config.hidden_size, config.num_attention_heads
    embed, embed_type = tensor("token_embd.weight")
    # A GGUF without output.weight ties lm_head to the embedding: the same blocks, counted once, where
    # the lookup can read lm_head's layout (rows, x16); an x16k head keeps the file's rows beside it.
    head = tensor("output.weight") if "output.weight" in source.entries else None
    model.lm_head = linear(head or (embed, embed_type), e)
    x16 = layout(embed_type, q8) == "x16"
    if head is None and layout(embed_type, q8) != "x16k":
        rows = model.lm_head.blocks
    else:
        rows = pack(embed, embed_type, q8) if x16 else pack(embed, embed_type, False)
    model.model.embed_tokens = BlockEmbedding(rows, embed_type, e, x16)
    model.model.norm = norm("output_norm.weight")
    for i, layer in enumerate(model.model.layers):
        layer.input_layernorm = norm(f"blk.{i}.attn_norm.weight")
        layer.post_attention_layernorm = norm(f"blk.{i}.ffn_norm.weight")
        attn, mlp = layer.self_attn, layer.mlp
        _fuse(attn, "qkv", ("q_proj", "k_proj", "v_proj"), tuple(tensor(f"blk.{i}.attn_{p}.weight") for p in "qkv"),
              e, q8, tuple(bias(f"blk.{i}.attn_{p}.bias") for p in "qkv"))
        if config.qk_norm:
            attn.q_norm, attn.k_norm = norm(f"blk.{i}.attn_q_norm.weight"), norm(f"blk.{i}.attn_k_norm.weight")
        attn.o_proj = linear(tensor(f"blk.{i}.attn_output.weight"), heads * config.head_dim)
        _fuse(mlp, "gate_up", ("gate_proj", "up_proj"),
              (tensor(f"blk.{i}.ffn_gate.weight"), tensor(f"blk.{i}.ffn_up.weight")), e, q8)
        mlp.down_proj = linear(tensor(f"blk.{i}.ffn_down.weight"), config.intermediate_size)
    model.requires_grad_(False)
    model.format = format
    return model.eval()


def _fuse(parent: nn.Module, fused: str, names: tuple[str, ...], parts: tuple[tuple[torch.Tensor, int], ...],
          in_features: int, q8: bool, biases: tuple[torch.Tensor | None, ...] | None = None) -> None:
    """parent.<fused>: one BlockLinear over the parts' rows stacked; parent.<name>: a row view of each.
    Parts of different block types, or x16 parts that are not whole groups of 16 rows, stay separate
    modules (no fused matrix). `biases`: each part's, or None (all or none)."""
    biases = biases or (None,) * len(parts)
    types = {t for _, t in parts}
    if len(types) > 1 or (layout(next(iter(types)), q8) != "rows" and any(b.shape[0] % ROWS for b, _ in parts)):
        for name, (b, t), bias in zip(names, parts, biases):
            setattr(parent, name, BlockLinear(pack(b, t, q8), t, in_features, b.shape[0], q8, bias=bias))
        return
    t = types.pop()
    stacked = torch.cat([b for b, _ in parts])
    stacked_bias = None if biases[0] is None else torch.cat(biases)
    whole = BlockLinear(pack(stacked, t, q8), t, in_features, stacked.shape[0], q8, bias=stacked_bias)
    setattr(parent, fused, whole)
    start, row = 0, 0
    for name, (b, _) in zip(names, parts):
        step = b.shape[0] if whole.layout == "rows" else b.shape[0] // ROWS  # x16(k): its groups' rows
        bias = None if stacked_bias is None else stacked_bias[row:row + b.shape[0]]
        setattr(parent, name, BlockLinear(whole.blocks[start:start + step], t, in_features, b.shape[0], q8,
                                          owner=False, bias=bias))
        start, row = start + step, row + b.shape[0]


@dataclass(frozen=True)
class LayerArgs:
    """A decoder layer's weights as keel::layer_attention and keel::layer_mlp take them (kernels/layer.cpp):
    `attention` = (input norm, eps, [qkv blocks] or [q, k, v blocks] (types differ), their types, their
    biases or [], (H*D, KV*D, KV*D), q8), `mlp` = (o blocks, type, width, post norm, eps, gate_up blocks,
    type, width, down blocks, type, width, q8)."""

    attention: tuple
    mlp: tuple

    @classmethod
    def of(cls, layer: nn.Module) -> LayerArgs | None:
        """None unless every part is a block module, gate/up are fused (see load) and q, k, v either fused
        or separate with all or none of them biased, and the layer has no q/k norms (the composed ops
        compute none)."""
        attn, mlp = layer.self_attn, layer.mlp
        fused, gate_up = getattr(attn, "qkv", None), getattr(mlp, "gate_up", None)
        qkv = (fused,) if fused is not None else (attn.q_proj, attn.k_proj, attn.v_proj)
        biases = [m.bias for m in qkv if getattr(m, "bias", None) is not None]
        if hasattr(attn, "q_norm") or len(biases) not in (0, len(qkv)):
            return None
        linears = (*qkv, attn.o_proj, gate_up, mlp.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not (all(isinstance(m, BlockLinear) for m in linears) and all(isinstance(m, KernelRMSNorm) for m in norms)):
            return None

        def weight(m: BlockLinear) -> tuple:  # its op's (blocks, type, width), without the isa
            return m._args[:3]

        sizes = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        first, second = norms
        q8 = qkv[0].q8
        return cls((first.weight, first.variance_epsilon, [m.blocks for m in qkv], [m.ggml_type for m in qkv],
                    biases, sizes, q8),
                   (*weight(attn.o_proj), second.weight, second.variance_epsilon, *weight(gate_up),
                    *weight(mlp.down_proj), q8))
