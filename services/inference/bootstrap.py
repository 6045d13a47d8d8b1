"""Start-up of the inference engine: pick the weight format, load the model, warm the engine up.

Runs on the stage's torch thread. A warm start (same engine fingerprint as a stored record, and the
verification probe gives the same bits) loads the recorded format and hands the engine its stored
calibration; a cold start resolves the format (selection.py), measures everything and stores the
record. With `auto`, candidates that have no stored gate result are not waited for: each is preloaded
as a locked variant "auto-<format>" beside the format served now (the reference, or the fastest
candidate whose stored result passes), and the stage gates them in the background once it serves
(startgate.py, background.py). Each phase's duration is logged, so a slow start says where its time
went.
"""
from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace

import torch

from services.inference import warmcache
from services.inference.config import InferenceConfig
from services.inference.engine.core import ENGINE_VERSION, Engine, EngineConfig
from services.inference.engine.warmup import set_deterministic
from services.inference.formats import quality, selection, startgate
from services.inference.lora.startup import check_adapters
from services.inference.model import blocks
from services.inference.model.loader import AUTO, FROM_FILE_ONLY, load_model
from services.inference.warmcache import WarmRecord
from shared import stagestatus

log = logging.getLogger(__name__)
STARTING = "starting the engine"  # the stage status while start_engine runs (shared/stagestatus.py)
CANDIDATE = "auto-{}"  # the variant preloaded for a candidate format gated in the background

# Engine settings a calibration depends on (besides the model, format, torch build, CPU and threads).
CALIBRATION_SETTINGS = ("max_batch_size", "max_context_tokens", "warmup_prompt_tokens", "warmup_max_tokens",
                        "batch_invariant", "device", "intra_op_threads", "kv_block_tokens")


@dataclass(frozen=True)
class Started:
    engine: Engine
    record: WarmRecord
    warm: bool                   # True: the stored calibration was reused
    phases_s: dict[str, float]   # seconds per start-up phase, in order
    candidates: Mapping[str, str]  # locked variant -> format, for the gate to run in the background


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


def fingerprint(cfg: InferenceConfig, e: EngineConfig, model_sha: str) -> dict:
    settings = {k: getattr(e, k) for k in CALIBRATION_SETTINGS}
    settings["fallback_format"] = e.breaker.fallback_format
    settings["variants"] = dict(sorted(e.variants.items()))  # each preloaded format adds to the memory model
    f = cfg.formats
    settings["formats"] = {"gate": f.gate.__dict__, "force": f.force, "auto_candidates": f.auto_candidates}
    # A new gate run can change what auto may pick, so the stored results are part of the key.
    stored = quality.load(selection.gate_path(model_sha), model_sha)
    settings["gate_results"] = {name: asdict(r) for name, r in sorted(stored.items())}
    return warmcache.fingerprint(model_sha, e.format, ENGINE_VERSION, settings)


def _adapters(cfg: InferenceConfig, engine: Engine, model_sha: str, format: str, fp: dict, phases: _Phases) -> None:
    """Check the LoRA registry against this base and preload the accepted adapters (never at request time);
    with warm restarts on, the checks' probe runs are reused from var/warm where they verify."""
    key = warmcache.fingerprint_key(fp) if cfg.warm_restart else ""
    engine.install_adapters(check_adapters(cfg.lora, engine.primary_runner, cfg.model_dir, model_sha, format, key))
    phases.mark("adapters")


def candidate_variants(cfg: InferenceConfig, model_sha: str) -> dict[str, str]:
    """Variant name -> format of each `auto` candidate to gate in the background: those this device
    runs that have no stored gate result, when the results can be stored (else the gate is lost work)."""
    e = cfg.engine
    if e.format != AUTO or not cfg.formats.gate_at_start:
        return {}
    ungated = startgate.pending(cfg.formats, model_sha, e.device, cfg.model_dir)
    if not ungated or not startgate.writable(model_sha):
        return {}
    return {CANDIDATE.format(f): f for f in ungated if CANDIDATE.format(f) not in e.variants}


def start_engine(cfg: InferenceConfig, model_sha: str) -> Started:
    """A warmed engine (not yet started) for the stage, warm from var/warm when possible."""
    phases = _Phases()
    if cfg.engine.intra_op_threads is not None:
        torch.set_num_threads(cfg.engine.intra_op_threads)
    set_deterministic(cfg.engine.device)
    candidates = candidate_variants(cfg, model_sha)
    e = replace(cfg.engine, variants={**cfg.engine.variants, **candidates})
    fp = fingerprint(cfg, e, model_sha)
    record = warmcache.load(fp) if cfg.warm_restart else None
    if record is not None:
        model = load_model(cfg.model_dir, record.format, e.device)
        phases.mark("load_model")
        ok = warmcache.probe_digest(model) == record.probe_digest
        phases.mark("verify_probe")
        if ok:
            engine = Engine(model, replace(e, format=record.format), others=_other_models(cfg, e, record.format),
                            locked=candidates)
            engine.warmup(record.calibration)
            phases.mark("warmup_reused")
            _adapters(cfg, engine, model_sha, record.format, fp, phases)
            log.info("warm start: reusing the stored calibration", extra={"format": record.format,
                                                                          "phases_s": phases.times})
            return Started(engine, record, True, phases.times, candidates)
        log.warning("warm start refused: the verification probe gave different logits; measuring again",
                    extra={"format": record.format})
        del model
    if e.format == AUTO:
        reference = load_model(cfg.model_dir, selection.REFERENCE, e.device)
        phases.mark("load_model")
        choice, model = selection.choose_auto(reference, model_sha, cfg.formats, e.max_batch_size, e.device,
                                            cfg.model_dir, gating=tuple(candidates.values()))
        del reference
        phases.mark("choose_format")
    else:
        choice = selection.check_explicit(e.format, model_sha, cfg.formats)
        model = load_model(cfg.model_dir, e.format, e.device)
        phases.mark("load_model")
    engine = Engine(model, replace(e, format=choice.format), others=_other_models(cfg, e, choice.format),
                    locked=candidates)
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
    return Started(engine, record, False, phases.times, candidates)


def trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (every thread's arena), once the stage's start-up is
    done (server.py). A start reads and repacks every weight through temporary buffers (and `auto`
    loads a float32 reference it then drops), and the grammar engine's vocabulary is built from a parsed
    tokenizer.json; glibc keeps those pages after they are freed, so the stage's RSS would stay above
    what it holds by as much."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator decides
        pass


def _other_models(cfg: InferenceConfig, e: EngineConfig, served: str) -> dict[str, torch.nn.Module]:
    """The variants' and the breaker's formats the engine cannot convert from the served model at warm-up,
    loaded from the weight files: every one when the served model is quantized or gguf (it converts to
    nothing else), and the gguf formats whatever serves (read from the GGUF, never converted)."""
    return {format: load_model(cfg.model_dir, format, e.device) for format in e.other_formats()
            if format != served and (served in FROM_FILE_ONLY or format in blocks.FORMATS)}
