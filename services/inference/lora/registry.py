"""The adapter registry: the checks at start, and which adapter a request names (registration.py adds to it).

Layout under `lora.registry_dir` (default var/adapters): ID/VERSION/ per registered version (see
manifest.py), retrain/ for `keel lora verify`'s retrain requests, and base.json, the fingerprint of
the base the inference stage last started with (what offline `keel lora list|verify|register` compare
against). At start every version is checked in this order; the first failure refuses it:
record and files intact (ADAPTER_RECORD_INVALID), base fingerprint (BASE_FINGERPRINT_MISMATCH, the
differing fields named; the weight format is not bound), check prompts unchanged (GOLDEN_MISMATCH), config
understood (UNSUPPORTED_ADAPTER_CONFIG), weights fit the targets (INERT_ADAPTER), then the check run:
greedy outputs equal the golden ones when served in the format they were made in (GOLDEN_MISMATCH),
differ from the base's (ADAPTER_CHANGES_NOTHING), and drift below `drift_threshold` (ADAPTER_DRIFT when
`drift_action` is refuse; in another format than the golden outputs', the drift gate is the check).
A refusal never stops the stage. The accepted versions are loaded into slots 1.. in name order;
nothing is read after that.
The check runs' results may come from the start-up record of an earlier start (startcache.py); the
judgement (`_judge`) is the same either way.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.inference.lora import checkprompts, fingerprint, manifest, peftconfig, startcache
from services.inference.lora.checkprompts import CheckPrompts, CheckRow
from services.inference.lora.manifest import Manifest
from services.inference.lora.weights import read_weights
from services.inference.model.forward import LlamaRunner
from services.inference.model.loraslots import AdapterWeights, LoraSlots
from shared import adapters
from shared.config import var_dir
from shared.errors import InvalidInput, KeelError, NotFound, PreconditionFailed
from shared.jsonfile import write_json

log = logging.getLogger(__name__)

DRIFT_DIRECTION = "KL(registered || now)"


@dataclass(frozen=True)
class LoraConfig:
    """The inference stage's `lora:` block."""

    registry_dir: str = ""        # "" -> adapters/ under the var directory
    max_rank: int = 64
    drift_threshold: float = 0.3  # nats per token, on the mean and on the p95
    drift_action: str = "refuse"  # refuse | warn

    @property
    def root(self) -> Path:
        return Path(self.registry_dir) if self.registry_dir else var_dir() / "adapters"


