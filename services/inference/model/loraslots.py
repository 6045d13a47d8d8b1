"""Accepted adapters' LoRA weights, stacked by slot, and the LoRA term of the forward pass (never merged).
lora/weights.py reads an adapter's weights; this module is the arithmetic the forward pass runs.

For each (layer, projection, rank) that some adapter targets there is one stack A [S, r, in] and one
stack B [S, out, r] in float32, S = adapters + 1, indexed by slot (slot 0, the base model, and the
slots of other ranks stay zero and are never read). A projection no adapter targets costs nothing.

The term for token n with slot s is `(B[s] @ (A[s] @ h_n)) * scaling[s]`, PEFT's unmerged order. It is
computed, for the tokens whose adapter targets the projection, with a per-token gather and
`torch.einsum("ni,nri->nr")` / `einsum("nr,nor->no")` in float32: measured by bench/probes/lora_term.py
(an AVX-512 host, 1 and 2 threads) this gives every row the same bits alone or inside any batch, while a
gathered `torch.bmm` did not (tests/inference/test_lora_forward.py checks the engine's rows). Only rows
with an adapter are computed; base rows are never touched, so a base row is bitwise the same in a batch
with adapters and without. Tokens are taken in chunks of `chunk_tokens`, so a long prefill gathers at
most that many copies of a stack at a time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

CHUNK_TOKENS = 256


class RankScaling(Protocol):
    """What the slots read of an adapter's config (lora/peftconfig.py LoraSpec)."""

    @property
    def rank(self) -> int: ...

    @property
    def scaling(self) -> float: ...


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter's pairs by (layer index, projection name): A [r, in] and B [out, r], float32."""

    spec: RankScaling
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def weight_dims(module: torch.nn.Module) -> tuple[int, int]:
    return module.out_features, module.in_features


class LoraSlots:
    """Slot 0 = base; slot k = adapters[k - 1]. Immutable after construction.

    Stacks are kept per rank: a row is always computed at its own adapter's rank, because zero-padding
    a rank-4 adapter to rank 8 changes the float summation (measured on the tiny model), and an adapter's
    outputs must not depend on which other adapters are loaded.
    """

    def __init__(self, adapters: list[AdapterWeights], model: torch.nn.Module, device: str | torch.device = "cpu",
                 chunk_tokens: int = CHUNK_TOKENS):
        self.count = len(adapters) + 1
        self.chunk_tokens = chunk_tokens
        layers = model.model.layers
        # ranks[name][slot]: the rank of that slot's adapter if it targets `name`, else 0 (no term).
        self.ranks: dict[str, torch.Tensor] = {}
        self.stacks: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for slot, adapter in enumerate(adapters, start=1):
            for (layer, name), (a, b) in adapter.pairs.items():
                rank = adapter.spec.rank
                self.ranks.setdefault(name, torch.zeros(self.count, dtype=torch.long, device=device))[slot] = rank
                if (layer, name, rank) not in self.stacks:
                    proj = getattr(getattr(layers[layer], "self_attn" if name in _ATTN else "mlp"), name)
                    out_f, in_f = weight_dims(proj)
                    self.stacks[(layer, name, rank)] = (torch.zeros(self.count, rank, in_f, device=device),
                                                        torch.zeros(self.count, out_f, rank, device=device))
                a_stack, b_stack = self.stacks[(layer, name, rank)]
                a_stack[slot], b_stack[slot] = a, b
        self.module_ranks = {name: sorted(set(r.tolist()) - {0}) for name, r in self.ranks.items()}
        self.scaling = torch.tensor([0.0] + [a.spec.scaling for a in adapters], device=device)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.stacks.values()) + self.scaling.nbytes

    @property
    def transient_bytes(self) -> int:
        """Largest temporary of one chunk: its gathered A and B stacks (float32)."""
        return max((self.chunk_tokens * (a[0].nbytes + b[0].nbytes) for a, b in self.stacks.values()), default=0)

    def step(self, token_slots: list[int], padded: int, device: torch.device) -> LoraStep:
        """The LoRA term of one forward step whose tokens (padded to `padded` rows) have these slots."""
        slots = torch.tensor(token_slots + [0] * (padded - len(token_slots)), dtype=torch.long, device=device)
        return LoraStep(self, slots)


_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


class LoraStep:
    def __init__(self, lora: LoraSlots, token_slots: torch.Tensor):
        self.lora = lora
        self.token_slots = token_slots
        self._rows: dict[tuple[str, int], torch.Tensor] = {}  # (projection, rank) -> its tokens, per step

    def _rows_for(self, name: str, rank: int) -> torch.Tensor:
        key = (name, rank)
        if key not in self._rows:
            self._rows[key] = (self.lora.ranks[name][self.token_slots] == rank).nonzero()[:, 0]
        return self._rows[key]

    def linear(self, layer: int, name: str, module: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        """module(h) plus, for every token whose adapter targets this projection, its LoRA term."""
        return self.add(layer, name, module(h), h)

    def add(self, layer: int, name: str, y: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """y (the projection's output for h, possibly a column view of a fused one) with the LoRA term
        of every token whose adapter targets this projection added in place."""
        for rank in self.lora.module_ranks.get(name, ()):
            stacks = self.lora.stacks.get((layer, name, rank))
            if stacks is None:
                continue
            a_stack, b_stack = stacks
            rows_all = self._rows_for(name, rank)
            for start in range(0, rows_all.numel(), self.lora.chunk_tokens):
                rows = rows_all[start:start + self.lora.chunk_tokens]
                s = self.token_slots[rows]
                low = torch.einsum("ni,nri->nr", h[rows].float(), a_stack[s])
                delta = torch.einsum("nr,nor->no", low, b_stack[s]) * self.lora.scaling[s][:, None]
                y[rows] = (y[rows].float() + delta).to(y.dtype)
        return y


class NoLora:
    """The step of a batch without adapters: the plain projection."""

    @staticmethod
    def linear(layer: int, name: str, module: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        return module(h)

    @staticmethod
    def add(layer: int, name: str, y: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return y


NO_LORA = NoLora()
