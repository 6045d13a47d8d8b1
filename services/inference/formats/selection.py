"""Which weight format the stage serves: an explicit one checked against its quality gate, or `auto`.

* An explicit format other than float32 (the reference) must have passed the gate for this very model
  (results stored under var/gate/, keyed by the hash of the weights, by
  `python -m services.inference.formats.gate` or by
  the gate `auto` runs in the background, startgate.py); a
  format that failed, or was never gated, stops the stage with a ConfigError (exit 2) unless
  `formats.force` is set.
* `auto` keeps the candidates that pass the gate (float32 always does) and whose linear layers give a
  row the same bits whatever the batch size, M = 1..17 (float32's MKL kernels do not at small M; the
  engine pads float32 passes to sizes that do, so float32 is timed at its padded size), and whose
  whole decode steps give a row the same logits beside other rows as alone (`step_invariant`). It then times
  a decode-like pass (one token per row, every layer and lm_head) at batch 1 and at the largest
  batch, and serves the format with the lowest sum of the two. A sole candidate passing the gate
  (float32 when no gate was run) is served without timing.
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.inference.formats import quality
from services.inference.formats.quality import GateResult, GateThresholds
from services.inference.model.forward import LlamaRunner
from services.inference.model.loader import check_format, model_in_format, residual_dtype
from shared.config import ConfigError, var_dir
from shared.errors import InvalidInput

log = logging.getLogger(__name__)

REFERENCE = "float32"
INVARIANCE_ROWS = 17  # the widest batch the row check compares against (M = 1..17)
STEP_PROMPTS = (29, 37, 41, 52)  # prompt lengths of the decode-step check
STEP_DECODES = 6


@dataclass(frozen=True)
class FormatsConfig:
    gate: GateThresholds = field(default_factory=GateThresholds)
    force: bool = False  # serve an explicit format even when it failed or never ran the gate
    auto_candidates: tuple[str, ...] = ("float32", "int8", "gguf")
    # engine.format auto: a candidate with no stored gate result is gated while the stage serves (startgate.py)
    gate_at_start: bool = True
    gate_prompts: int | None = None  # the first N prompts of gate_prompts.json; None: all of them


@dataclass(frozen=True)
class FormatChoice:
    format: str
    reason: str
    gate: GateResult | None


def gate_path(model_sha: str) -> Path:
    return var_dir() / "gate" / f"{model_sha}.json"


def verdict(format: str, results: dict[str, GateResult], limits: GateThresholds) -> tuple[bool, str]:
    """(passes, why) for one format against the stored gate results of the model."""
    if format == REFERENCE:
        return True, "float32 is the reference the gate compares with"
    result = results.get(format)
    if result is None:
        return False, (f"{format} has no gate result for this model (run `make gate`, or start with "
                       "engine.format auto and formats.gate_at_start)")
    failures = result.failures(limits)
    if failures:
        return False, f"{format} fails the quality gate: " + "; ".join(failures)
    return True, (f"{format} passes the quality gate (mean KL {result.kl_mean:.4f}, p95 KL {result.kl_p95:.4f}, "
                  f"greedy agreement {result.greedy_agreement:.3f})")


def check_explicit(format: str, model_sha: str, cfg: FormatsConfig, field: str = "engine.format") -> FormatChoice:
    """The choice for an explicit format (`engine.format`, or the config `field` that names it, e.g. a
    variant's); ConfigError when it is not allowed to serve."""
    results = quality.load(gate_path(model_sha), model_sha)
    ok, why = verdict(format, results, cfg.gate)
    if not ok and not cfg.force:
        raise ConfigError(f"field '{field}' breaks rule 'quality gate': {why}; "
                          "set formats.force: true to serve it anyway")
    if not ok:
        log.warning("serving a format that did not pass the quality gate (formats.force)",
                    extra={"field": field, "why": why})
    return FormatChoice(format, ("forced: " if not ok else "configured: ") + why, results.get(format))


def invariant_sizes(model: torch.nn.Module, seed: int = 0) -> tuple[int, ...]:
    """Batch sizes M (1..17) at which every row of a linear equals the same row inside a batch of 17.

    Checked on one attention projection, one MLP projection and lm_head with random activations.
    """
    gen = torch.Generator().manual_seed(seed)
    layer = model.model.layers[0]
    dense = (layer.self_attn.q_proj, layer.mlp.down_proj, model.lm_head)
    torch_dtype = residual_dtype(model)
    refs = []
    for lin in dense:
        xs = torch.randn(INVARIANCE_ROWS, lin.in_features, generator=gen).to(torch_dtype)
        refs.append((lin, xs, lin(xs)))
    with torch.inference_mode():
        return tuple(m for m in range(1, INVARIANCE_ROWS + 1)
                     if all(torch.equal(lin(xs[:m]), full[:m]) for lin, xs, full in refs))


@torch.inference_mode()
def step_invariant(model: torch.nn.Module, device: str) -> bool:
    """Whether whole decode steps give each row the same logits beside other rows as alone.

    Fixed pseudo-random prompts are prefilled one by one, then decoded together and alone, and every
    logit is compared bitwise. A linear that passes the row check on random activations can still
    round a real activation differently in another batch shape; bfloat16 outputs hide most such
    differences, so only whole steps on the model's own activations show them.
    """
    runner = LlamaRunner(model, device)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in STEP_PROMPTS]

    def run(rows: list[int]) -> list[torch.Tensor]:  # per step: logits [len(rows), V]
        caches = [runner.new_cache(max(STEP_PROMPTS) + STEP_DECODES) for _ in rows]
        for cache, i in zip(caches, rows):
            runner.prefill(prompts[i], cache)
        return [runner.decode([3 + s] * len(rows), caches) for s in range(STEP_DECODES)]

    together = run(list(range(len(prompts))))
    for i in range(len(prompts)):
        alone = run([i])
        if not all(torch.equal(together[s][i], alone[s][0]) for s in range(STEP_DECODES)):
            return False
    return True


