"""Registration: a PEFT folder becomes ID/VERSION in the registry, with the golden outputs Keel's engine makes.

The adapter must pass the same checks as at start (config understood, weights fit the targets,
outputs differ from the base's); its greedy probe outputs become the golden ones and the top-k
log-probabilities at each golden position are kept for the drift gate. The version directory is
written beside its final place and renamed into it, so a half-written version is never seen.
"""
from __future__ import annotations

import json
import shutil
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.inference.lora import manifest, peftconfig, probes
from services.inference.lora.manifest import Manifest
from services.inference.lora.probes import ProbeRow
from services.inference.lora.registry import DRIFT_DIRECTION, Base, LoraConfig, base_greedy, check_name
from services.inference.lora.weights import read_weights
from services.inference.model.loraslots import LoraSlots
from shared.errors import PreconditionFailed

# The probe runs of a registration: the base's greedy one, the adapter's greedy one, the teacher-forced one.
PROBE_RUNS = 3


def forward_steps(base: Base) -> int:
    """The batched forward steps a registration runs (what its `progress` counts to)."""
    return PROBE_RUNS * probes.forward_steps(len(base.probe_set.prompts), base.probe_set.continuation_tokens)


def register(src: Path, adapter_id: str, version: str, base: Base, cfg: LoraConfig,
             training_data_manifest: Path | None = None, progress=None) -> Manifest:
    """Check a PEFT folder against `base`, make its golden outputs with the engine's runner, and write
    ID/VERSION into the registry (manifest, golden outputs, model card). Raises the refusal it would get.
    `progress`, when given, is called with 1 after each forward step of the probe runs (forward_steps)."""
    check_name(adapter_id, "id")
    check_name(version, "version")
    dest = cfg.root / adapter_id / version
    if dest.exists():
        raise PreconditionFailed(f"{adapter_id}@{version} is already registered; register a new version",
                                 reason="ADAPTER_EXISTS", metadata={"adapter": f"{adapter_id}@{version}"})
    src = Path(src)
    for name in manifest.PEFT_FILES:
        if not (src / name).is_file():
            raise PreconditionFailed(f"{src / name} is missing (a PEFT adapter folder has {manifest.PEFT_FILES})",
                                     reason="ADAPTER_RECORD_INVALID", metadata={"path": str(src / name)})
    spec = peftconfig.parse(json.loads((src / "adapter_config.json").read_text()), cfg.max_rank)
    weights = read_weights(src / "adapter_model.safetensors", spec, base.runner.model)
    runner, saved = base.runner, base.runner.lora
    try:
        runner.lora = None
        base_ids = base_greedy(base, progress)
        runner.lora = LoraSlots([weights], runner.model, runner.device)
        steps = base.probe_set.continuation_tokens
        traces = probes.run(runner, [ProbeRow(p, 1) for p in base.probe_set.prompts], steps, progress)
        golden = [t.tokens for t in traces]
        if golden == base_ids:
            raise PreconditionFailed("greedy outputs equal the base model's on every probe",
                                     reason="ADAPTER_CHANGES_NOTHING")
        forced = probes.run(runner, [ProbeRow(p, 0, g) for p, g in zip(base.probe_set.prompts, golden)], steps,
                            progress)
    finally:
        runner.lora = saved
    kl_base = probes.summary(torch.cat([probes.kl_full(a.logprobs, b.logprobs) for a, b in zip(traces, forced)]),
                             "KL(adapter || base)")
    tops = [probes.top_k(t) for t in traces]
    tmp = cfg.root / adapter_id / f".{version}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in manifest.PEFT_FILES:
        shutil.copyfile(src / name, tmp / name)
    save_file({"ids": torch.stack([i for i, _ in tops]).to(torch.int32).contiguous(),
               "logprobs": torch.stack([v for _, v in tops]).contiguous()}, str(tmp / manifest.GOLDEN))
    m = Manifest(
        id=adapter_id, version=version, base=dict(base.fields), base_fingerprint=base.digest,
        training_data_version=manifest.file_sha256(training_data_manifest) if training_data_manifest else "",
        rank=spec.rank, alpha=spec.alpha, targets=spec.targets, use_rslora=spec.use_rslora,
        probe_set_sha256=base.probe_set.sha256, golden_ids=tuple(golden),
        golden_sha256=manifest.file_sha256(tmp / manifest.GOLDEN),
        files_sha256={n: manifest.file_sha256(tmp / n) for n in manifest.PEFT_FILES}, kl_vs_base=kl_base,
        drift_gate={"direction": DRIFT_DIRECTION, "aggregation": "mean and p95 over probe positions",
                    "top_k": probes.TOP_K, "threshold": cfg.drift_threshold},
        created_at=datetime.now(timezone.utc).isoformat(timespec="microseconds"))
    m.write(tmp)
    tmp.replace(dest)
    return m
