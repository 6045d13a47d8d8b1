"""The tiny random Llama the engine's tests and some benches run on (no weights file needed), and
model folders written from a Keel Llama (for the stage, or for transformers' own twin)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.inference.model import llama
from services.inference.model.llama import ModelConfig


def tiny_model(vocab_size: int = 49152, seed: int = 0) -> torch.nn.Module:
    """A random 2-layer Llama (hidden 64, 4 heads, 2 KV heads) with the real vocabulary size.

    Initialised as transformers initialises a Llama: every Linear and the embedding from N(0, std),
    the padding token's embedding row zero (tied, so its logit is always 0), norms at one. std is
    large on purpose: with the usual 0.02 the logits are nearly flat and greedy decoding would hinge
    on rounding-level near-ties, which makes exact-match tests meaningless.
    """
    std = 0.5
    config = ModelConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        rope_theta=100000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    model = llama.uninitialised(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied lm_head is listed once, as the embedding
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
        model.model.embed_tokens.weight[config.pad_token_id] = 0
    model.requires_grad_(False)
    return model.eval()


def save_model(model, path: Path) -> Path:
    """Write a Keel Llama as `make model` leaves one: a transformers config.json and model.safetensors."""
    path.mkdir(parents=True, exist_ok=True)
    config = {**dataclasses.asdict(model.config), "model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "hidden_act": "silu"}
    (path / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    save_file(state, str(path / "model.safetensors"))
    return path


def hf_twin(model, path: Path):
    """transformers' own LlamaForCausalLM with the same weights, read from the files save_model writes."""
    from transformers import AutoModelForCausalLM
    save_model(model, path)
    # bandit B615 does not apply: a local directory.
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()  # nosec B615
