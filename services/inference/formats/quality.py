"""The quality gate of a weight format: how far its next-token distributions are from float32's.

Teacher-forced: reference and candidate read the same token sequences (a prompt followed by float32's
greedy answer), and at every answer position we compare the two next-token distributions:
  * KL(float32 || candidate) in nats, the mean and the 95th percentile over all scored positions;
  * greedy agreement, the share of positions where both put their maximum on the same token.
Teacher forcing keeps one early disagreement from derailing the rest of a sequence, so each position
is judged on its own. The gate over the 200 prompts of gate_prompts.json is run by
`python -m services.inference.formats.gate`
(`make gate`) or, for the `auto` candidates still lacking a result, by the stage in the background
(startgate.py); both store the results with `store()`, and every start reads them.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from shared.jsonfile import write_json


@dataclass(frozen=True)
class GateThresholds:
    kl_mean_max: float = 0.05      # nats per token
    kl_p95_max: float = 0.2
    greedy_agreement_min: float = 0.9


@dataclass(frozen=True)
class GateResult:
    format: str
    kl_mean: float
    kl_p95: float
    greedy_agreement: float
    positions: int
    sequences: int

    def failures(self, limits: GateThresholds) -> list[str]:
        """Each broken threshold, in words; empty when the format passes."""
        out = []
        if not self.kl_mean <= limits.kl_mean_max:
            out.append(f"mean KL {self.kl_mean:.4f} > {limits.kl_mean_max}")
        if not self.kl_p95 <= limits.kl_p95_max:
            out.append(f"p95 KL {self.kl_p95:.4f} > {limits.kl_p95_max}")
        if not self.greedy_agreement >= limits.greedy_agreement_min:
            out.append(f"greedy agreement {self.greedy_agreement:.4f} < {limits.greedy_agreement_min}")
        return out

    def passes(self, limits: GateThresholds) -> bool:
        return not self.failures(limits)


@dataclass(frozen=True)
class Sequence:
    """Token ids read by both models; positions >= score_from predict a token that is scored."""

    ids: tuple[int, ...]
    score_from: int


@torch.inference_mode()
def _log_probs(model: torch.nn.Module, seq: Sequence) -> torch.Tensor:
    """float32 log-probabilities of the next token at each scored position [n, V]."""
    ids = torch.tensor([seq.ids[:-1]], device=model.device)
    logits = model(ids).logits[0, seq.score_from - 1:].float()
    return torch.log_softmax(logits, dim=-1)


def evaluate(reference: torch.nn.Module, candidates: dict[str, torch.nn.Module],
             sequences: list[Sequence], progress: Callable[[int], None] | None = None) -> list[GateResult]:
    """Compare each candidate (by format name) with `reference` (float32) over `sequences`;
    `progress(n)` after each sequence, n of them scored."""
    kls: dict[str, list[torch.Tensor]] = {format: [] for format in candidates}
    agree = dict.fromkeys(candidates, 0)
    for i, seq in enumerate(sequences):
        ref = _log_probs(reference, seq)
        for format, model in candidates.items():
            cand = _log_probs(model, seq)
            kls[format].append((ref.exp() * (ref - cand)).sum(-1).clamp(min=0))
            agree[format] += int((ref.argmax(-1) == cand.argmax(-1)).sum())
        if progress is not None:
            progress(i + 1)
    out = []
    for format in candidates:
        kl = torch.cat(kls[format]).double()
        n = kl.numel()
        if bool(torch.isfinite(kl).all()):
            mean, p95 = float(kl.mean()), float(torch.quantile(kl, 0.95))
        else:
            mean = p95 = math.inf
        out.append(GateResult(format, mean, p95, agree[format] / n, n, len(sequences)))
    return out


def store(path: Path, model_sha256: str, results: list[GateResult], prompt_set: str) -> None:
    """Write the results of one model (by the hash of its weights) to `path`, atomically."""
    write_json(path, {"model_sha256": model_sha256, "prompt_set": prompt_set,
                      "formats": {r.format: asdict(r) for r in results}})


def load(path: Path, model_sha256: str) -> dict[str, GateResult]:
    """The stored results for this model, by format; empty when the gate was never run for it."""
    try:
        data = json.loads(path.read_text())
        if data["model_sha256"] != model_sha256:
            return {}
        return {name: GateResult(**r) for name, r in data["formats"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        return {}
