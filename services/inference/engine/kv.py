"""The KV manager: each row's cache blocks and the prefix cache's shared ones, on the step loop's thread.

`KvManager` gives an admitted row its cache (blocks for prompt + max_tokens positions from its
runner's pool), lends it the cached blocks its prompt starts with (its own blocks there go back to
the pool and its prefill resumes after them; not to a row that scores its prompt), and after a
step lets the prefix cache keep each full prompt block the step computed. The loop decides when;
this decides which blocks.
"""
from __future__ import annotations

from services.inference.engine.cachewatch import CacheWatch
from services.inference.engine.executor import BatchExecutor
from services.inference.engine.prefix import PrefixCache, PrefixStats
from services.inference.engine.schedule import Row
from services.inference.model.kvpool import RowCache


class KvManager:
    def __init__(self, executor: BatchExecutor, prefix: PrefixCache | None):
        self.executor = executor
        self.prefix = prefix

    @property
    def prefix_bytes(self) -> int:
        return self.prefix.bytes if self.prefix is not None else 0

    def prefix_stats(self) -> PrefixStats:
        return self.prefix.stats() if self.prefix is not None else PrefixStats()

    def watch(self, watch: CacheWatch) -> None:
        """A WatchCache stream begins: it hears what the prefix cache holds (nothing without one)."""
        if self.prefix is not None:
            self.prefix.watch(watch)
        else:
            watch.resync([])

    def new_cache(self, runner: str, positions: int) -> RowCache:
        """Blocks for `positions` positions from the runner's pool (raises on out of memory)."""
        return self.executor.new_cache(runner, positions)

    def adopt_prefix(self, row: Row) -> None:
        """Hold the cached blocks the row's prompt starts with in its block table; its prefill
        resumes after them. A row that scores its prompt computes all of it: it looks nothing up.
        Either way the row keeps its prompt's block keys, for keep_prefix_blocks."""
        if self.prefix is None:
            return
        req = row.ticket.req
        row.block_keys = self.prefix.keys(req.adapter, req.prompt_ids)
        if row.scores_prompt:
            return
        b = self.prefix.block_tokens
        per = b // row.cache.pool.block_tokens
        for i, blocks in enumerate(self.prefix.lookup(row.prefix_key, row.block_keys, len(req.prompt_ids))):
            row.cache.adopt(i * per, blocks)
            row.cache.length = row.prefilled = (i + 1) * b

    def keep_prefix_blocks(self, chunks: list[tuple[Row, int, int]]) -> None:
        """Let the prefix cache hold each full prompt block a step computed: `chunks` are (row, start,
        tokens) of the step's prefill chunks; only rows whose chunk was committed count."""
        if self.prefix is None:
            return
        b = self.prefix.block_tokens
        for row, start, n in chunks:
            if n == b and row.prefilled == start + n:
                per = b // row.cache.pool.block_tokens
                first = start // b * per
                self.prefix.store(row.prefix_key, row.block_keys[start // b], row.cache.pool,
                                  row.cache.blocks[first:first + per])
