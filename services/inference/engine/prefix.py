"""Prefix cache: keys and values of full prompt blocks already computed, reused by later requests.

A block is one prefill chunk (`prefill_tokens_per_iteration` tokens, starting at a multiple of it), so
a request that finds its first j blocks here starts its prefill at chunk j, exactly where a request
without a hit would start that chunk with the same cache contents: the answer is bitwise the same.
Blocks are keyed by the runner (its weight format and adapter slot: other keys and values) and by
shared/prefixkeys.py's chain over the adapter the request names and every token of blocks 0..i, so a
block is only found after the same whole prefix, and the gateway computes the same chain key. An entry
holds the KV pool blocks (kvpool.py) the row that computed it wrote: the pool counts the entry as one
more holder, and a row with a hit holds the same blocks in its block table, so a hit copies nothing.
Entries are evicted least recently used to stay within `capacity_bytes`, room the engine keeps aside
from its memory budget and adds to each pool beyond what admission lends; an evicted block stays lent
while a row still holds it.
The step loop thread is the only user. Each WatchCache stream's `CacheWatch` hears of every chain key
the cache begins or ends holding (under whichever runners: the gateway's key has no runner).
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

from services.inference.engine.cachewatch import CacheWatch
from services.inference.model.kvpool import KvPool
from shared import prefixkeys


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
        self._entries: OrderedDict[tuple[str, bytes], tuple[KvPool, list[int]]] = OrderedDict()  # -> pool, block ids
        self._holders: Counter[bytes] = Counter()  # chain key -> runners holding it
        self._watches: list[CacheWatch] = []
        self.bytes = 0
        self._prompt_tokens = 0
        self._hit_tokens = 0

    def keys(self, adapter: str, prompt: list[int]) -> list[bytes]:
        """The chain keys of every full block of the prompt. Hashing the chain reads the whole prompt, so
        the engine computes them once per request (at admission) and hands them to lookup and store."""
        return prefixkeys.chain(adapter, prompt, self.block_tokens, len(prompt) // self.block_tokens)

    def lookup(self, runner: str, keys: list[bytes], prompt_tokens: int) -> list[list[int]]:
        """The pool block ids of the longest run of cached blocks the prompt starts with, block by block
        (`keys`: the prompt's keys(), `prompt_tokens`: its length).

        At least one prompt token is always left to compute: it gives the logits of the first token.
        """
        found = []
        for key in keys[:prefixkeys.cacheable_blocks(prompt_tokens, self.block_tokens)]:
            entry = self._entries.get((runner, key))
            if entry is None:
                break
            self._entries.move_to_end((runner, key))
            found.append(entry[1])
        self._prompt_tokens += prompt_tokens
        self._hit_tokens += len(found) * self.block_tokens
        return found

    def store(self, runner: str, key: bytes, pool: KvPool, blocks: list[int]) -> None:
        """Hold the pool blocks of the prompt block whose chain key is `key`, evicting the least recently
        used for room."""
        size = len(blocks) * pool.block_bytes
        if (runner, key) in self._entries or size > self.capacity_bytes:
            return
        while self.bytes + size > self.capacity_bytes:
            (_, old_key), (old_pool, old) = self._entries.popitem(last=False)
            old_pool.release(old)
            self.bytes -= len(old) * old_pool.block_bytes
            self._holders[old_key] -= 1
            if not self._holders[old_key]:
                del self._holders[old_key]
                self._tell(old_key, False)
        pool.share(blocks)
        self._entries[(runner, key)] = (pool, list(blocks))
        self.bytes += size
        self._holders[key] += 1
        if self._holders[key] == 1:
            self._tell(key, True)

    def watch(self, watch: CacheWatch) -> None:
        """Tell `watch` every key held now, then each change."""
        watch.resync(list(self._holders))
        self._watches.append(watch)

    def _tell(self, key: bytes, stored: bool) -> None:
        self._watches = [w for w in self._watches if not w.closed]
        for w in self._watches:
            if not w.change(key, stored):
                w.resync(list(self._holders))  # it fell behind: everything held, instead of the changes

    def stats(self) -> PrefixStats:
        return PrefixStats(self._prompt_tokens, self._hit_tokens, len(self._entries), self.bytes)
