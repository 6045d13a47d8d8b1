"""Keel's own Llama-family module: SmolLM2, Llama 2/3, Mistral, Qwen2 and Qwen3 in plain torch.

Architectures (`ModelConfig.model_type`, transformers' model_type and GGUF's general.architecture):
  llama    SmolLM2, Llama 2, Llama 3.x (rope_type llama3 or linear scaling of the rotary frequencies)
  mistral  llama-shaped; attention limited to the last `sliding_window` positions when the config sets one
  qwen2    biases on the query, key and value projections
  qwen3    an RMSNorm over each head's query and key (q_norm, k_norm) before the rotary embedding, and an
           explicit head_dim
Tied or untied output head, any head / KV-head / hidden sizes. Anything else is refused with
UNSUPPORTED_MODEL. ggufmodel.py builds the same config from a GGUF's metadata.

The serving process imports only torch and safetensors for the model (transformers alone costs more
than two seconds of start-up, and a restart after a crash pays every second of it). The module tree
and its parameter names are those of transformers' LlamaForCausalLM (Qwen2/Qwen3/Mistral use the same
names, plus self_attn.q_norm / k_norm for qwen3 and the q/k/v `.bias` for qwen2), so the weight file of
`make model` loads as it is and the engine (forward.py) and the weight formats (quant.py) see the same
attributes: model.embed_tokens, model.layers[i].self_attn.{q,k,v,o}_proj, .mlp.{gate,up,down}_proj,
.input_layernorm, .post_attention_layernorm, model.norm, model.rotary_emb, lm_head.

The operations, and their order, are those of transformers 5 (RMSNorm in float32, then the weight;
rotary angles in float32; SiLU-gated MLP; SDPA attention), so the logits agree with it:
tests/inference/test_llama.py checks the tiny model and tests/inference/test_real_model.py the real
weights. Only what Keel runs is here: a whole causal pass from position 0 (`forward`, used by the
quality gate, the warm-start probe and the format timing); the engine's cached, ragged passes are
forward.py's.

Shapes: B batch, T tokens, E hidden size, H query heads, KV key/value heads, D head_dim, V vocab.
"""
from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from shared.errors import InvalidInput

# The model families this module implements (GGUF general.architecture, transformers' model_type).
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "llama3", "linear", "freq_factors")


def unsupported_architecture(name: str, where: str) -> InvalidInput:
    return InvalidInput(f"{where} is a {name!r} model; Keel implements {', '.join(ARCHITECTURES)}",
                        reason="UNSUPPORTED_MODEL", metadata={"architecture": name})


