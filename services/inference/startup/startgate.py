"""The quality gate run by the stage itself at start, so that `engine.dtype: auto` can choose among
every candidate on a fresh install instead of serving float32 until someone runs `make gate`.

With `formats.gate_at_start` (the default), a start with `auto` gates the candidates of
`formats.auto_candidates` this device can run that have no stored result for this model: it converts
them from the float32 reference, scores them over the probes of gate_probes.json (gate.evaluate),
adds the results to the model's file under var/gate/ (the file `make gate` writes) and logs each
verdict and how long it took. The start then chooses as always (formats.choose_auto); a failing
candidate is stored too, so a later start finds every candidate gated and runs nothing. The stage
reports NOT_SERVING meanwhile (~100 s for three formats of SmolLM2-135M on 2 cores), and its stage
status says how far the gate is (shared/stagestatus.py).
"""
from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import torch

from shared import stagestatus
from shared.errors import InvalidInput

from services.inference.startup import gate, gateprobes
from services.inference.startup.formats import REFERENCE, FormatsConfig, gate_path
from services.inference.model.loader import check_dtype, model_in_format

log = logging.getLogger(__name__)


def pending(cfg: FormatsConfig, model_sha: str, device: str) -> tuple[str, ...]:
    """The auto candidates this device can run that have no stored gate result for this model."""
    stored = gate.load(gate_path(model_sha), model_sha)

    def runs_here(fmt: str) -> bool:
        try:
            check_dtype(fmt, device)
            return True
        except InvalidInput:
            return False
    return tuple(f for f in cfg.auto_candidates if f != REFERENCE and f not in stored and runs_here(f))


def run(reference: torch.nn.Module, model_sha: str, fmts: tuple[str, ...], cfg: FormatsConfig,
        device: str, model_dir: Path) -> None:
    """Gate `fmts` against `reference` (float32) and add their results to the model's stored ones.

    Skipped, with a warning, when the results could not be stored (a read-only var/): `auto` then
    chooses among the stored results, and a gate run would be lost work at every start."""
    sequences = gateprobes.load(cfg.gate_prompts)
    path = gate_path(model_sha)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path.parent).close()
    except OSError as exc:
        log.warning("quality gate not run at start: its results could not be stored",
                    extra={"formats": list(fmts), "error": str(exc)})
        return
    log.info("running the quality gate at start (no stored result for these formats)",
             extra={"formats": list(fmts), "prompts": len(sequences)})
    t0 = time.perf_counter()
    stagestatus.BOARD.phase(f"gating {', '.join(fmts)}", total=len(sequences))
    results = gate.evaluate(reference, {f: model_in_format(reference, f, model_dir, device) for f in fmts},
                            sequences, progress=stagestatus.BOARD.advance)
    stored = gate.load(path, model_sha)
    try:
        gate.store(path, model_sha, [*(r for f, r in stored.items() if f not in fmts), *results],
                   gateprobes.describe(len(sequences)))
    except OSError as exc:
        log.warning("gate results not stored; the next start runs the gate again", extra={"error": str(exc)})
        return
    verdicts = {r.format: "fails: " + "; ".join(r.failures(cfg.gate)) if r.failures(cfg.gate) else "passes"
                for r in results}
    log.info("quality gate run at start", extra={
        "seconds": round(time.perf_counter() - t0, 1), "stored": str(path), "verdicts": verdicts,
        "results": {r.format: {"kl_mean": r.kl_mean, "kl_p95": r.kl_p95, "greedy_agreement": r.greedy_agreement}
                    for r in results}})
