"""The adapter registry: registration, the checks at start, and which adapter a request names.

Layout under `lora.registry_dir` (default var/adapters): ID/VERSION/ per registered version (see
manifest.py), retrain/ for `keel lora verify`'s retrain requests, and base.json, the fingerprint of
the base the inference stage last started with (what offline `keel lora list|verify|register` compare
against). At start every version is checked in this order; the first failure refuses it:
record and files intact (ADAPTER_RECORD_INVALID), base fingerprint (BASE_FINGERPRINT_MISMATCH, the
differing fields named), probe set unchanged (GOLDEN_MISMATCH), config understood
(UNSUPPORTED_ADAPTER_CONFIG), weights fit the targets (INERT_ADAPTER), then the probe run: greedy
outputs equal the golden ones (GOLDEN_MISMATCH), differ from the base's (ADAPTER_CHANGES_NOTHING), and
drift below `drift_threshold` (ADAPTER_DRIFT when `drift_action` is refuse). A refusal never stops the
stage. The accepted versions are loaded into slots 1.. in name order; nothing is read after that.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shared.config import var_dir
from shared.errors import InvalidInput, KeelError, NotFound, PreconditionFailed

from services.inference.forward import LlamaRunner
from services.inference.lora import fingerprint, manifest, peftconfig, probes
from services.inference.lora.manifest import Manifest
from services.inference.lora.probes import ProbeRow, ProbeSet
from services.inference.lora.slots import AdapterWeights, LoraSlots, read_weights

log = logging.getLogger(__name__)

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
DRIFT_ACTIONS = ("refuse", "warn")
DRIFT_DIRECTION = "KL(registered || now)"


@dataclass(frozen=True)
class LoraConfig:
    """The inference stage's `lora:` block."""

    registry_dir: str = ""        # "" -> adapters/ under the var directory
    max_rank: int = 64
    drift_threshold: float = 0.3  # nats per token, on the mean and on the p95
    drift_action: str = "refuse"  # refuse | warn

    def __post_init__(self):
        if self.drift_action not in DRIFT_ACTIONS:
            raise ValueError(f"drift_action must be one of {DRIFT_ACTIONS}")
        if self.max_rank < 1 or self.drift_threshold < 0:
            raise ValueError("max_rank must be >= 1 and drift_threshold >= 0")

    @property
    def root(self) -> Path:
        return Path(self.registry_dir) if self.registry_dir else var_dir() / "adapters"


@dataclass(frozen=True)
class Base:
    """The base model adapters are checked against: a calibrated runner, its fingerprint, the probe set."""

    runner: LlamaRunner
    fields: dict[str, str]
    probe_set: ProbeSet

    @property
    def digest(self) -> str:
        return fingerprint.digest(self.fields)


@dataclass(frozen=True)
class AdapterState:
    id: str
    version: str
    state: str                 # "accepted" | "refused"
    reason: str = ""
    detail: str = ""
    slot: int = 0
    drift: dict | None = None
    created_at: str = ""
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.id}@{self.version}"


@dataclass(frozen=True)
class AdapterTable:
    """The registry as a running replica sees it: every version's state and the accepted ones' slots."""

    states: tuple[AdapterState, ...] = ()
    slots: LoraSlots | None = None
    base_fingerprint: str = ""

    def resolve(self, name: str) -> tuple[int, str]:
        """(slot, "id@version") of a request's adapter ("" -> the base: (0, "")). "id" takes its newest
        accepted version. NotFound(ADAPTER_NOT_FOUND) or PreconditionFailed(ADAPTER_REFUSED); never the base."""
        if not name:
            return 0, ""
        adapter_id, _, version = name.partition("@")
        versions = [s for s in self.states if s.id == adapter_id and (not version or s.version == version)]
        if not versions:
            raise NotFound(f"no adapter {name!r} in this replica's registry", reason="ADAPTER_NOT_FOUND",
                           metadata={"adapter": name[:128]})
        accepted = [s for s in versions if s.state == "accepted"]
        if accepted:
            best = max(accepted, key=lambda s: (s.created_at, s.version))
            return best.slot, best.name
        newest = max(versions, key=lambda s: (s.created_at, s.version))
        raise PreconditionFailed(f"adapter {newest.name} was refused at start: {newest.reason}: {newest.detail}",
                                 reason="ADAPTER_REFUSED", metadata={"adapter": newest.name,
                                                                     "refusal_reason": newest.reason})


