"""Prefix cache: keys and values of full prompt blocks already computed, reused by later requests.

A block is one prefill chunk (`prefill_tokens_per_iteration` tokens, starting at a multiple of it), so
a request that finds its first j blocks here starts its prefill at chunk j, exactly where a request
without a hit would start that chunk with the same cache contents: the answer is bitwise the same.
Blocks are keyed by a hash chain (block i's key covers the runner and every token of blocks 0..i), so
a block is only found after the same whole prefix. An entry holds the KV pool blocks (kvpool.py) the
row that computed it wrote: the pool counts the entry as one more holder, and a row with a hit holds
the same blocks in its block table, so a hit copies nothing. Entries are evicted least recently used
to stay within `capacity_bytes`, room the engine keeps aside from its memory budget and adds to each
pool beyond what admission lends; an evicted block stays lent while a row still holds it.
The step loop thread is the only user.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from services.inference.model.kvpool import KvPool


@dataclass(frozen=True)
class PrefixStats:
    prompt_tokens: int = 0   # prompt tokens of the requests looked up
    hit_tokens: int = 0      # of those, tokens whose keys and values came from the cache
    entries: int = 0
    bytes: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class PrefixCache:
    def __init__(self, block_tokens: int, capacity_bytes: int):
        self.block_tokens = block_tokens
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, tuple[KvPool, list[int]]] = OrderedDict()  # key -> pool, block ids
        self.bytes = 0
        self._prompt_tokens = 0
        self._hit_tokens = 0

    def chain(self, runner: str, prompt: list[int], blocks: int) -> list[bytes]:
        """Keys of the first `blocks` full blocks of the prompt."""
        keys, h = [], hashlib.sha256(runner.encode()).digest()
        b = self.block_tokens
        for i in range(blocks):
            h = hashlib.sha256(h + b"".join(t.to_bytes(4, "little") for t in prompt[i * b:(i + 1) * b])).digest()
            keys.append(h)
        return keys

    def lookup(self, runner: str, prompt: list[int]) -> list[list[int]]:
        """The pool block ids of the longest run of cached blocks the prompt starts with, block by block.

        At least one prompt token is always left to compute: it gives the logits of the first token.
        """
        found = []
        for key in self.chain(runner, prompt, (len(prompt) - 1) // self.block_tokens):
            entry = self._entries.get(key)
            if entry is None:
                break
            self._entries.move_to_end(key)
            found.append(entry[1])
        self._prompt_tokens += len(prompt)
        self._hit_tokens += len(found) * self.block_tokens
        return found

    def store(self, runner: str, prompt: list[int], index: int, pool: KvPool, blocks: list[int]) -> None:
        """Hold the pool blocks of block `index` of the prompt, evicting the least recently used for room."""
        key = self.chain(runner, prompt, index + 1)[-1]
        size = len(blocks) * pool.block_bytes
        if key in self._entries or size > self.capacity_bytes:
            return
        while self.bytes + size > self.capacity_bytes:
            _, (old_pool, old) = self._entries.popitem(last=False)
            old_pool.release(old)
            self.bytes -= len(old) * old_pool.block_bytes
        pool.share(blocks)
        self._entries[key] = (pool, list(blocks))
        self.bytes += size

    def stats(self) -> PrefixStats:
        return PrefixStats(self._prompt_tokens, self._hit_tokens, len(self._entries), self.bytes)
