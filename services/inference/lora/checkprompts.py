"""The check prompts and the check run: golden outputs at registration, the checks and the drift gate at start.

A check row is one chat of check_prompts.json (rendered and tokenized by Keel's tokenizer) run for a fixed
number of continuation tokens through the engine's own runner (forward.py), with an adapter slot.
A row either decodes greedily (registration: its tokens become the golden outputs) or is
teacher-forced with given tokens (start-up: the golden outputs), so one run gives, at each position,
the greedy choice and the whole next-token distribution. Rows run in fixed groups (`GROUP_ROWS`), so a
row meets the same batch shapes at registration and at start.

Drift is KL(registered || now) per position: the registration keeps the top `TOP_K` log-probabilities
of each position (golden.safetensors); both distributions are compared over those ids plus one bucket
for the rest of the vocabulary (a coarsening, so the value is a lower bound of the full KL).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from services.inference.model.forward import LlamaRunner, Segment

CHECK_PROMPTS_FILE = Path(__file__).with_name("check_prompts.json")
TOP_K = 64
GROUP_ROWS = 12


@dataclass(frozen=True)
class CheckPrompts:
    prompts: tuple[tuple[int, ...], ...]
    continuation_tokens: int

    @property
    def sha256(self) -> str:
        return hashlib.sha256(json.dumps([list(self.prompts), self.continuation_tokens]).encode()).hexdigest()


def load_check_prompts(tokenizer, path: Path = CHECK_PROMPTS_FILE) -> CheckPrompts:
    """The check prompts' chats as token ids, with Keel's chat template and tokenizer (as the gateway sends them)."""
    data = json.loads(path.read_text())
    prompts = tuple(tuple(tokenizer.encode_ids(tokenizer.render_chat([tuple(m) for m in chat])))
                    for chat in data["chats"])
    return CheckPrompts(prompts, data["continuation_tokens"])


@dataclass(frozen=True)
class CheckRow:
    prompt: tuple[int, ...]
    slot: int
    forced: tuple[int, ...] | None = None  # teacher-forced continuation; None: greedy


@dataclass(frozen=True)
class Trace:
    tokens: tuple[int, ...]   # the continuation fed (greedy or forced)
    logprobs: torch.Tensor    # float32 next-token log-probabilities at each position [T, V]

    @property
    def greedy(self) -> tuple[int, ...]:
        return tuple(self.logprobs.argmax(-1).tolist())


def forward_steps(rows: int, steps: int) -> int:
    """How many batched forward steps `run` takes for `rows` rows of `steps` positions."""
    return -(-rows // GROUP_ROWS) * steps


@torch.inference_mode()
def run(runner: LlamaRunner, rows: list[CheckRow], steps: int,
        progress: Callable[[int], None] | None = None) -> list[Trace]:
    """`progress`, when given, is called with 1 after each batched forward step (forward_steps in all)."""
    out = []
    for g in range(0, len(rows), GROUP_ROWS):
        group = rows[g:g + GROUP_ROWS]
        caches = [runner.new_cache(len(r.prompt) + steps) for r in group]
        logits = runner.forward([Segment(c, list(r.prompt), r.slot) for c, r in zip(caches, group)])
        fed, lps = [[] for _ in group], [[] for _ in group]
        for t in range(steps):
            lp = torch.log_softmax(logits.float(), dim=-1)
            for i, r in enumerate(group):
                fed[i].append(r.forced[t] if r.forced is not None else int(lp[i].argmax()))
                lps[i].append(lp[i])
            if progress is not None:
                progress(1)
            if t + 1 < steps:
                logits = runner.forward([Segment(c, [f[-1]], r.slot) for c, f, r in zip(caches, fed, group)])
        out += [Trace(tuple(f), torch.stack(lp)) for f, lp in zip(fed, lps)]
    return out


def top_k(trace: Trace, k: int = TOP_K) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, k] int64, log-probabilities [T, k] float32) of the most likely tokens at each position."""
    values, ids = trace.logprobs.topk(k, dim=-1)
    return ids, values


def kl_recorded(ids: torch.Tensor, recorded: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
    """KL(recorded || now) per position over the recorded top-k ids plus one bucket for the rest [T]."""
    p = recorded.double().exp()
    q_lp = now.double().gather(-1, ids)
    p_rest = (1 - p.sum(-1)).clamp(min=1e-30)
    q_rest = (1 - q_lp.exp().sum(-1)).clamp(min=1e-30)
    kl = (p * (recorded.double() - q_lp)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())
    return kl.clamp(min=0).float()


def kl_full(p_lp: torch.Tensor, q_lp: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position over the whole vocabulary [T]."""
    return (p_lp.double().exp() * (p_lp.double() - q_lp.double())).sum(-1).clamp(min=0).float()


def summary(kl: torch.Tensor, direction: str) -> dict:
    """Mean and 95th percentile (nats per token) of per-position KL values, with their direction."""
    kl = kl.double().flatten()
    return {"mean": float(kl.mean()), "p95": float(torch.quantile(kl, 0.95)),
            "direction": direction, "positions": kl.numel()}
