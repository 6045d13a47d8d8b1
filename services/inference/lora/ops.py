"""What `keel lora` does besides registering: find a version, measure its drift, verify the registry
against the current base (writing retrain requests), and the version matrix."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from services.inference.lora import checkprompts, fingerprint, manifest
from services.inference.lora.checkprompts import CheckRow
from services.inference.lora.registry import (
    AdapterState,
    Base,
    LoraConfig,
    check_name,
    drift_of,
    load_registry,
    read_running_base,
    static_checks,
    versions,
)
from services.inference.model.loraslots import LoraSlots
from shared.errors import NotFound

# Refusals that a new training run against the current base fixes (the others are defects of the adapter).
RETRAIN_REASONS = ("BASE_FINGERPRINT_MISMATCH", "GOLDEN_MISMATCH", "ADAPTER_DRIFT")


def find(cfg: LoraConfig, name: str) -> Path:
    """The version directory of "id@version", or of the newest registered version of "id"."""
    adapter_id, _, version = name.partition("@")
    check_name(adapter_id, "id")
    if version:
        folder = cfg.root / adapter_id / check_name(version, "version")
        if (folder / manifest.MANIFEST).exists():
            return folder
    else:
        found = [f for f in versions(cfg.root) if f.parent.name == adapter_id]
        if found:
            return max(found, key=lambda f: (manifest.read(f).created_at, f.name))
    raise NotFound(f"no adapter {name!r} in {cfg.root}", reason="ADAPTER_NOT_FOUND", metadata={"adapter": name})


def measure_drift(cfg: LoraConfig, base: Base, name: str) -> dict:
    """KL(registered || now) of one version on the check prompts, teacher-forced on its golden outputs,
    with the share of golden tokens the current greedy choice still agrees with."""
    folder = find(cfg, name)
    m, weights = static_checks(folder, base, cfg)
    saved, base.runner.lora = base.runner.lora, LoraSlots([weights], base.runner.model, base.runner.device)
    try:
        rows = [CheckRow(p, 1, g) for p, g in zip(base.check_prompts.prompts, m.golden_ids)]
        traces = checkprompts.run(base.runner, rows, base.check_prompts.continuation_tokens)
    finally:
        base.runner.lora = saved
    agree = sum(a == b for t, g in zip(traces, m.golden_ids) for a, b in zip(t.greedy, g))
    total = sum(len(g) for g in m.golden_ids)
    drift = drift_of(folder, traces)
    return {"adapter": m.name, **drift, "threshold": cfg.drift_threshold,
            "significant": max(drift["mean"], drift["p95"]) > cfg.drift_threshold, "greedy_agreement": agree / total}


@dataclass(frozen=True)
class Verdict:
    state: AdapterState
    retrain_request: Path | None  # written when a new training run against the current base is needed


def verify(cfg: LoraConfig, base: Base) -> list[Verdict]:
    """Re-check every version against `base` as a start would; for each that needs retraining, write
    retrain/ID@VERSION.json (what it was made against, what the base is now, why it fails)."""
    out = []
    for state in load_registry(cfg, base).states:
        path = None
        if state.reason in RETRAIN_REASONS:
            path = _retrain_request(cfg, base, state)
        out.append(Verdict(state, path))
    return out


def _retrain_request(cfg: LoraConfig, base: Base, state: AdapterState) -> Path:
    m = manifest.read(cfg.root / state.id / state.version)
    record = {
        "adapter": state.id, "version": state.version, "reason": state.reason, "detail": state.detail,
        "differing_fields": fingerprint.differing(m.base, base.fields),
        "registered_base": m.base, "current_base": base.fields, "current_base_fingerprint": base.digest,
        "training_data_version": m.training_data_version,
        "lora": {"rank": m.rank, "alpha": m.alpha, "targets": list(m.targets), "use_rslora": m.use_rslora},
        "requested_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    path = cfg.root / "retrain" / f"{state.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return path


@dataclass(frozen=True)
class MatrixRow:
    name: str
    base_fingerprint: str       # the base it was registered against ("" when its record is unreadable)
    fits_running: bool | None   # against base.json; None when no stage has recorded a base yet
    differing: tuple[str, ...]  # fingerprint fields that differ from the running base
    detail: str = ""


def matrix(cfg: LoraConfig) -> tuple[list[MatrixRow], dict[str, str] | None]:
    """Every registered version, the base it fits, and whether that is the base the stage last ran."""
    running = read_running_base(cfg.root)
    rows = []
    for folder in versions(cfg.root):
        name = f"{folder.parent.name}@{folder.name}"
        try:
            m = manifest.read(folder)
        except Exception as exc:  # an unreadable record is listed, not fatal to the listing
            rows.append(MatrixRow(name, "", None, (), str(exc)))
            continue
        diff = tuple(fingerprint.differing(m.base, running)) if running is not None else ()
        rows.append(MatrixRow(name, m.base_fingerprint, None if running is None else not diff, diff))
    return rows, running


def as_json(rows: list[MatrixRow]) -> list[dict]:
    return [asdict(r) for r in rows]
