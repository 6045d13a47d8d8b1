"""Real PEFT adapters made on the spot, for the LoRA tests and bench/bench_lora.py (the one maker), and
their slots as the stage loads them.

`make_adapter` wraps a copy of the base model with PEFT's own `get_peft_model`, fills lora_B (which
PEFT initialises to zero) with seeded random values so the adapter changes the outputs, and writes the
folder with `save_pretrained`: adapter_config.json + adapter_model.safetensors, as a team would ship it.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import tempfile
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

from services.inference.lora.peftconfig import parse
from services.inference.lora.weights import read_weights
from services.inference.model.loraslots import LoraSlots
from services.tokenizer.compiler import compiled_path
from shared.modelfile import source as model_source


def make_adapter(base: torch.nn.Module, out_dir: Path, *, seed: int, rank: int = 4, alpha: float = 8,
                 targets: tuple[str, ...] = ("q_proj", "v_proj"), b_std: float = 0.5,
                 config_overrides: dict | None = None) -> Path:
    """A PEFT LoRA folder for `base` (which is left untouched); `config_overrides` edits the written
    adapter_config.json afterwards (an unknown key, use_dora, ...)."""
    model = copy.deepcopy(base)  # a float32 model (the tiny one, or the real one as load_model gives it)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                                                  lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * b_std / rank ** 0.5)
            elif "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
    peft_model.save_pretrained(str(out_dir))
    if config_overrides:
        path = Path(out_dir) / "adapter_config.json"
        config = json.loads(path.read_text())
        config.update(config_overrides)
        path.write_text(json.dumps(config, indent=2))
    return Path(out_dir)


def peft_logits(base: torch.nn.Module, adapter_dir: Path, ids: list[int]) -> torch.Tensor:
    """PEFT's unmerged forward over transformers' own Llama with `base`'s weights (the reference):
    float32 logits [len(ids), V]."""
    from peft import PeftModel

    from testing.tiny import hf_twin
    with tempfile.TemporaryDirectory() as tmp:
        model = PeftModel.from_pretrained(hf_twin(base, Path(tmp)), str(adapter_dir)).eval()
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0].float()


def tokenizer():
    """Keel's real tokenizer (the shipped model's compiled vocabulary); the tiny model shares its vocabulary size."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from services.inference.lora.fingerprint import open_tokenizer
        _TOKENIZER = open_tokenizer(compiled_path(model_source()))
    return _TOKENIZER


_TOKENIZER = None


def base_of(model: torch.nn.Module, weights_sha256: str = "tiny-seed-0", fmt: str = "float32", runner=None):
    """A registry Base for an in-memory model: its calibrated runner, fingerprint fields, the check prompts."""
    from services.inference.lora import fingerprint
    from services.inference.lora.checkprompts import load_check_prompts
    from services.inference.lora.registry import Base
    from services.inference.model.forward import LlamaRunner
    if runner is None:
        runner = LlamaRunner(model)
        runner.calibrate_invariant_sizes(16)
    tok = tokenizer()
    config = dataclasses.asdict(model.config)
    fields = fingerprint.base_fields(weights_sha256, config, fingerprint.tokenizer_hashes(tok), fmt)
    return Base(runner, fields, load_check_prompts(tok))


def load_slots(model: torch.nn.Module, folders: list[Path], max_rank: int = 64) -> LoraSlots:
    """The adapters in `folders` as the engine's slots over `model` (slot k + 1 = folders[k])."""
    weights = []
    for f in folders:
        spec = parse(json.loads((f / "adapter_config.json").read_text()), max_rank)
        weights.append(read_weights(f / "adapter_model.safetensors", spec, model))
    return LoraSlots(weights, model)
