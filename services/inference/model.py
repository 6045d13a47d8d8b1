"""Load the serving model (fp32, bf16 or int8) and build a tiny random one for tests.

The engine only relies on the Llama module layout (embed_tokens, layers[i].self_attn.{q,k,v,o}_proj,
mlp, input/post_attention_layernorm, norm, rotary_emb, lm_head); see forward.py.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from shared.errors import InvalidInput

DTYPES = ("float32", "bfloat16", "float16", "int8")  # int8: dynamic quantization of every Linear
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_dtype(dtype: str, device: str = "cpu") -> None:
    if dtype not in DTYPES:
        raise InvalidInput(f"unknown dtype {dtype!r}; expected one of {DTYPES}", reason="UNKNOWN_DTYPE",
                           metadata={"dtype": dtype})
    if dtype == "int8" and device != "cpu":
        # quantize_dynamic produces fbgemm/qnnpack CPU kernels only.
        raise InvalidInput("int8 runs on CPU only", reason="UNSUPPORTED_DTYPE",
                           metadata={"dtype": dtype, "device": device})


def convert_model(model: torch.nn.Module, dtype: str, device: str = "cpu") -> torch.nn.Module:
    """Return `model` in `dtype` (a copy when a conversion is needed); quantized models cannot be converted."""
    check_dtype(dtype, device)
    if model_dtype(model) == dtype:
        return model
    if model_dtype(model) == "int8":
        raise InvalidInput("an int8 model cannot be converted back to a float dtype",
                           reason="UNSUPPORTED_DTYPE", metadata={"dtype": dtype})
    out = copy.deepcopy(model)
    if dtype == "int8":
        return _quantize(out.to(dtype=torch.float32))
    return out.to(device=device, dtype=_TORCH_DTYPES[dtype]).eval()


def model_dtype(model: torch.nn.Module) -> str:
    """The dtype name load_model would use for this model."""
    if any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in model.modules()):
        return "int8"
    return {v: k for k, v in _TORCH_DTYPES.items()}[model.model.embed_tokens.weight.dtype]


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu") -> torch.nn.Module:
    """Load a Llama-family causal LM from a safetensors directory, in eval mode, without grad."""
    check_dtype(dtype, device)
    path = Path(path)
    if not (path / "config.json").exists():
        raise InvalidInput(f"no model at {path} (config.json missing); run `make model`",
                           reason="MODEL_NOT_FOUND", metadata={"path": str(path)})
    # bandit B615 does not apply: a local directory.
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)  # nosec B615
    model.requires_grad_(False)
    if dtype == "int8":
        return _quantize(model)
    return model.to(device=device, dtype=_TORCH_DTYPES[dtype]).eval()


def _quantize(model: torch.nn.Module) -> torch.nn.Module:
    return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8).eval()


def tiny_model(vocab_size: int = 49152, seed: int = 0) -> torch.nn.Module:
    """A random 2-layer Llama (hidden 64, 4 heads, 2 KV heads) with the real vocabulary size.

    initializer_range is large on purpose: with the usual 0.02 the logits are nearly flat and greedy
    decoding would hinge on rounding-level near-ties, which makes exact-match tests meaningless.
    """
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rope_theta=100000.0, tie_word_embeddings=True, initializer_range=0.5,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.requires_grad_(False)
    return model.eval()
