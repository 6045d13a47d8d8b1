"""A model read straight from a GGUF file: its config from the metadata, its float32 weights from its tensors.

No transformers, no gguf-py GGUFReader: the header comes from shared/ggufmeta.py (one pass), each
tensor's bytes from the file at its offset, dequantized by gguf-py's reference (`gguf.quants`).

Config (llama.cpp's metadata keys, `<arch>` = general.architecture, one of llama.ARCHITECTURES):
  <arch>.context_length, embedding_length, block_count, feed_forward_length, attention.head_count,
  attention.head_count_kv, attention.key_length (the head size; hidden / heads when absent),
  attention.layer_norm_rms_epsilon, rope.freq_base, rope.scaling.type (none or linear, with
  rope.scaling.factor), attention.sliding_window (mistral only); the vocabulary size from
  token_embd's rows; a tied head when output.weight is absent; qwen2's q/k/v biases
  (blk.N.attn_{q,k,v}.bias), qwen3's per-head norms (blk.N.attn_{q,k}_norm.weight).
  llama.cpp's converter writes a llama3 rope_scaling as the tensor rope_freqs.weight (each rotary
  frequency's divisor, convert_hf_to_gguf.py's generate_extra_tensors), read into
  rope_scaling {"rope_type": "freq_factors"}.
  llama.cpp has no "mistral" architecture (its converter writes Mistral as "llama", dropping the
  window); Keel also reads general.architecture "mistral", with mistral.attention.sliding_window.

Row order: llama.cpp's rotary for llama (and Mistral, converted as llama) is the interleaved (NORM)
one, so its converter permutes the query and key rows of each head; `load` and blocks.py put them back
in transformers' order (rotate_half). qwen2 and qwen3 use the NEOX rotary (halves), stored unpermuted.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES

from services.inference.model import llama
from services.inference.model.ggufindex import TensorEntry
from services.inference.model.ggufindex import read as read_entry
from services.inference.model.llama import ARCHITECTURES, LlamaForCausalLM, ModelConfig
from shared import ggufmeta
from shared.errors import InvalidInput

PERMUTED = ("llama", "mistral")  # architectures whose q/k rows the converter interleaves
F32 = 0

# GGUF tensor name (blk.N.<short>) -> Keel's (transformers') module path in layer N.
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
CONFIG_ONLY = ("rope_freqs.weight",)


def _refused(path: Path, what: str, **metadata: str) -> InvalidInput:
    return InvalidInput(f"{path.name}: {what}", reason="UNSUPPORTED_MODEL", metadata=metadata or {"path": str(path)})


@dataclass(frozen=True)
class TensorFile:
    """A GGUF's tensors by name: their ggml types, shapes and bytes (read on demand, not mapped)."""

    path: Path
    entries: dict[str, TensorEntry]

    @classmethod
    def of(cls, path: Path, header: ggufmeta.Header) -> TensorFile:
        entries = {}
        for t in header.tensors.values():
            block, size = GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.ggml_type)]
            entries[t.name] = TensorEntry(t.ggml_type, t.shape, t.offset, int(np.prod(t.shape)) // block * size)
        return cls(path, entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def type(self, name: str) -> int:
        return self.entries[name].ggml_type

    def read(self, name: str) -> np.ndarray:
        """ggufindex.read's array: uint8 [rows, bytes per row] for blocks, float32 for F32 tensors."""
        entry = self.entries.get(name)
        if entry is None:
            raise _refused(self.path, f"the model lacks tensor {name}", fields=name)
        return read_entry(self.path, entry)

    def floats(self, name: str) -> torch.Tensor:
        """The tensor dequantized to float32, in its shape (rows first)."""
        entry, raw = self.entries.get(name), self.read(name)
        if entry.ggml_type == F32:
            return torch.from_numpy(raw)
        return torch.from_numpy(np.ascontiguousarray(
            gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(entry.ggml_type)))).reshape(entry.shape)


def header(path: Path) -> ggufmeta.Header:
    try:
        return ggufmeta.read(path)
    except (OSError, ggufmeta.GgufError) as exc:
        raise InvalidInput(f"cannot read the GGUF {path}: {exc}", reason="MODEL_NOT_FOUND",
                           metadata={"path": str(path)}) from exc


def config_of(h: ggufmeta.Header, tensors: TensorFile) -> ModelConfig:
    """The model's config from the GGUF's metadata and tensor table; UNSUPPORTED_MODEL when Keel does
    not implement what it describes."""
    path, arch = tensors.path, h.architecture
    if arch not in ARCHITECTURES:
        raise llama.unsupported_architecture(arch or "(no general.architecture)", path.name)

    def need(key: str, default: int | float | None = None) -> int | float:
        value = h.arch(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _refused(path, f"{arch}.{key} is {'missing' if value is None else 'not one number'}",
                           fields=f"{arch}.{key}")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv, head_dim = int(need("attention.head_count_kv", heads)), int(need("attention.key_length", hidden // heads))
    if int(need("attention.value_length", head_dim)) != head_dim:
        raise _refused(path, "key and value heads of different sizes", fields=f"{arch}.attention.value_length")
    if int(need("rope.dimension_count", head_dim)) != head_dim:
        raise _refused(path, "a rotary embedding over part of the head", fields=f"{arch}.rope.dimension_count")
    context = int(need("context_length"))
    scaling = str(h.arch("rope.scaling.type", "none"))
    if scaling == "linear":
        rope = {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    elif scaling == "none":
        rope = None
    else:
        raise _refused(path, f"rope scaling {scaling!r} (Keel takes none, linear and llama3's rope_freqs)",
                       fields=f"{arch}.rope.scaling.type")
    if "rope_freqs.weight" in tensors:
        if rope is not None:
            raise _refused(path, "both rope_freqs.weight and rope.scaling.type", fields="rope_freqs.weight")
        rope = {"rope_type": "freq_factors", "factors": tensors.floats("rope_freqs.weight").tolist()}
    window = h.arch("attention.sliding_window") if arch == "mistral" else None
    if "token_embd.weight" not in tensors:
        raise _refused(path, "the model lacks tensor token_embd.weight", fields="token_embd.weight")
    return ModelConfig(
        vocab_size=tensors.entries["token_embd.weight"].shape[0], hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")), num_hidden_layers=int(need("block_count")),
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, max_position_embeddings=context,
        rope_theta=float(need("rope.freq_base", 10000.0)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=h.get("tokenizer.ggml.bos_token_id"), eos_token_id=h.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=h.get("tokenizer.ggml.padding_token_id"), model_type=arch,
        attention_bias=arch == "qwen2", qk_norm=arch == "qwen3",
        sliding_window=int(window) if window and window < context else None, rope_scaling=rope)


def read(path: str | Path) -> tuple[ModelConfig, TensorFile]:
    """The GGUF's config and tensors (the header only is read)."""
    path = Path(path)
    h = header(path)
    tensors = TensorFile.of(path, h)
    return config_of(h, tensors), tensors


def keel_name(gguf_name: str) -> str | None:
    """Keel's parameter name for a GGUF tensor's; None for a tensor Keel has no parameter for."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"
    return None


def unpermute_rows(n_rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's rotary interleave of a [heads * D, K] query or key weight."""
    return torch.arange(n_rows).reshape(heads, n_rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def row_order(config: ModelConfig, gguf_name: str) -> torch.Tensor | None:
    """The rows to take of a GGUF tensor for transformers' order: the query/key rows of the permuted
    architectures; None for every other tensor."""
    if config.model_type not in PERMUTED:
        return None
    heads = {"attn_q.weight": config.num_attention_heads, "attn_k.weight": config.num_key_value_heads}
    short = gguf_name.split(".", 2)[-1]
    if gguf_name.startswith("blk.") and short in heads:
        return unpermute_rows(heads[short] * config.head_dim, heads[short])
    return None


def load(path: str | Path) -> LlamaForCausalLM:
    """The float32 model of a GGUF file (every tensor dequantized), in eval mode, without grad."""
    config, tensors = read(path)
    model = llama.uninitialised(config)
    expected = set(model.state_dict()) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    state = {}
    for name in tensors.entries:
        key = keel_name(name)
        if key is None:
            if name in CONFIG_ONLY:
                continue
            raise _refused(tensors.path, f"tensor {name} is not part of a {config.model_type} model Keel implements",
                           fields=name)
        w = tensors.floats(name)
        rows = row_order(config, name)
        state[key] = w if rows is None else w[rows].contiguous()
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise _refused(tensors.path, f"the tensors do not fit the config: missing {missing[:5]}, "
                       f"unexpected {extra[:5]}", missing=str(len(missing)), unexpected=str(len(extra)))
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:
        raise _refused(tensors.path, f"the tensors do not fit the config: {exc}", shapes="mismatch") from exc
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.requires_grad_(False)
    return model.eval()