@dataclass
class ModelConfig:
    """The fields of a transformers config.json that these architectures read (same names).

    `rope_scaling`: None, or the rotary frequencies' scaling: {"rope_type": "llama3", "factor",
    "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"} (transformers'
    rope_parameters), {"rope_type": "linear", "factor"}, or {"rope_type": "freq_factors", "factors": [D/2]}
    (llama.cpp's rope_freqs.weight: each frequency divided by its factor, what llama3 becomes in a GGUF).
    `sliding_window`: None, or the number of positions a query attends to (itself and those before).
    Mutable on purpose: quantizing lm_head unties it from the embedding (quant.py)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    model_type: str = "llama"
    attention_bias: bool = False  # biases on q_proj, k_proj, v_proj (qwen2)
    qk_norm: bool = False         # self_attn.q_norm / k_norm over each head (qwen3)
    sliding_window: int | None = None
    rope_scaling: dict | None = None

    @classmethod
    def from_json(cls, data: dict) -> ModelConfig:
        """From a transformers config.json; InvalidInput when it describes something else."""
        arch = data.get("model_type", "llama")
        if arch not in ARCHITECTURES:
            raise unsupported_architecture(arch, "the model's config.json")
        rope = dict(data.get("rope_parameters") or data.get("rope_scaling") or {})
        rope.setdefault("rope_theta", data.get("rope_theta"))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        window = data.get("sliding_window") if arch == "mistral" else None
        unsupported = {
            "hidden_act": data.get("hidden_act", "silu") != "silu",
            "rope_parameters.rope_type": rope_type not in ROPE_TYPES,
            # qwen2 has q/k/v biases by construction; elsewhere attention_bias also puts one on o_proj
            "attention_bias": arch != "qwen2" and bool(data.get("attention_bias")),
            "mlp_bias": bool(data.get("mlp_bias")),
            "use_sliding_window": arch in ("qwen2", "qwen3") and bool(data.get("use_sliding_window")),
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise InvalidInput(f"the model's config.json asks for what Keel's Llama does not implement: {bad}",
                               reason="UNSUPPORTED_MODEL", metadata={"fields": ",".join(bad)})
        try:
            known = {f.name for f in fields(cls)}
            values = {k: v for k, v in data.items() if k in known}
            values.setdefault("head_dim", data["hidden_size"] // data["num_attention_heads"])
            values.setdefault("rms_norm_eps", 1e-6)
            values.setdefault("tie_word_embeddings", False)
            values["rope_theta"] = float(rope.get("rope_theta") or 10000.0)
            values["model_type"] = arch
            values["attention_bias"] = arch == "qwen2"
            values["qk_norm"] = arch == "qwen3"
            limit = values.get("max_position_embeddings")
            values["sliding_window"] = int(window) if window and (limit is None or window < limit) else None
            keep = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "factors")
            values["rope_scaling"] = ({"rope_type": rope_type, **{k: rope[k] for k in keep if k in rope}}
                                      if rope_type != "default" else None)
            return cls(**values)
        except (KeyError, TypeError) as exc:
            raise InvalidInput(f"the model's config.json lacks a field: {exc}", reason="UNSUPPORTED_MODEL",
                               metadata={"fields": str(exc)}) from exc


    def to_json(self) -> dict:
        """transformers' config.json fields for this config (from_json reads them back; a freq_factors
        rope, which only a GGUF gives, is Keel's own rope_type there)."""
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta}
        out = {
            "model_type": self.model_type, "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu", "rope_parameters": rope, "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id,
        }
        if self.model_type == "mistral":
            out["sliding_window"] = self.sliding_window
        if self.model_type in ("qwen2", "qwen3"):
            out["use_sliding_window"] = False
        return out


class CausalLMOutput(NamedTuple):
    logits: torch.Tensor  # [B, T, V], the model's dtype


