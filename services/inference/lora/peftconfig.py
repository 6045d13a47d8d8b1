"""What this build understands in a PEFT `adapter_config.json`; everything else is refused, never dropped.

Keys fall in three groups: the ones the LoRA term uses (`r`, `lora_alpha`, `target_modules`,
`use_rslora`, `peft_type`), the ones that only matter while training or describe where the adapter came
from (ignored at inference, whatever their value), and features this build does not implement, which
must keep their "off" value. A key in none of the groups is unknown and refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.errors import PreconditionFailed

# The Llama projections the LoRA term is applied to (forward.py calls each one through LoraSlots).
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Training-time or provenance keys: no effect on an unmerged inference forward.
_IGNORED = frozenset({
    "auto_mapping", "base_model_name_or_path", "revision", "inference_mode", "init_lora_weights",
    "lora_dropout", "peft_version", "task_type", "megatron_core", "qalora_group_size", "loftq_config",
    "eva_config", "corda_config", "lora_ga_config", "ensure_weight_tying",
})

# Features not implemented here, with the value that means "not used".
_OFF = {
    "use_dora": False, "bias": "none", "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
    "layers_to_transform": None, "layers_pattern": None, "fan_in_fan_out": False, "lora_bias": False,
    "use_qalora": False, "trainable_token_indices": None, "target_parameters": None, "exclude_modules": None,
    "layer_replication": None, "megatron_config": None, "alora_invocation_tokens": None, "arrow_config": None,
    "use_bdlora": None, "kasa_config": None, "monteclora_config": None, "velora_config": None,
}
_USED = frozenset({"peft_type", "r", "lora_alpha", "target_modules", "use_rslora"})


@dataclass(frozen=True)
class LoraSpec:
    """The parts of an adapter config the LoRA term depends on."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    use_rslora: bool

    @property
    def scaling(self) -> float:
        """PEFT's multiplier of B(A x): alpha / r, or alpha / sqrt(r) with rank-stabilised LoRA."""
        return self.alpha / (self.rank ** 0.5 if self.use_rslora else self.rank)


def unsupported(message: str, key: str) -> PreconditionFailed:
    return PreconditionFailed(message, reason="UNSUPPORTED_ADAPTER_CONFIG", metadata={"key": key})


def parse(config: dict, max_rank: int) -> LoraSpec:
    """The LoraSpec of a parsed adapter_config.json; PreconditionFailed(UNSUPPORTED_ADAPTER_CONFIG) naming
    the first key this build cannot honour (unknown keys first, in sorted order)."""
    if not isinstance(config, dict):
        raise unsupported("adapter_config.json is not a JSON object", "(top level)")
    for key in sorted(config):
        if key not in _IGNORED and key not in _OFF and key not in _USED:
            raise unsupported(f"unknown adapter_config key {key!r}", key)
    for key in sorted(_OFF):
        if key in config and config[key] != _OFF[key] and not (_OFF[key] == {} and config[key] is None):
            raise unsupported(f"adapter_config {key}={config[key]!r} is not supported (only {_OFF[key]!r})", key)
    if config.get("peft_type") != "LORA":
        raise unsupported(f"peft_type {config.get('peft_type')!r} is not LORA", "peft_type")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise unsupported(f"rank r={rank!r} is outside 1..{max_rank} (lora.max_rank)", "r")
    alpha = config.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise unsupported(f"lora_alpha {alpha!r} is not a number", "lora_alpha")
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        # PEFT also takes a regex string or "all-linear"; only an explicit list of names is honoured here.
        raise unsupported(f"target_modules must be a list of module names, got {targets!r}", "target_modules")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise unsupported(f"use_rslora {rslora!r} is not a boolean", "use_rslora")
    return LoraSpec(rank, float(alpha), tuple(sorted(set(targets))), rslora)
