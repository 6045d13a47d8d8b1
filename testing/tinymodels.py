"""Tiny random models of every architecture Keel implements, as a GGUF and as a transformers folder.

`tiny_model_files(name, qtype)` returns a TinyFiles: `gguf` (written with gguf-py's GGUFWriter as
llama.cpp's converter writes one: the linear weights in `qtype`, the embedding in F32 for F32 and Q8_0
otherwise, norms, biases and rope_freqs in F32, the query/key rows interleaved for llama and mistral,
the shipped SmolLM2 GGUF's tokenizer.ggml.* fields, so llama.cpp loads it with a real tokenizer) and
`hf` (a folder saved by transformers' save_pretrained holding the same weights: the exact
dequantization of the GGUF's blocks). Each pair is cached under
var/tinymodels/<name>-<qtype>-<hash of the spec, the seed and this file's source>.

Names (SPECS): llama (SmolLM2-like, tied), llama3 (llama3 rope scaling, untied head), qwen2 (q/k/v
biases), qwen3 (per-head q/k norms, head_dim 32 != hidden / heads), mistral (sliding window 16, untied).
llama.cpp has no "mistral" architecture (its converter writes Mistral models as "llama", without the
window): the mistral GGUF says "mistral", which Keel reads and llama.cpp refuses. WIDE's llama-wide is
llama with hidden 256 and ffn 512, for testing/quantized.py's K-quants.

Weights are drawn with a large std (see testing/tiny.py) so greedy decoding is not degenerate.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize, quantize

from services.inference.model import llama
from services.inference.model.llama import ModelConfig
from shared import ggufmeta
from shared.config import ROOT_DIR
from shared.modelfile import shipped_gguf
from testing.cache import built_once

Q = gguf.GGMLQuantizationType
CACHE = Path(ROOT_DIR) / "var" / "tinymodels"
QTYPES = ("F32", "Q8_0", "Q4_1")
SEED = 0
STD = 0.5

_BASE = {"hidden": 64, "ffn": 128, "layers": 2, "heads": 4, "kv": 2, "head_dim": 16, "context": 512,
         "theta": 10000.0, "eps": 1e-5, "tied": True, "window": None, "rope": None}
SPECS: dict[str, dict] = {
    "llama": {"arch": "llama"},
    "llama3": {"arch": "llama", "tied": False, "theta": 500000.0,
               "rope": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64}},
    "qwen2": {"arch": "qwen2", "layers": 3, "theta": 1000000.0, "eps": 1e-6},
    "qwen3": {"arch": "qwen3", "head_dim": 32, "eps": 1e-6},
    "mistral": {"arch": "mistral", "tied": False, "window": 16, "heads": 8, "kv": 2, "head_dim": 8},
}
# Not another architecture: a llama whose matrices are whole K-quant super-blocks (256) along both
# dimensions, for testing/quantized.py's llama.cpp-quantized types.
WIDE = {"llama-wide": {"arch": "llama", "hidden": 256, "ffn": 512, "head_dim": 64}}
# Keel's parameter name suffix in layer N -> the GGUF's (blk.N.<name>).
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


@dataclass(frozen=True)
class TinyFiles:
    name: str
    qtype: str
    gguf: Path
    hf: Path
    config: ModelConfig


def _tokenizer_fields() -> dict[str, object]:
    header = ggufmeta.read(shipped_gguf())
    return {k: v for k, v in header.metadata.items() if k.startswith("tokenizer.")}


def config_of(name: str, tokenizer: dict | None = None) -> ModelConfig:
    s = {**_BASE, **_spec(name)}
    tok = tokenizer or {}
    return ModelConfig(
        vocab_size=len(tok.get("tokenizer.ggml.tokens", ())) or 49152, hidden_size=s["hidden"],
        intermediate_size=s["ffn"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv"], head_dim=s["head_dim"], max_position_embeddings=s["context"],
        rope_theta=s["theta"], rms_norm_eps=s["eps"], tie_word_embeddings=s["tied"],
        bos_token_id=tok.get("tokenizer.ggml.bos_token_id"), eos_token_id=tok.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=tok.get("tokenizer.ggml.padding_token_id"), model_type=s["arch"],
        attention_bias=s["arch"] == "qwen2", qk_norm=s["arch"] == "qwen3", sliding_window=s["window"],
        rope_scaling=s["rope"])


def _spec(name: str) -> dict:
    return SPECS[name] if name in SPECS else WIDE[name]


def _key(name: str, qtype: str) -> str:
    """The generator's inputs (spec, qtype, seed, std) and its code (this file's source)."""
    blob = json.dumps({"spec": {**_BASE, **_spec(name)}, "qtype": qtype, "seed": SEED, "std": STD})
    return hashlib.sha256(blob.encode() + Path(__file__).read_bytes()).hexdigest()[:12]


def tiny_model_files(name: str, qtype: str = "F32") -> TinyFiles:
    """The cached pair for architecture `name` (SPECS) with linear weights in `qtype` (QTYPES)."""
    if name not in SPECS and name not in WIDE or qtype not in QTYPES:
        raise ValueError(f"unknown tiny model {name}/{qtype}")
    tokenizer = _tokenizer_fields()
    config = config_of(name, tokenizer)
    out = built_once(CACHE / f"{name}-{qtype}-{_key(name, qtype)}",
                     lambda folder: _generate(config, Q[qtype], tokenizer, folder))
    return TinyFiles(name, qtype, out / "model.gguf", out / "hf", config)


def _random_state(config: ModelConfig) -> dict[str, torch.Tensor]:
    model = llama.uninitialised(config)
    gen = torch.Generator().manual_seed(SEED)
    state = {}
    for key, p in model.named_parameters():  # a tied lm_head is listed once, as the embedding
        if key.endswith("norm.weight"):
            state[key] = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        else:
            state[key] = STD * torch.randn(p.shape, generator=gen)
    return state


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary interleave of a query/key weight's rows (convert_hf_to_gguf.py's permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(key: str) -> str:
    if key == "model.embed_tokens.weight":
        return "token_embd.weight"
    if key == "model.norm.weight":
        return "output_norm.weight"
    if key == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = key.split(".", 3)
    return f"blk.{i}.{_LAYER[rest]}"


def _generate(config: ModelConfig, qtype: Q, tokenizer: dict, out: Path) -> None:
    state = _random_state(config)
    arch = config.model_type
    writer = gguf.GGUFWriter(str(out / "model.gguf"), arch)
    writer.add_name(f"keel-tiny-{arch}")
    writer.add_file_type({Q.F32: gguf.LlamaFileType.ALL_F32, Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
                          Q.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1}[qtype])
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if config.sliding_window is not None:
        writer.add_sliding_window(config.sliding_window)
    _add_tokenizer(writer, tokenizer)
    permuted = arch in ("llama", "mistral")
    exact: dict[str, torch.Tensor] = {}
    for key, w in state.items():
        name = _gguf_name(key)
        data = w.numpy().astype(np.float32)
        heads = {"attn_q.weight": config.num_attention_heads, "attn_k.weight": config.num_key_value_heads}.get(
            name.split(".", 2)[-1]) if name.startswith("blk.") else None
        stored = _permute(data, heads) if permuted and heads else data
        kind = Q.F32 if data.ndim == 1 else (Q.Q8_0 if name == "token_embd.weight" and qtype != Q.F32 else qtype)
        if kind == Q.F32:
            writer.add_tensor(name, np.ascontiguousarray(stored))
            exact[key] = w.float()
            continue
        blocks = quantize(np.ascontiguousarray(stored), kind)
        writer.add_tensor(name, blocks, raw_dtype=kind)
        back = dequantize(blocks, kind).reshape(stored.shape)
        if permuted and heads:  # the reference keeps transformers' row order
            back = back.reshape(heads, back.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(data.shape)
        exact[key] = torch.from_numpy(np.ascontiguousarray(back))
    if config.rope_scaling and config.rope_scaling["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", np.asarray(llama.llama3_freq_factors(config), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _save_hf(config, exact, out / "hf")


def _add_tokenizer(writer: gguf.GGUFWriter, fields: dict) -> None:
    for key, value in fields.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)


def _save_hf(config: ModelConfig, state: dict[str, torch.Tensor], folder: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(config.model_type, **{k: v for k, v in config.to_json().items() if k != "model_type"})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"transformers' {config.model_type} does not take the tiny weights: "
                           f"missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(folder)


def write_foreign_gguf(path: Path, arch: str) -> Path:
    """A small GGUF of an architecture Keel does not implement (its header and one tensor)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