def check_name(value: str, what: str) -> str:
    if not NAME.match(value or ""):
        raise InvalidInput(f"adapter {what} {value!r} must match {NAME.pattern}", reason="INVALID_ADAPTER_NAME",
                           metadata={"field": what})
    return value


def versions(root: Path) -> list[Path]:
    """Every ID/VERSION directory holding a manifest, in name order."""
    return sorted(p.parent for p in root.glob(f"*/*/{manifest.MANIFEST}") if p.parent.parent.name != "retrain")


def read_running_base(root: Path) -> dict[str, str] | None:
    """The fingerprint fields the inference stage last started with (base.json), or None."""
    try:
        return json.loads((root / "base.json").read_text())["fields"]
    except (OSError, ValueError, KeyError):
        return None


def _static_checks(folder: Path, base: Base, cfg: LoraConfig) -> tuple[Manifest, AdapterWeights]:
    m = manifest.read(folder)
    manifest.check_files(folder, m)
    diff = fingerprint.differing(m.base, base.fields)
    if diff:
        raise PreconditionFailed(
            "base fingerprint differs in " + ", ".join(f"{k} (registered {m.base.get(k)}, running "
                                                       f"{base.fields.get(k)})" for k in diff),
            reason="BASE_FINGERPRINT_MISMATCH", metadata={"fields": ",".join(diff)})
    if m.probe_set_sha256 != base.probe_set.sha256:
        raise PreconditionFailed("the probe set changed since the golden outputs were made",
                                 reason="GOLDEN_MISMATCH", metadata={"fields": "probe_set"})
    spec = peftconfig.parse(json.loads((folder / "adapter_config.json").read_text()), cfg.max_rank)
    return m, read_weights(folder / "adapter_model.safetensors", spec, base.runner.model)


def _base_greedy(base: Base) -> list[tuple[int, ...]]:
    rows = [ProbeRow(p, 0) for p in base.probe_set.prompts]
    return [t.tokens for t in probes.run(base.runner, rows, base.probe_set.continuation_tokens)]


def _probe_checks(base: Base, m: Manifest, folder: Path, slot: int, base_greedy: list, cfg: LoraConfig) -> dict:
    """Teacher-forced run on the golden outputs; returns the drift summary or raises the refusal."""
    rows = [ProbeRow(p, slot, g) for p, g in zip(base.probe_set.prompts, m.golden_ids)]
    traces = probes.run(base.runner, rows, base.probe_set.continuation_tokens)
    for i, (trace, golden) in enumerate(zip(traces, m.golden_ids)):
        if trace.greedy != golden:
            at = next(t for t, (a, b) in enumerate(zip(trace.greedy, golden)) if a != b)
            raise PreconditionFailed(f"probe {i}: greedy token {at} is {trace.greedy[at]}, golden {golden[at]}",
                                     reason="GOLDEN_MISMATCH", metadata={"probe": i, "position": at})
    if list(m.golden_ids) == base_greedy:
        raise PreconditionFailed("greedy outputs equal the base model's on every probe",
                                 reason="ADAPTER_CHANGES_NOTHING")
    golden = load_file(str(folder / manifest.GOLDEN))
    kl = torch.cat([probes.kl_recorded(golden["ids"][i].long(), golden["logprobs"][i], t.logprobs)
                    for i, t in enumerate(traces)])
    drift = probes.summary(kl, DRIFT_DIRECTION)
    if max(drift["mean"], drift["p95"]) > cfg.drift_threshold:
        detail = f"drift {DRIFT_DIRECTION} mean {drift['mean']:.4f}, p95 {drift['p95']:.4f} > {cfg.drift_threshold}"
        if cfg.drift_action == "refuse":
            raise PreconditionFailed(detail, reason="ADAPTER_DRIFT", metadata={"mean": drift["mean"],
                                                                               "p95": drift["p95"]})
        log.warning("adapter drift above the threshold; serving it (lora.drift_action: warn)",
                    extra={"adapter": m.name, "drift": drift})
    return drift


