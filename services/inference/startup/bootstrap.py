"""Start-up of the inference engine: pick the weight format, load the model, warm the engine up.

Runs on the stage's torch thread. A warm start (same engine fingerprint as a stored record, and the
verification probe gives the same bits) loads the recorded format and hands the engine its stored
calibration; a cold start resolves the format (formats.py), measures everything and stores the
record. Before either, `auto` gates the candidates that have no stored gate result (startgate.py), so
the fingerprint, which includes the stored results, already sees them. Each phase's duration is
logged, so a slow start says where its time went.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, replace

import torch

from services.inference.model import blocks
from services.inference.startup import formats, gate, startgate, warmcache
from services.inference.config import InferenceConfig
from services.inference.engine.core import ENGINE_VERSION, Engine
from services.inference.lora.startup import check_adapters
from services.inference.model.loader import AUTO, FROM_FILE_ONLY, load_model
from services.inference.startup.warmcache import WarmRecord
from services.inference.engine.warmup import set_deterministic
from shared import stagestatus

log = logging.getLogger(__name__)
STARTING = "starting the engine"  # the stage status while start_engine runs (shared/stagestatus.py)

# Engine settings a calibration depends on (besides the model, format, torch build, CPU and threads).
CALIBRATION_SETTINGS = ("max_batch_size", "max_context_tokens", "warmup_prompt_tokens", "warmup_max_tokens",
                        "batch_invariant", "device", "intra_op_threads", "kv_block_tokens")


@dataclass(frozen=True)
class Started:
    engine: Engine
    record: WarmRecord
    warm: bool                   # True: the stored calibration was reused
    phases_s: dict[str, float]   # seconds per start-up phase, in order


class _Phases:
    def __init__(self):
        self.times: dict[str, float] = {}
        self._t = time.perf_counter()
        stagestatus.BOARD.phase(STARTING)

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.times[name] = round(now - self._t, 3)
        self._t = now
        stagestatus.BOARD.step_done(name, self.times[name], STARTING)  # `keel up` shows it


def fingerprint(cfg: InferenceConfig, model_sha: str) -> dict:
    e = cfg.engine
    settings = {k: getattr(e, k) for k in CALIBRATION_SETTINGS}
    settings["fallback_dtype"] = e.breaker.fallback_dtype
    settings["variants"] = dict(sorted(e.variants.items()))  # each preloaded format adds to the memory model
    f = cfg.formats
    settings["formats"] = {"gate": f.gate.__dict__, "force": f.force, "auto_candidates": f.auto_candidates}
    # A new gate run can change what auto may pick, so the stored results are part of the key.
    stored = gate.load(formats.gate_path(model_sha), model_sha)
    settings["gate_results"] = {name: asdict(r) for name, r in sorted(stored.items())}
    return warmcache.fingerprint(model_sha, e.dtype, ENGINE_VERSION, settings)


def _adapters(cfg: InferenceConfig, engine: Engine, model_sha: str, fmt: str, fp: dict, phases: _Phases) -> None:
    """Check the LoRA registry against this base and preload the accepted adapters (never at request time);
    with warm restarts on, the checks' probe runs are reused from var/warm where they verify."""
    key = warmcache.fingerprint_key(fp) if cfg.warm_restart else ""
    engine.install_adapters(check_adapters(cfg.lora, engine.primary_runner, cfg.model_dir, model_sha, fmt, key))
    phases.mark("adapters")


def start_engine(cfg: InferenceConfig, model_sha: str) -> Started:
    """A warmed engine (not yet started) for the stage, warm from var/warm when possible."""
    e = cfg.engine
    phases = _Phases()
    if e.intra_op_threads is not None:
        torch.set_num_threads(e.intra_op_threads)
    set_deterministic(e.device)
    reference = None  # the float32 model, once loaded for the gate or for auto
    gating = e.dtype == AUTO and cfg.formats.gate_at_start
    ungated = startgate.pending(cfg.formats, model_sha, e.device) if gating else ()
    if ungated:
        reference = load_model(cfg.model_dir, "float32", e.device)
        phases.mark("load_reference")
        startgate.run(reference, model_sha, ungated, cfg.formats, e.device, cfg.model_dir)
        phases.mark("quality_gate")
    fp = fingerprint(cfg, model_sha)
    record = warmcache.load(fp) if cfg.warm_restart else None
    if record is not None:
        reference = None
        model = load_model(cfg.model_dir, record.format, e.device)
        phases.mark("load_model")
        ok = warmcache.probe_digest(model) == record.probe_digest
        phases.mark("verify_probe")
        if ok:
            engine = Engine(model, replace(e, dtype=record.format), others=_other_models(cfg, record.format))
            engine.warmup(record.calibration)
            phases.mark("warmup_reused")
            _adapters(cfg, engine, model_sha, record.format, fp, phases)
            log.info("warm start: reusing the stored calibration", extra={"format": record.format,
                                                                          "phases_s": phases.times})
            return Started(engine, record, True, phases.times)
        log.warning("warm start refused: the verification probe gave different logits; measuring again",
                    extra={"format": record.format})
        del model
    if e.dtype == AUTO:
        if reference is None:
            reference = load_model(cfg.model_dir, "float32", e.device)
            phases.mark("load_model")
        choice, model = formats.choose_auto(reference, model_sha, cfg.formats, e.max_batch_size, e.device,
                                            cfg.model_dir)
        del reference
        phases.mark("choose_format")
    else:
        choice = formats.check_explicit(e.dtype, model_sha, cfg.formats)
        model = load_model(cfg.model_dir, e.dtype, e.device)
        phases.mark("load_model")
    engine = Engine(model, replace(e, dtype=choice.format), others=_other_models(cfg, choice.format))
    engine.warmup()
    phases.mark("warmup_measured")
    _adapters(cfg, engine, model_sha, choice.format, fp, phases)
    record = WarmRecord(choice.format, choice.reason, choice.gate, engine.calibration,
                        warmcache.probe_digest(model))
    if cfg.warm_restart:
        try:
            warmcache.store(fp, record)
        except OSError as exc:  # a read-only var/ still serves; every start then measures again
            log.warning("warm-start record not stored", extra={"error": str(exc)})
    phases.mark("store_record")
    log.info("cold start: format chosen and engine measured", extra={"format": choice.format,
                                                                     "reason": choice.reason,
                                                                     "phases_s": phases.times})
    return Started(engine, record, False, phases.times)


def _other_models(cfg: InferenceConfig, served: str) -> dict[str, torch.nn.Module]:
    """The variants' and the breaker's formats the engine cannot convert from the served model at warm-up,
    loaded from the weight files: every one when the served model is quantized or gguf (it converts to
    nothing else), and gguf whatever serves (it is read from the GGUF, never converted)."""
    e = cfg.engine
    return {fmt: load_model(cfg.model_dir, fmt, e.device) for fmt in e.other_formats()
            if fmt != served and (served in FROM_FILE_ONLY or fmt == blocks.FORMAT)}
