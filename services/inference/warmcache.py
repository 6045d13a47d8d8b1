"""Warm restart: what warm-up measured, kept under var/ and reused by the next start of the same engine.

A record is keyed by the engine fingerprint: the sha256 of the model's weight files, the requested
weight format, torch's version and build configuration (BLAS/MKL/OpenMP), the CPU capability torch
dispatches to, the intra-op thread count, the engine's calibration version and the engine settings
that shape the measurements. It holds the format choice (with its gate result and timings), the
engine's `Calibration` (memory model, batch-invariant sizes, tokens/s) and the digest of a
verification probe. A later start with the same fingerprint loads the model, runs that probe (one
forward pass of a few tokens) and reuses the record only if the logits are the same bits; otherwise,
or when no record matches, it measures again and overwrites the record.

The model's hash is model/digest.py's.
The LoRA start-up checks keep their record beside these, keyed by this fingerprint's key among
other things (lora/startcache.py).
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from services.inference.engine.memory import MemoryModel
from services.inference.engine.warmup import Calibration
from services.inference.formats.quality import GateResult
from services.inference.model import kernels
from shared.config import var_dir
from shared.jsonfile import write_json

log = logging.getLogger(__name__)

PROBE_IDS = (1, 504, 2583, 314, 253, 1142, 28, 30)  # any fixed ids: the probe only needs to be the same


def fingerprint(model_sha: str, requested_format: str, engine_version: int, settings: dict) -> dict:
    """Everything a stored calibration depends on. `settings`: the engine settings that shape it.

    Returned as plain JSON types (tuples become lists), so it compares equal to a stored copy."""
    return json.loads(json.dumps({"model_sha256": model_sha, "format": requested_format, "torch": torch.__version__,
            "build": hashlib.sha256(torch.__config__.show().encode()).hexdigest()[:16],
            "parallel": torch.__config__.parallel_info().splitlines()[0:3],
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "engine_version": engine_version, "kernel": kernel_identity(), "settings": settings}))


def kernel_identity() -> str:
    """Keel's gguf kernels on this host: the paths they run and their build's hash ("" where they cannot load)."""
    try:
        k = kernels.load()
    except kernels.KernelUnavailable:
        return ""
    return f"{k.isa}+{k.q8_isas[0]}/{k.path.parent.name}"


def serving_facts(model_sha: str, served_format: str, engine_version: int) -> dict[str, str]:
    """What decides a served answer besides the request (every reply's ``Finished.engine``): the
    same facts as the warm-start fingerprint, for the format actually served, as strings."""
    return {"weights_sha256": model_sha, "format": served_format, "torch": torch.__version__,
            "blas_build": hashlib.sha256(torch.__config__.show().encode()).hexdigest()[:16],
            "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
            "threads": str(torch.get_num_threads()), "engine_version": str(engine_version),
            "kernel": kernel_identity()}  # every format: the sampler's logprob and entropy (sampling.pick)


def fingerprint_key(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class WarmRecord:
    """What a start measured: the format it serves, why, and the engine's calibration."""

    format: str
    reason: str
    gate: GateResult | None
    calibration: Calibration
    probe_digest: str

    def to_json(self) -> dict:
        cal = self.calibration
        return {"format": self.format, "reason": self.reason, "gate": asdict(self.gate) if self.gate else None,
                "probe_digest": self.probe_digest,
                "calibration": {"memory": asdict(cal.memory), "tokens_per_s": cal.tokens_per_s,
                                "invariant_sizes": {k: list(v) for k, v in cal.invariant_sizes.items()}}}

    @classmethod
    def from_json(cls, data: dict) -> WarmRecord:
        cal = data["calibration"]
        return cls(data["format"], data["reason"], GateResult(**data["gate"]) if data["gate"] else None,
                   Calibration(MemoryModel(**cal["memory"]),
                               {k: tuple(v) for k, v in cal["invariant_sizes"].items()}, cal["tokens_per_s"]),
                   data["probe_digest"])


def _path(fp: dict) -> Path:
    return var_dir() / "warm" / f"engine-{fingerprint_key(fp)}.json"


def load(fp: dict) -> WarmRecord | None:
    """The record stored for exactly this fingerprint, or None."""
    try:
        data = json.loads(_path(fp).read_text())
        if data.get("fingerprint") != fp:
            return None
        return WarmRecord.from_json(data["record"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if not isinstance(exc, FileNotFoundError):
            log.warning("unreadable warm-start record; measuring again", extra={"error": str(exc)})
        return None


def store(fp: dict, record: WarmRecord) -> Path:
    path = _path(fp)
    write_json(path, {"fingerprint": fp, "record": record.to_json()})
    return path


@torch.inference_mode()
def probe_digest(model: torch.nn.Module) -> str:
    """sha256 of the float32 logits of one short forward pass: changes if weights, format or kernels do.

    The pass runs on one intra-op thread, wherever it is recorded or verified: a restart runs it
    before serving, typically while the host is busy (the stages that still serve, others
    restarting), and OpenMP threads stall whenever another process holds a core: on 2 shared
    cores the pass took 3.6-4.2 s with 2 threads, over half of a restart (docs/BENCHMARKS.md)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        logits = model(torch.tensor([PROBE_IDS], device=model.device)).logits.float().cpu()
    finally:
        torch.set_num_threads(threads)
    return hashlib.sha256(logits.numpy().tobytes()).hexdigest()
