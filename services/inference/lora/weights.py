"""An adapter's adapter_model.safetensors read and checked against the base model, as AdapterWeights
(model/loraslots.py stacks them by slot for the forward pass)."""
from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from services.inference.lora.peftconfig import SUPPORTED_TARGETS, LoraSpec, unsupported
from services.inference.model.loraslots import AdapterWeights, weight_dims
from shared.errors import PreconditionFailed

_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_LAYER = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(self_attn|mlp)\.(?P<name>\w+)$")


def inert(message: str, **meta) -> PreconditionFailed:
    return PreconditionFailed(message, reason="INERT_ADAPTER", metadata=meta)


def targeted_modules(model: torch.nn.Module, targets: tuple[str, ...]) -> dict[str, torch.nn.Module]:
    """Base modules an adapter with these target_modules would wrap (PEFT's rule: the name, or its
    last dotted part, equals a target). INERT_ADAPTER when a target matches nothing;
    UNSUPPORTED_ADAPTER_CONFIG when it matches a module the LoRA term is not applied to."""
    found = {}
    for target in targets:
        hits = {n: m for n, m in model.named_modules() if n == target or n.endswith("." + target)}
        if not hits:
            raise inert(f"target module {target!r} matches no module of the base model", target=target)
        for name in hits:
            if not _LAYER.match(name) or name.rsplit(".", 1)[1] not in SUPPORTED_TARGETS:
                raise unsupported(f"target {target!r} wraps {name}, which this build does not adapt "
                                  f"(only {', '.join(SUPPORTED_TARGETS)})", "target_modules")
        found.update(hits)
    return found


def read_weights(path: Path, spec: LoraSpec, model: torch.nn.Module) -> AdapterWeights:
    """Read adapter_model.safetensors and check it against the base: one lora_A/lora_B pair for every
    targeted module and none for anything else (INERT_ADAPTER), shapes that fit (BASE_FINGERPRINT_MISMATCH)."""
    modules = targeted_modules(model, spec.targets)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(path)).items():
        m = _KEY.match(key)
        if m is None:
            raise unsupported(f"adapter tensor {key!r} is not a LoRA A/B weight", key)
        halves.setdefault(m["module"], {})[m["ab"]] = tensor
    stray = sorted(set(halves) - set(modules))
    if stray:
        raise inert(f"{len(stray)} adapter weight(s) name modules the base does not have or the config does "
                    f"not target, e.g. {stray[0]}", module=stray[0])
    pairs = {}
    for name, module in modules.items():
        half = halves.get(name, {})
        if set(half) != {"A", "B"}:
            raise inert(f"{len(modules)} modules targeted but {name} has no lora_A/lora_B pair",
                        module=name, targeted=len(modules), pairs=sum(len(h) == 2 for h in halves.values()))
        a, b = half["A"].float(), half["B"].float()
        out_f, in_f = weight_dims(module)
        if a.shape != (spec.rank, in_f) or b.shape != (out_f, spec.rank):
            raise PreconditionFailed(
                f"{name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit a rank-{spec.rank} "
                f"adapter of a {in_f}->{out_f} projection", reason="BASE_FINGERPRINT_MISMATCH",
                metadata={"fields": "shape", "module": name})
        m = _LAYER.match(name)
        pairs[(int(m["layer"]), m["name"])] = (a.contiguous(), b.contiguous())
    return AdapterWeights(spec, pairs)
