"""The KV cache: one pool of fixed-size blocks per runner, and a block table per row.

Layout: keys and values are each [layers, KV, blocks, block_tokens, D], so gathering the blocks of a
whole batch for one layer is one `index_select` along the block axis, which yields a contiguous
[KV, rows * blocks_per_row, block_tokens, D] tensor, viewed as [KV, rows, capacity, D].

Block 0 is the padding block: never lent, zero forever. A batch pads shorter block tables with it, so
every position a row does not own holds a finite key and value (0), and the attention masks it.
A row's own blocks are zeroed when they are lent: the positions past its length then hold 0 too,
never a former owner's values nor uninitialised memory (a NaN there would survive `0 * NaN`).

The pool tensors are allocated once (`torch.empty`: the OS backs a page only when it is first written)
for as many blocks as the memory budget could ever lend; admission reserves a request's blocks
(prompt + max_tokens) before it runs, so a running row never asks for a block it cannot get.
Blocks are lent lowest id first, so the memory written stays compact. A block may have several
holders (a row and the prefix cache, prefix.py, or several rows that start with the same prompt
blocks): the pool counts them, and a block is free again when its last holder releases it. A shared
block is never written: it holds full prompt positions that every holder has already computed.
The step loop thread is the only user.
"""
from __future__ import annotations

import heapq
import weakref
from dataclasses import dataclass, field

import torch

from services.inference.model.llama import unfilled

PAD_BLOCK = 0


class PoolExhausted(MemoryError):
    """More blocks were asked for than are free (admission prevents it; a MemoryError, so an OOM)."""


class KvPool:
    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, block_tokens: int, blocks: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (n_layers, kv_heads, blocks + 1, block_tokens, head_dim)  # + the padding block
        self.block_tokens = block_tokens
        with unfilled():  # never NaN-filled: that would write (and make resident) the whole pool
            self.keys = torch.empty(shape, dtype=dtype, device=device)
            self.values = torch.empty(shape, dtype=dtype, device=device)
        self.keys[:, :, PAD_BLOCK] = 0
        self.values[:, :, PAD_BLOCK] = 0
        flat = (kv_heads, (blocks + 1) * block_tokens, head_dim)
        self._layers = [(k.view(flat), v.view(flat)) for k, v in zip(self.keys, self.values)]
        self._free = list(range(1, blocks + 1))  # a heap: the lowest free id is lent first
        self._holders = [0] * (blocks + 1)        # per block id: rows and prefix entries holding it

    @property
    def blocks(self) -> int:
        """Blocks that can be lent (the padding block excluded)."""
        return self.keys.shape[2] - 1

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def block_bytes(self) -> int:
        """Keys and values of one block, all layers."""
        return 2 * self.keys[:, :, 0].nbytes

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def allocate(self, tokens: int) -> RowCache:
        """A zeroed cache with room for `tokens` positions; raises PoolExhausted when blocks lack."""
        n = self.blocks_for(tokens)
        if n > len(self._free):
            raise PoolExhausted(f"KV pool: {n} blocks asked for, {len(self._free)} free")
        blocks = [heapq.heappop(self._free) for _ in range(n)]
        for b in blocks:
            self._holders[b] = 1
        index = torch.tensor(blocks, device=self.keys.device)
        self.keys.index_fill_(2, index, 0)
        self.values.index_fill_(2, index, 0)
        return RowCache(self, blocks)

    def share(self, blocks: list[int]) -> None:
        """One more holder for each of these lent blocks."""
        for b in blocks:
            if self._holders[b] < 1:
                raise ValueError(f"KV pool: block {b} is shared while free")
            self._holders[b] += 1

    def release(self, blocks: list[int]) -> None:
        """One holder less for each block; a block nobody holds is free again."""
        for b in blocks:
            self._holders[b] -= 1
            if self._holders[b] == 0:
                heapq.heappush(self._free, b)

    def slots(self, cache: RowCache, start: int, n: int) -> list[int]:
        """Flat positions (block * block_tokens + offset) of the cache's positions start..start+n-1."""
        bt = self.block_tokens
        return [cache.blocks[p // bt] * bt + p % bt for p in range(start, start + n)]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values viewed [KV, blocks * block_tokens, D] (flat positions)."""
        return self._layers[i]


@dataclass(eq=False)
class RowCache:
    """One row's cache: its block table in `pool`; positions < length are valid.

    Its blocks go back to the pool on `release()`, or when the cache is dropped without it."""

    pool: KvPool
    blocks: list[int]
    length: int = 0
    _give_back: weakref.finalize = field(init=False, repr=False)

    def __post_init__(self):
        self._give_back = weakref.finalize(self, self.pool.release, self.blocks)

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.pool.block_tokens

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.pool.block_bytes

    def adopt(self, first: int, blocks: list[int]) -> None:
        """Hold `blocks` (lent to another holder, with the same contents this row would compute) as this
        row's blocks first, first+1, ...; the row's own blocks there go back to the pool."""
        own = self.blocks[first:first + len(blocks)]
        self.pool.share(blocks)
        self.blocks[first:first + len(blocks)] = blocks  # in place: the finalizer releases this list
        self.pool.release(own)

    def release(self) -> None:
        """Give the blocks back to the pool (idempotent)."""
        self._give_back()
        self.blocks = []