class Linear(nn.Linear):
    """An nn.Linear created without initialising its weight (torch.empty): the loader assigns the
    file's tensor, a random test model (testing/tiny.py) draws its own. Skipping the init saves a
    second per start on the real model; building on the meta device instead runs the init's
    decompositions, whose first use imports torch's compiler stack (sympy, mpmath, ~800 modules),
    which costs as much."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """An nn.Embedding created without initialising its weight (see Linear)."""

    def reset_parameters(self) -> None:
        pass


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: (x1, x2) -> (-x2, x1), the two halves of the last dimension."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., E] -> [..., E], normalized in float32, scaled in x's dtype."""
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)  # [D / 2]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] -> (cos, sin), each [B, T, D] in x's dtype (angles in float32)."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """The rotary embedding's [D / 2] inverse frequencies, scaled as `config.rope_scaling` says, computed as
    transformers computes them (modeling_rope_utils: default, linear, _compute_llama3_parameters)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(torch.float) / d))
    rope = config.rope_scaling or {"rope_type": "default"}
    kind = rope["rope_type"]
    if kind == "linear":
        return inv_freq / rope["factor"]
    if kind == "freq_factors":
        return inv_freq / torch.tensor(rope["factors"], dtype=torch.float)
    if kind != "llama3":
        return inv_freq
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def llama3_freq_factors(config: ModelConfig) -> list[float]:
    """What llama.cpp's converter writes as rope_freqs.weight for a llama3 rope_scaling (convert_hf_to_gguf.py)."""
    rope, d = config.rope_scaling, config.head_dim
    freqs = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(float(factor))
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def window_mask(queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """[Q, K] bool, True = attended: causal, and within the last `window` positions when one is set
    (transformers' sliding_window_overlay: key > query - window)."""
    allowed = keys[None, :] <= queries[:, None]
    if window is not None:
        allowed &= keys[None, :] > queries[:, None] - window
    return allowed


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., E] -> [..., E] through [..., intermediate]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        e, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.window = config.sliding_window
        bias = config.attention_bias
        self.q_proj = Linear(e, self.heads * d, bias=bias)
        self.k_proj = Linear(e, self.kv_heads * d, bias=bias)
        self.v_proj = Linear(e, self.kv_heads * d, bias=bias)
        self.o_proj = Linear(self.heads * d, e, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Causal self-attention over a whole sequence: h [B, T, E], cos/sin [B, T, D] -> [B, T, E]."""
        b, t, _ = h.shape
        q = self.q_proj(h).view(b, t, self.heads, self.head_dim)
        k = self.k_proj(h).view(b, t, self.kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):  # qwen3: each head's query and key normalized before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)                                    # [B, H|KV, T, D]
        v = self.v_proj(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)   # [B, KV, T, D]
        cos, sin = cos[:, None], sin[:, None]                                          # [B, 1, T, D]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        mask = None
        if self.window is not None and t > self.window:
            pos = torch.arange(t, device=h.device)
            mask = window_mask(pos, pos, self.window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and t > 1,
                                             scale=self.head_dim ** -0.5, enable_gqa=True)  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, E] -> [B, T, E]: pre-norm attention and MLP, each added to the residual stream."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # The weight format it holds, set by whoever fills the weights (loader.py, blocks.py), so a
        # runner is told its format rather than inferring it from the tensors.
        self.format = "float32"
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def forward(self, input_ids: torch.Tensor) -> CausalLMOutput:
        """input_ids [B, T] (every row from position 0, no padding) -> logits [B, T, V]."""
        core = self.model
        x = core.embed_tokens(input_ids)                                                # [B, T, E]
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)
        cos, sin = core.rotary_emb(x, pos)
        for layer in core.layers:
            x = layer(x, cos, sin)
        return CausalLMOutput(self.lm_head(core.norm(x)))


@contextmanager
def unfilled():
    """torch.empty leaves memory unwritten inside this block.

    In deterministic mode torch fills every torch.empty with NaN: a pass over all of the memory,
    which makes every page of it resident. Use it only for memory the caller writes before reading."""
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill


def uninitialised(config: ModelConfig) -> LlamaForCausalLM:
    """The module with its parameters' memory allocated but never written (the loader fills it)."""
    with unfilled():
        return LlamaForCausalLM(config)


def load(path: Path) -> LlamaForCausalLM:
    """The float32 model of a directory holding config.json and *.safetensors, in eval mode, no grad.

    The module is built with uninitialised parameters and then takes the file's tensors as they are:
    safetensors maps the file, so the weights are neither initialised nor copied."""
    config = ModelConfig.from_json(json.loads((path / "config.json").read_text()))
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    model = uninitialised(config)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # the embedding matrix is lm_head's weight
    expected = set(model.state_dict()) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise InvalidInput(f"the weights in {path} do not fit the config: missing {missing[:5]}, "
                           f"unexpected {extra[:5]}", reason="UNSUPPORTED_MODEL",
                           metadata={"missing": str(len(missing)), "unexpected": str(len(extra))})
    try:
        model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False, assign=True)
    except RuntimeError as exc:  # a tensor whose shape the config does not give
        raise InvalidInput(f"the weights in {path} do not fit the config: {exc}", reason="UNSUPPORTED_MODEL",
                           metadata={"shapes": "mismatch"}) from exc
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.requires_grad_(False)
    return model.eval()
