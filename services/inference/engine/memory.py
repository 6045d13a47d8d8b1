"""Memory model: measure what a request really costs at warmup, then predict and admit against a budget.

How it is measured (see docs/inference.md):
  * static bytes: exact sizes of every parameter and buffer of the loaded model(s) (packed int8 weights
    included), since they are resident for the whole process;
  * per request: `PeakMeter` records the peak bytes allocated above the starting point while one request
    runs alone (its cache allocation, the prefill activations, one decode step and sampling).
    On CPU it replays torch's allocator events captured by the profiler (profile_memory=True; each
    event carries the signed byte count of one allocation or free); on CUDA it is
    torch.cuda.max_memory_allocated() after reset_peak_memory_stats().
  * the warm-up measurements' phase peaks are fitted to the model described in MemoryModel.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch._C._autograd import DeviceType
from torch.autograd.profiler import profile

log = logging.getLogger(__name__)


class PeakMeter:
    """Context manager: `.peak` = peak bytes allocated inside the block above the bytes live at entry,
    `.final` = bytes still allocated at exit (same reference point).

    CPU: only allocations made on the calling thread are seen (the profiler hooks are thread-local).
    It is torch.autograd's profiler, not its torch.profiler wrapper: that one's start asks
    `hasattr(torch, "_inductor")`, which imports the compiler (torch._inductor, _dynamo, sympy: ~800
    modules, ~70 MiB resident for the process's life and ~2 s) into a stage that never compiles.
    """

    def __init__(self, device: str = "cpu"):
        self.device = torch.device(device)
        self.peak = 0
        self.final = 0
        self._prof = None
        self._start = 0

    def __enter__(self) -> PeakMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._prof = profile(use_cpu=True, profile_memory=True, use_kineto=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._start
            self.final = torch.cuda.memory_allocated(self.device) - self._start
            return
        self._prof.__exit__(*exc)
        events = [e for e in self._prof.kineto_results.events()
                  if e.name() == "[memory]" and e.device_type() == DeviceType.CPU]
        live = peak = 0
        for e in sorted(events, key=lambda e: e.start_ns()):
            live += e.nbytes()
            peak = max(peak, live)
        self.peak, self.final = peak, live


def static_bytes(*models: torch.nn.Module) -> int:
    """Bytes of every parameter, buffer and packed quantized weight of the given models."""
    total = 0
    seen: set[int] = set()
    for model in models:
        tensors = list(model.parameters()) + list(model.buffers())
        for module in model.modules():
            packed = getattr(module, "_packed_params", None)
            if packed is not None and hasattr(packed, "_weight_bias"):
                weight, bias = packed._weight_bias()
                tensors += [weight] + ([bias] if bias is not None else [])
        for t in tensors:
            key = t.untyped_storage().data_ptr() if not t.is_quantized else id(t)
            if key not in seen:  # tied weights (embedding = lm_head) count once
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


@dataclass(frozen=True)
class MemoryModel:
    """Predicted peak bytes of one request with P prompt tokens and room for M generated tokens:

        decode_bytes_per_token * blocks(P + M) * block_tokens
            + max(fixed_bytes, activation_bytes_per_token * P)

    The request's cache for P + M positions is taken from the KV pool when it starts, in whole blocks
    of block_tokens positions (decode_bytes_per_token per position, so a block costs block_tokens of
    them). On top of it, the largest transient is either the prefill's activations, which grow with
    the prompt, or a constant: the logits and sampling buffers of a step.
    So a prompt token costs prefill_bytes_per_token while it is prefilled, a generated one
    decode_bytes_per_token.
    """

    static_bytes: int
    fixed_bytes: float
    activation_bytes_per_token: float
    decode_bytes_per_token: float
    kv_bytes_per_token: int  # cache bytes per position computed from the config, to compare with the fit
    fit_max_rel_error: float = 0.0
    block_tokens: int = 1    # positions per KV block (engine.kv_block_tokens)

    @property
    def prefill_bytes_per_token(self) -> float:
        return self.decode_bytes_per_token + self.activation_bytes_per_token

    def cache_positions(self, tokens: int) -> int:
        """Positions a cache for `tokens` tokens holds: whole blocks."""
        return -(-tokens // self.block_tokens) * self.block_tokens

    def request_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        """Predicted bytes one request adds on top of static while it runs (its peak)."""
        transient = max(self.fixed_bytes, self.activation_bytes_per_token * prompt_tokens)
        return int(self.decode_bytes_per_token * self.cache_positions(prompt_tokens + max_tokens) + transient)

    def max_total_tokens(self, budget_bytes: int) -> int:
        """Largest prompt + max_tokens that fits an otherwise empty engine, however it is split."""
        room = budget_bytes - self.static_bytes
        by_fixed = (room - self.fixed_bytes) / self.decode_bytes_per_token
        by_prefill = room / self.prefill_bytes_per_token
        n = max(0, int(min(by_fixed, by_prefill)))
        while n > 0 and self.request_bytes(n, 0) > room:  # the last block may round past the room
            n -= 1
        return n

    def pool_blocks(self, budget_bytes: int) -> int:
        """KV blocks the budget could ever lend at once: every request is charged its blocks, so more
        than this many are never reserved together."""
        room = budget_bytes - self.static_bytes
        return max(0, int(room // (self.decode_bytes_per_token * self.block_tokens)))

    def merged(self, other: MemoryModel) -> MemoryModel:
        """Element-wise worst case of two models (primary and fallback runners)."""
        return MemoryModel(
            self.static_bytes, max(self.fixed_bytes, other.fixed_bytes),
            max(self.activation_bytes_per_token, other.activation_bytes_per_token),
            max(self.decode_bytes_per_token, other.decode_bytes_per_token),
            max(self.kv_bytes_per_token, other.kv_bytes_per_token),
            max(self.fit_max_rel_error, other.fit_max_rel_error), self.block_tokens)

    def as_dict(self) -> dict:
        return {"static_bytes": self.static_bytes, "fixed_bytes": round(self.fixed_bytes),
                "prefill_bytes_per_token": round(self.prefill_bytes_per_token, 1),
                "decode_bytes_per_token": round(self.decode_bytes_per_token, 1),
                "activation_bytes_per_token": round(self.activation_bytes_per_token, 1),
                "kv_bytes_per_token": self.kv_bytes_per_token, "block_tokens": self.block_tokens,
                "fit_max_rel_error": round(self.fit_max_rel_error, 4)}


@dataclass(frozen=True)
class Measurement:
    """One request measured alone, phase by phase. Peaks are bytes above the request's own cache."""

    prompt_tokens: int
    max_tokens: int
    cache_bytes: int    # the blocks taken for prompt + max_tokens positions
    prefill_peak: int   # during the prefill forward pass
    sample_peak: int    # while the first token is sampled (prefill logits still live)
    decode_peak: int    # one decode step plus its sampling

    @property
    def total_peak(self) -> int:
        return self.cache_bytes + max(self.prefill_peak, self.sample_peak, self.decode_peak)


def fit(measurements: list[Measurement], static: int, kv_bytes_per_token: int, block_tokens: int = 1) -> MemoryModel:
    """Fit the model: cache slope by least squares, activations from the longest prompt, fixed = max."""
    rounded = [-(-(p.prompt_tokens + p.max_tokens) // block_tokens) * block_tokens for p in measurements]
    positions = np.array([[1.0, n] for n in rounded])
    (_, per_position), *_ = np.linalg.lstsq(positions, np.array([p.cache_bytes for p in measurements], float),
                                            rcond=None)
    longest = max(measurements, key=lambda p: p.prompt_tokens)
    model = MemoryModel(
        static_bytes=static,
        fixed_bytes=float(max(max(p.sample_peak, p.decode_peak) for p in measurements)),
        activation_bytes_per_token=longest.prefill_peak / longest.prompt_tokens,
        decode_bytes_per_token=float(per_position),
        kv_bytes_per_token=kv_bytes_per_token, block_tokens=block_tokens)
    errors = [model.request_bytes(p.prompt_tokens, p.max_tokens) / p.total_peak - 1 for p in measurements]
    model = MemoryModel(**{**model.__dict__, "fit_max_rel_error": max(map(abs, errors))})
    log.info("memory model fitted", extra={"memory_model": model.as_dict()})
    return model
