"""The adapter record: `keel-adapter.json` (written by registration, read at every start) and its model card.

A version directory of the registry holds the PEFT files (adapter_config.json, adapter_model.safetensors),
this manifest, golden.safetensors (the top-k log-probabilities of the golden outputs, for the drift gate)
and model_card.md. Versions behave like migrations: each records the base it was made against (the
fingerprint fields), the training data version and the library versions, so the registry can say which
adapter versions fit which base.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from shared.errors import PreconditionFailed

log = logging.getLogger("keel.inference.lora")

MANIFEST = "keel-adapter.json"
GOLDEN = "golden.safetensors"
CARD = "model_card.md"
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")
# 2: check_prompts_sha256 was probe_set_sha256 in version 1, which is still read (nothing else changed).
RECORD_VERSION = 2


@dataclass(frozen=True)
class Manifest:
    id: str
    version: str
    base: dict[str, str]            # fingerprint fields (fingerprint.py), with the golden outputs' format
    base_fingerprint: str           # the digest of the bound ones
    training_data_version: str      # sha256 of the training data manifest ("" when none was given)
    rank: int
    alpha: float
    targets: tuple[str, ...]
    use_rslora: bool
    check_prompts_sha256: str
    golden_ids: tuple[tuple[int, ...], ...]  # greedy continuation of each check prompt, made by Keel's engine
    golden_sha256: str              # of golden.safetensors
    files_sha256: dict[str, str]    # of the PEFT files as registered
    kl_vs_base: dict                # KL(adapter || base) on the check prompts at registration: mean, p95, direction
    drift_gate: dict                # how drift is measured at every start: direction, aggregation, top_k, threshold
    created_at: str
    record_version: int = RECORD_VERSION

    @property
    def name(self) -> str:
        return f"{self.id}@{self.version}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    def write(self, folder: Path) -> None:
        (folder / MANIFEST).write_text(self.to_json() + "\n")
        (folder / CARD).write_text(card(self))


def read(folder: Path) -> Manifest:
    """The manifest of a version directory; PreconditionFailed(ADAPTER_RECORD_INVALID) when it is unusable."""
    path = folder / MANIFEST
    try:
        data = json.loads(path.read_text())
        if data.get("record_version") == 1:
            data["check_prompts_sha256"], data["record_version"] = data.pop("probe_set_sha256"), RECORD_VERSION
        if data.get("record_version") != RECORD_VERSION:
            raise ValueError(f"record_version {data.get('record_version')!r}, expected {RECORD_VERSION}")
        data["targets"] = tuple(data["targets"])
        data["golden_ids"] = tuple(tuple(g) for g in data["golden_ids"])
        return Manifest(**data)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        # The message reaches clients (a request naming the adapter): it names the file, not the
        # server's folders; the log has the path.
        log.warning("unreadable adapter manifest", extra={"path": str(path), "error": repr(exc)})
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise PreconditionFailed(f"{MANIFEST} is unreadable ({why})", reason="ADAPTER_RECORD_INVALID",
                                 metadata={"file": MANIFEST}) from exc


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def check_files(folder: Path, m: Manifest) -> None:
    """The PEFT files and golden outputs are the ones registered (ADAPTER_RECORD_INVALID otherwise)."""
    expected = {**m.files_sha256, GOLDEN: m.golden_sha256}
    for name, sha in sorted(expected.items()):
        path = folder / name
        if not path.exists() or file_sha256(path) != sha:
            log.warning("adapter file missing or changed", extra={"path": str(path)})
            raise PreconditionFailed(f"{name} is missing or changed since registration",
                                     reason="ADAPTER_RECORD_INVALID", metadata={"file": name})


def card(m: Manifest) -> str:
    """model_card.md: the record in words."""
    base = "\n".join(f"| {k} | `{v}` |" for k, v in sorted(m.base.items()))
    kl = m.kl_vs_base
    golden = len(m.golden_ids[0]) if m.golden_ids else 0
    return f"""# Adapter {m.name}

LoRA adapter served unmerged by Keel's inference stage (slot-preloaded at warm-up).

- Rank {m.rank}, alpha {m.alpha:g}{', rank-stabilised' if m.use_rslora else ''}; targets: {', '.join(m.targets)}
- Training data version: `{m.training_data_version or 'not given'}`
- Registered: {m.created_at}
- Check prompts: `{m.check_prompts_sha256[:16]}` ({len(m.golden_ids)} prompts x {golden} golden tokens)
- Change against the base on the check prompts, {kl['direction']}: mean {kl['mean']:.4f}, p95 {kl['p95']:.4f} nats/token
- Drift gate: {m.drift_gate['direction']} over the top {m.drift_gate['top_k']} golden log-probabilities per position,
  {m.drift_gate['aggregation']}; threshold {m.drift_gate['threshold']} at registration (lora.drift_threshold)

## Base model it is bound to

Base fingerprint `{m.base_fingerprint}`; any differing field refuses the adapter at start, except
`format`: the weight format the golden outputs were made in (another serving format is checked by
the drift gate instead of exact greedy equality).

| field | value |
|---|---|
{base}

## Checks at every start of the inference stage

Config keys and features understood; one lora_A/lora_B pair per targeted module; greedy outputs on the check prompts
equal to the golden ones above (when served in their format); outputs different from the base model's;
drift (KL registered || now) below the configured threshold.
"""
