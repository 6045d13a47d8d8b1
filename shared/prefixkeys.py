"""The keys of a prompt's prefix blocks, one function for the inference engine's prefix cache and the
gateway's router, so that a key the engine reports holding (WatchCache) is the key the gateway computes
for the same prompt.

A prompt is cut into blocks of `block_tokens` tokens; block i's key is a hash chain over the adapter
the request names and every token of blocks 0..i, so a key names a whole prefix: the same block after
a different earlier block has another key.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence


def chain(adapter: str, ids: Sequence[int], block_tokens: int, blocks: int) -> list[bytes]:
    """Keys of the first `blocks` full blocks of `ids` (16 bytes each)."""
    keys, h = [], hashlib.blake2b(adapter.encode(), digest_size=16).digest()
    for i in range(blocks):
        chunk = ids[i * block_tokens:(i + 1) * block_tokens]
        h = hashlib.blake2b(h + b"".join(t.to_bytes(4, "little") for t in chunk), digest_size=16).digest()
        keys.append(h)
    return keys


def cacheable_blocks(prompt_tokens: int, block_tokens: int) -> int:
    """Full blocks of a prompt a prefix cache can serve: the last token never counts (the engine
    computes it whatever it has cached, for the first token's logits)."""
    return max(prompt_tokens - 1, 0) // block_tokens