@torch.inference_mode()
def decode_pass_s(model: torch.nn.Module, rows: int, repeats: int = 3) -> float:
    """Median seconds of one decode-like pass: `rows` one-token rows through every layer and lm_head."""
    ids = torch.arange(3, 3 + rows, device=model.device)[:, None]
    model(ids)  # first call pays one-time kernel setup
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(ids)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# How `auto` reports a format that passed its gate and was then measured on the host.
TIMED = "decode pass"
NOT_ROW_INVARIANT = "rows not batch-invariant"
STEP_NOT_INVARIANT = "a decode step gives a row other bits beside other rows than alone"
GATING = "its quality gate runs in the background; preloaded as a variant the stage switches to if it wins"


def choose_auto(reference: torch.nn.Module, model_sha: str, cfg: FormatsConfig, max_batch: int,
                device: str, model_dir: Path, gating: tuple[str, ...] = ()) -> tuple[FormatChoice, torch.nn.Module]:
    """Pick the fastest candidate that passes the gate and is batch-invariant; returns it converted.
    `gating`: candidates whose gate runs in the background (startgate.py); the reference is then
    eligible whether or not it is a candidate, so the stage serves while they are gated."""
    results = quality.load(gate_path(model_sha), model_sha)
    report, best = {}, None
    gated = []
    candidates = cfg.auto_candidates if not gating else tuple(dict.fromkeys((REFERENCE, *cfg.auto_candidates)))
    for format in candidates:
        if format in gating:
            report[format] = GATING
            continue
        try:
            check_format(format, device, model_dir=model_dir)
        except InvalidInput as exc:
            report[format] = str(exc)
            continue
        ok, why = verdict(format, results, cfg.gate)
        if ok:
            gated.append(format)
        else:
            report[format] = why
    for format in gated:
        model = model_in_format(reference, format, model_dir, device)
        sizes = invariant_sizes(model)
        if format != REFERENCE and len(sizes) < INVARIANCE_ROWS:
            report[format] = f"{NOT_ROW_INVARIANT} at M = {sorted(set(range(1, INVARIANCE_ROWS + 1)) - set(sizes))}"
            continue
        if format != REFERENCE and not step_invariant(model, device):
            report[format] = STEP_NOT_INVARIANT
            continue
        if len(gated) == 1:  # nothing to compare with: timing it would only slow the start down
            report[format] = "the only candidate that passes the gate (not timed)"
            best = (0.0, format, model)
            break
        one = min(sizes, default=1)  # the engine pads a float32 pass of 1 row to this size
        big = next((m for m in sizes if m >= max_batch), max_batch)
        t1, tb = decode_pass_s(model, one), decode_pass_s(model, big)
        report[format] = f"{TIMED} {t1 * 1e3:.1f} ms at batch 1 (as {one}), {tb * 1e3:.1f} ms at batch {big}"
        if best is None or t1 + tb < best[0]:
            best = (t1 + tb, format, model)
        del model
    if best is None:
        raise ConfigError("field 'formats.auto_candidates' breaks rule 'eligible': no candidate passes the "
                          "gate and the batch-invariance check: " + "; ".join(f"{k}: {v}" for k, v in report.items()))
    _, format, model = best
    why = "the only eligible format" if len(gated) == 1 else "the fastest eligible format on this host"
    reason = f"auto: {format} is {why}; " + "; ".join(
        f"{k}: {v}" for k, v in report.items())
    log.info("weight format chosen", extra={"format": format, "candidates": report})
    return FormatChoice(format, reason, results.get(format)), model