@dataclass(frozen=True)
class Base:
    """The base model adapters are checked against: a calibrated runner, its fingerprint, the check prompts."""

    runner: LlamaRunner
    fields: dict[str, str]
    check_prompts: CheckPrompts

    @property
    def digest(self) -> str:
        return fingerprint.digest(self.fields)

    @property
    def format(self) -> str:
        """The weight format the runner serves (recorded in the fields, not bound; fingerprint.py)."""
        return self.fields[fingerprint.FORMAT_FIELD]


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
    if not adapters.ID_OR_VERSION.fullmatch(value or ""):
        raise InvalidInput(f"adapter {what} {value!r} must match {adapters.PART}", reason="INVALID_ADAPTER_NAME",
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


def static_checks(folder: Path, base: Base, cfg: LoraConfig) -> tuple[Manifest, AdapterWeights]:
    m = manifest.read(folder)
    manifest.check_files(folder, m)
    diff = fingerprint.differing(m.base, base.fields)
    if diff:
        raise PreconditionFailed(
            "base fingerprint differs in " + ", ".join(f"{k} (registered {m.base.get(k)}, running "
                                                       f"{base.fields.get(k)})" for k in diff),
            reason="BASE_FINGERPRINT_MISMATCH", metadata={"fields": ",".join(diff)})
    if m.check_prompts_sha256 != base.check_prompts.sha256:
        raise PreconditionFailed("the check prompts changed since the golden outputs were made",
                                 reason="GOLDEN_MISMATCH", metadata={"fields": "check_prompts"})
    spec = peftconfig.parse(json.loads((folder / "adapter_config.json").read_text()), cfg.max_rank)
    return m, read_weights(folder / "adapter_model.safetensors", spec, base.runner.model)


def base_greedy(base: Base, progress=None) -> list[tuple[int, ...]]:
    rows = [CheckRow(p, 0) for p in base.check_prompts.prompts]
    return [t.tokens for t in checkprompts.run(base.runner, rows, base.check_prompts.continuation_tokens, progress)]


def drift_of(folder: Path, traces: list) -> dict:
    """KL(registered || now) over the check prompts' golden positions (traces: the teacher-forced run)."""
    return _drift(startcache.adapter_rows(folder, traces))


def _drift(rows: list[dict]) -> dict:
    kl = torch.tensor([kl for r in rows for kl in r["kl"]], dtype=torch.float32)
    return checkprompts.summary(kl, DRIFT_DIRECTION)


def _judge(m: Manifest, rows: list[dict], base_greedy: list, cfg: LoraConfig, serving_format: str) -> dict:
    """Judge one adapter's teacher-forced check rows (startcache.adapter_row: greedy ids and KL per
    position, measured now or reused from the start-up record): the drift summary, or the refusal.

    Greedy equality with the golden outputs is required only in the format they were made in: another
    format legitimately flips near-tied tokens, so there the drift gate alone (KL(registered || now)
    against `drift_threshold`) decides whether the adapter still behaves as registered."""
    same_format = m.base.get(fingerprint.FORMAT_FIELD) == serving_format
    for i, (row, golden) in enumerate(zip(rows, m.golden_ids) if same_format else ()):
        greedy = tuple(row["greedy"])
        if greedy != golden:
            at = next(t for t, (a, b) in enumerate(zip(greedy, golden)) if a != b)
            raise PreconditionFailed(f"check prompt {i}: greedy token {at} is {greedy[at]}, golden {golden[at]}",
                                     reason="GOLDEN_MISMATCH", metadata={"prompt": i, "position": at})
    if list(m.golden_ids) == base_greedy:
        raise PreconditionFailed("greedy outputs equal the base model's on every check prompt",
                                 reason="ADAPTER_CHANGES_NOTHING")
    drift = _drift(rows)
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


def load_registry(cfg: LoraConfig, base: Base, cache: startcache.StartCache | None = None) -> AdapterTable:
    """Check every registered version against the running base (module docstring); the accepted ones
    are loaded into the runner's slots. Also records the running base in base.json. With `cache`, the
    check runs' results are reused where the start-up record verifies (startcache.py)."""
    root = cfg.root
    _write_base(root, base)
    states: dict[Path, AdapterState] = {}
    candidates: list[tuple[Path, Manifest, AdapterWeights]] = []
    for folder in versions(root):
        try:
            m, w = static_checks(folder, base, cfg)
            candidates.append((folder, m, w))
        except KeelError as exc:
            states[folder] = _refused(folder, exc)
    accepted: list[tuple[Path, Manifest, AdapterWeights, dict]] = []
    if candidates:
        base_rows, rows = startcache.check_facts(base, candidates, cache)
        greedy = [tuple(r["tokens"]) for r in base_rows]
        for (folder, m, w), adapter_rows in zip(candidates, rows):
            try:
                accepted.append((folder, m, w, _judge(m, adapter_rows, greedy, cfg, base.format)))
            except KeelError as exc:
                states[folder] = _refused(folder, exc)
    slots = LoraSlots([w for _, _, w, _ in accepted], base.runner.model, base.runner.device) if accepted else None
    base.runner.lora = slots
    for slot, (folder, m, _, drift) in enumerate(accepted, start=1):
        states[folder] = AdapterState(m.id, m.version, "accepted", slot=slot, drift=drift, created_at=m.created_at)
        log.info("adapter accepted", extra={"adapter": m.name, "slot": slot, "drift": drift,
                                            "golden_format": m.base.get(fingerprint.FORMAT_FIELD),
                                            "serving_format": base.format})
    return AdapterTable(tuple(states[f] for f in sorted(states)), slots, base.digest)


def _write_base(root: Path, base: Base) -> None:
    try:
        write_json(root / "base.json", {"fingerprint": base.digest, "fields": base.fields}, sort_keys=True)
    except OSError as exc:  # a read-only registry still serves; offline tools then lack the running base
        log.warning("cannot record the running base in the registry", extra={"error": str(exc)})
