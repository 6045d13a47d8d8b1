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
Blocks are lent lowest id first, so the memory written stays compact. The step loop thread is the
only user.
"""
from __future__ import annotations

import heapq
import weakref
from dataclasses import dataclass, field

import torch

PAD_BLOCK = 0


class PoolExhausted(MemoryError):
    """More blocks were asked for than are free (admission prevents it; a MemoryError, so an OOM)."""


class KvPool:
    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, block_tokens: int, blocks: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (n_layers, kv_heads, blocks + 1, block_tokens, head_dim)  # + the padding block
        self.block_tokens = block_tokens
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.keys[:, :, PAD_BLOCK] = 0
        self.values[:, :, PAD_BLOCK] = 0
        self._free = list(range(1, blocks + 1))  # a heap: the lowest free id is lent first

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
        index = torch.tensor(blocks, device=self.keys.device)
        self.keys.index_fill_(2, index, 0)
        self.values.index_fill_(2, index, 0)
        return RowCache(self, blocks)

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            heapq.heappush(self._free, b)

    def slots(self, cache: RowCache, start: int, n: int) -> list[int]:
        """Flat positions (block * block_tokens + offset) of the cache's positions start..start+n-1."""
        bt = self.block_tokens
        return [cache.blocks[p // bt] * bt + p % bt for p in range(start, start + n)]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values viewed [KV, blocks * block_tokens, D] (flat positions)."""
        k, v = self.keys[i], self.values[i]
        return k.view(k.shape[0], -1, k.shape[-1]), v.view(v.shape[0], -1, v.shape[-1])


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

    def read(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values at positions start..start+n-1, [layers, KV, n, D] each."""
        index = torch.tensor(self.pool.slots(self, start, n), device=self.pool.keys.device)
        layers = [self.pool.layer(i) for i in range(self.pool.keys.shape[0])]
        return (torch.stack([k.index_select(1, index) for k, _ in layers]),
                torch.stack([v.index_select(1, index) for _, v in layers]))

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys and values [layers, KV, n, D] at positions start..start+n-1 (length is unchanged)."""
        index = torch.tensor(self.pool.slots(self, start, keys.shape[2]), device=keys.device)
        for i in range(keys.shape[0]):
            k, v = self.pool.layer(i)
            k.index_copy_(1, index, keys[i])
            v.index_copy_(1, index, values[i])

    def release(self) -> None:
        """Give the blocks back to the pool (idempotent)."""
        self._give_back()
        self.blocks = []
