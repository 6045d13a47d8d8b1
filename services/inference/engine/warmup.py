"""Warmup: deterministic settings, runners, batch-invariant sizes, and the measured memory model.

Every measurement runs the same operations the scheduler runs for a request (cache allocation, prefill,
sampling, decode step, sampling) on the calling thread, so PeakMeter sees its allocations.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from services.inference.engine.memory import Measurement, MemoryModel, PeakMeter, fit, static_bytes
from services.inference.engine.sampling import Draw, pick
from services.inference.model.forward import LlamaRunner
from services.inference.model.loader import convert_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Calibration:
    """What warm-up measures on this host; an identical engine may be given it instead (warmcache.py)."""

    memory: MemoryModel
    invariant_sizes: dict[str, tuple[int, ...]]  # per runner, keyed by its weight format
    tokens_per_s: float                           # batch-1 decode rate, the scheduler's first estimate


def set_deterministic(device: str) -> None:
    """Deterministic kernels; on CUDA cuBLAS needs its workspace setting before the first GEMM."""
    if torch.device(device).type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    # The flag itself, not torch.use_deterministic_algorithms: that also sets torch._inductor's config,
    # whose import (sympy, mpmath, ~800 modules) costs seconds of every start, for a compiler not used here.
    torch._C._set_deterministic_algorithms(True, warn_only=True)


def build_runners(model: torch.nn.Module, others: Mapping[str, torch.nn.Module], formats: Iterable[str],
                  device: str, max_batch: int, batch_invariant: bool, block_tokens: int) -> dict[str, LlamaRunner]:
    """One runner per weight format, keyed by it: `model`'s own, then each of `formats` (taken from
    `others` when loaded there, else converted from `model`). A format used by several variants, or
    by a variant and the breaker's fallback, is one model in memory."""
    runner = LlamaRunner(model, device, block_tokens)
    runners = {runner.format: runner}
    for format in formats:
        if format not in runners:
            loaded = others[format] if format in others else convert_model(model, format, device)
            runners[format] = LlamaRunner(loaded, device, block_tokens)
    for name, runner in runners.items():
        sizes = runner.calibrate_invariant_sizes(max_batch) if batch_invariant else ()
        log.info("batch-invariant sizes for %s: %s", name, sizes or "none",
                 extra={"runner": name, "format": runner.format, "invariant_sizes": list(sizes)})
    return runners


def measure(runner: LlamaRunner, prompt_tokens: int, max_tokens: int, device: str) -> tuple[Measurement, float]:
    """Measure one request alone, phase by phase; also returns the decode step's wall time."""
    ids = [3 + (i * 7919) % (runner.vocab_size - 3) for i in range(prompt_tokens)]
    cache = runner.new_cache(prompt_tokens + max_tokens)  # blocks of the pool: allocates nothing
    cache_bytes = cache.nbytes
    with PeakMeter(device) as forward:
        logits = runner.prefill(ids, cache)
    with PeakMeter(device) as sample:
        first = pick(logits[None], [Draw(1.0, 0.9, 0, 0, prompt_tokens)])[0]
    del logits
    t0 = time.perf_counter()
    with PeakMeter(device) as decode:
        pick(runner.decode([first.token_id], [cache]), [Draw(1.0, 0.9, 0, 0, prompt_tokens + 1)])
    step_s = time.perf_counter() - t0
    cache.release()
    return Measurement(prompt_tokens, max_tokens, cache_bytes=cache_bytes, prefill_peak=forward.peak,
                 sample_peak=forward.final + sample.peak, decode_peak=decode.peak), step_s


def measure_memory(runners: dict[str, LlamaRunner], prompt_lengths: tuple[int, ...], long_max_tokens: int,
                   device: str) -> tuple[MemoryModel, float]:
    """Fit the memory model for every runner (worst case kept); also returns a batch-1 tokens/s."""
    static = static_bytes(*(r.model for r in runners.values()))
    shapes = [(p, 1) for p in prompt_lengths] + [(min(prompt_lengths), long_max_tokens)]
    merged, step_times = None, []
    for name, runner in runners.items():
        measure(runner, min(prompt_lengths), 1, device)  # first call pays one-time kernel setup
        measurements = []
        for p, m in shapes:
            result, step_s = measure(runner, p, m, device)
            measurements.append(result)
            step_times.append(step_s)
        model = fit(measurements, static, runner.kv_bytes_per_token, runner.block_tokens)
        merged = model if merged is None else merged.merged(model)
    return merged, 1.0 / max(min(step_times), 1e-6)
