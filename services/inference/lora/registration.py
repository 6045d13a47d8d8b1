"""Registration: a PEFT folder becomes ID/VERSION in the registry, with the golden outputs Keel's engine makes.

The adapter must pass the same checks as at start (config understood, weights fit the targets,
outputs differ from the base's); its greedy outputs on the check prompts become the golden ones and the top-k
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

from services.inference.lora import checkprompts, manifest, peftconfig
from services.inference.lora.checkprompts import CheckRow
from services.inference.lora.manifest import Manifest
from services.inference.lora.registry import DRIFT_DIRECTION, Base, LoraConfig, base_greedy, check_name
from services.inference.lora.weights import read_weights
from services.inference.model.loraslots import LoraSlots
from shared.errors import PreconditionFailed

# The check runs of a registration: the base's greedy one, the adapter's greedy one, the teacher-forced one.
CHECK_RUNS = 3


def forward_steps(base: Base) -> int:
    """The batched forward steps a registration runs (what its `progress` counts to)."""
    checks = base.check_prompts
    return CHECK_RUNS * checkprompts.forward_steps(len(checks.prompts), checks.continuation_tokens)


def register(src: Path, adapter_id: str, version: str, base: Base, cfg: LoraConfig,
             training_data_manifest: Path | None = None, progress=None) -> Manifest:
    """Check a PEFT folder against `base`, make its golden outputs with the engine's runner, and write
    ID/VERSION into the registry (manifest, golden outputs, model card). Raises the refusal it would get.
    `progress`, when given, is called with 1 after each forward step of the check runs (forward_steps)."""
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
        steps = base.check_prompts.continuation_tokens
        traces = checkprompts.run(runner, [CheckRow(p, 1) for p in base.check_prompts.prompts], steps, progress)
        golden = [t.tokens for t in traces]
        if golden == base_ids:
            raise PreconditionFailed("greedy outputs equal the base model's on every check prompt",
                                     reason="ADAPTER_CHANGES_NOTHING")
        forced = checkprompts.run(runner, [CheckRow(p, 0, g) for p, g in zip(base.check_prompts.prompts, golden)],
                                  steps, progress)
    finally:
        runner.lora = saved
    kl = torch.cat([checkprompts.kl_full(a.logprobs, b.logprobs) for a, b in zip(traces, forced)])
    kl_base = checkprompts.summary(kl, "KL(adapter || base)")
    tops = [checkprompts.top_k(t) for t in traces]
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
        check_prompts_sha256=base.check_prompts.sha256, golden_ids=tuple(golden),
        golden_sha256=manifest.file_sha256(tmp / manifest.GOLDEN),
        files_sha256={n: manifest.file_sha256(tmp / n) for n in manifest.PEFT_FILES}, kl_vs_base=kl_base,
        drift_gate={"direction": DRIFT_DIRECTION, "aggregation": "mean and p95 over check positions",
                    "top_k": checkprompts.TOP_K, "threshold": cfg.drift_threshold},
        created_at=datetime.now(timezone.utc).isoformat(timespec="microseconds"))
    m.write(tmp)
    tmp.replace(dest)
    return m
