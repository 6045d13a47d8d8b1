"""Open-addressing hash tables stored in the compiled file, and their lookups over mmap views.

Both tables use linear probing at a load factor of at most 1/2, so a lookup reads ~1.5 slots.
Builders run once in the compiler; lookups are closures over ``memoryview``s of the mapped file, so
no per-process dictionary of the vocabulary or the merges is ever built.

* pair table: key ``left << 18 | right`` (ids < 2^18: vocabularies up to 262143 tokens, Llama 3's and
  Qwen2's included), slot ``(key * GOLDEN64 mod 2^64) >> (64-k)``, value = merge rank. Keys are u64;
  empty slots hold 2^64 - 1, which no pair of ids below 2^18 can produce.
* token table: key = token bytes, slot ``crc32(bytes) & (2^k - 1)``, value = token id + 1 (0 = empty).
"""
from __future__ import annotations

import zlib
from array import array
from collections.abc import Callable, Sequence

ID_BITS = 18  # bits of each id in a pair key
MAX_VOCAB = (1 << ID_BITS) - 1  # ids below it
EMPTY_PAIR = (1 << 64) - 1
NO_RANK = 1 << 31  # "these two symbols never merge"; compares above every real rank
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def table_bits(n_items: int) -> int:
    bits = 4
    while (1 << bits) < 2 * n_items:
        bits += 1
    return bits


def pair_key(left: int, right: int) -> int:
    return left << ID_BITS | right


def build_pair_table(pairs: Sequence[tuple[int, int]],
                     pair_ranks: Sequence[int] | None = None) -> tuple[array, array]:
    """Pairs in rank order (or with ``pair_ranks``, SentencePiece: several pairs may share a rank)
    -> (keys u64, ranks u32), arrays of the same power-of-two length."""
    bits = table_bits(len(pairs))
    mask, shift = (1 << bits) - 1, 64 - bits
    keys = array("Q", [EMPTY_PAIR]) * (1 << bits)
    ranks = array("I", [0]) * (1 << bits)
    for rank, (left, right) in zip(range(len(pairs)) if pair_ranks is None else pair_ranks, pairs):
        key = pair_key(left, right)
        slot = ((key * _GOLDEN) & _MASK64) >> shift
        while keys[slot] != EMPTY_PAIR:
            if keys[slot] == key:
                raise ValueError(f"duplicate merge pair ({left}, {right})")
            slot = (slot + 1) & mask
        keys[slot] = key
        ranks[slot] = rank
    return keys, ranks


def build_token_table(token_bytes: Sequence[bytes | None]) -> array:
    """Token bytes by id (None = leave out) -> u32 slots holding id + 1."""
    present = [(i, b) for i, b in enumerate(token_bytes) if b is not None]
    bits = table_bits(len(present))
    mask = (1 << bits) - 1
    slots = array("I", [0]) * (1 << bits)
    for token_id, data in present:
        slot = zlib.crc32(data) & mask
        while slots[slot]:
            if token_bytes[slots[slot] - 1] == data:
                raise ValueError(f"tokens {slots[slot] - 1} and {token_id} have the same bytes")
            slot = (slot + 1) & mask
        slots[slot] = token_id + 1
    return slots


def pair_rank_lookup(keys: memoryview, ranks: memoryview) -> Callable[[int], int]:
    """key -> rank, or NO_RANK. ``keys`` is a u64 view and ``ranks`` a u32 view of the mapped file."""
    mask = len(keys) - 1
    shift = 64 - mask.bit_length()

    def rank_of(key: int) -> int:
        slot = ((key * _GOLDEN) & _MASK64) >> shift
        while True:
            found = keys[slot]
            if found == key:
                return ranks[slot]
            if found == EMPTY_PAIR:
                return NO_RANK
            slot = (slot + 1) & mask

    return rank_of


def token_id_lookup(slots: memoryview, offsets: memoryview, blob: memoryview) -> Callable[[bytes], int]:
    """bytes -> token id, or -1."""
    mask = len(slots) - 1
    crc32 = zlib.crc32

    def id_of(data: bytes) -> int:
        slot = crc32(data) & mask
        while True:
            entry = slots[slot]
            if not entry:
                return -1
            token = entry - 1
            if blob[offsets[token]:offsets[token + 1]] == data:
                return token
            slot = (slot + 1) & mask

    return id_of