def _refused(folder: Path, exc: KeelError) -> AdapterState:
    state = AdapterState(folder.parent.name, folder.name, "refused", exc.reason, exc.message,
                         metadata=dict(exc.metadata))
    log.warning("adapter refused", extra={"adapter": state.name, "reason": exc.reason, "detail": exc.message,
                                          **{f"refusal_{k}": v for k, v in exc.metadata.items()}})
    return state


def load_registry(cfg: LoraConfig, base: Base) -> AdapterTable:
    """Check every registered version against the running base (module docstring); the accepted ones
    are loaded into the runner's slots. Also records the running base in base.json."""
    root = cfg.root
    _write_base(root, base)
    states: dict[Path, AdapterState] = {}
    candidates: list[tuple[Path, Manifest, AdapterWeights]] = []
    for folder in versions(root):
        try:
            m, w = _static_checks(folder, base, cfg)
            candidates.append((folder, m, w))
        except KeelError as exc:
            states[folder] = _refused(folder, exc)
    accepted: list[tuple[Path, Manifest, AdapterWeights, dict]] = []
    if candidates:
        base.runner.lora = None
        greedy = _base_greedy(base)
        base.runner.lora = LoraSlots([w for _, _, w in candidates], base.runner.model)
        for slot, (folder, m, w) in enumerate(candidates, start=1):
            try:
                accepted.append((folder, m, w, _probe_checks(base, m, folder, slot, greedy, cfg)))
            except KeelError as exc:
                states[folder] = _refused(folder, exc)
    slots = LoraSlots([w for _, _, w, _ in accepted], base.runner.model) if accepted else None
    base.runner.lora = slots
    for slot, (folder, m, _, drift) in enumerate(accepted, start=1):
        states[folder] = AdapterState(m.id, m.version, "accepted", slot=slot, drift=drift, created_at=m.created_at)
        log.info("adapter accepted", extra={"adapter": m.name, "slot": slot, "drift": drift})
    return AdapterTable(tuple(states[f] for f in sorted(states)), slots, base.digest)


def _write_base(root: Path, base: Base) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / ".base.json.tmp"
        tmp.write_text(json.dumps({"fingerprint": base.digest, "fields": base.fields}, indent=1, sort_keys=True))
        tmp.replace(root / "base.json")
    except OSError as exc:  # a read-only registry still serves; offline tools then lack the running base
        log.warning("cannot record the running base in the registry", extra={"error": str(exc)})


def register(src: Path, adapter_id: str, version: str, base: Base, cfg: LoraConfig,
             training_data_manifest: Path | None = None) -> Manifest:
    """Check a PEFT folder against `base`, make its golden outputs with the engine's runner, and write
    ID/VERSION into the registry (manifest, golden outputs, model card). Raises the refusal it would get."""
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
        base_greedy = _base_greedy(base)
        runner.lora = LoraSlots([weights], runner.model)
        steps = base.probe_set.continuation_tokens
        traces = probes.run(runner, [ProbeRow(p, 1) for p in base.probe_set.prompts], steps)
        golden = [t.tokens for t in traces]
        if golden == base_greedy:
            raise PreconditionFailed("greedy outputs equal the base model's on every probe",
                                     reason="ADAPTER_CHANGES_NOTHING")
        forced = probes.run(runner, [ProbeRow(p, 0, g) for p, g in zip(base.probe_set.prompts, golden)], steps)
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
        created_at=datetime.now(timezone.utc).isoformat(timespec="microseconds"))
    m.write(tmp)
    tmp.replace(dest)
    return m
