"""Byte-level BPE over the mapped tables, with bounded per-process caches.

Semantics are those of Hugging Face's ``tokenizers`` BPE (no dropout, no unk): a piece's UTF-8
bytes become byte tokens (bytes missing from the vocabulary are dropped), then the adjacent pair of
lowest merge rank is merged, leftmost first on ties, until no pair has a rank.

Speed comes from not doing that work twice:

* piece cache: piece string -> ids, two generations (a hit in the old one is promoted; when the new
  one fills up it becomes the old one), so memory stays bounded and hot pieces survive;
* stable-token shortcut: on a miss, a piece whose bytes are a vocabulary token that BPE provably
  reproduces (flag set by the compiler) costs one hash probe instead of a merge loop;
* chunking: a boundary between two characters where no vocabulary token contains the adjacent byte
  pair (last byte before, first byte after; table ``UNSAFE_PAIRS``) can never be merged across, so
  BPE(piece) = BPE(left) + BPE(right). Long non-ASCII pieces (Chinese prose has clause-long pieces
  and few multi-character tokens) are cut there, and the chunks (mostly single characters) have a
  cache of their own. Pieces of 3-byte characters (CJK, kana, Hangul) are cut with byte slicing and
  one bytes regex that finds the few unsafe boundaries; others with a per-character loop. A single
  3-byte character missing from the chunk cache is read from the compiler's table (``CHR3``);
* prefill: ``warmup()`` caches the most frequent whole-word tokens, which the compiler listed;
* merge loop: ``min()`` over a rank list for short inputs; a heap (O(n log n)) above
  ``HEAP_MIN_SYMBOLS``, so a 20,000-character run without spaces stays linear-ish.

SentencePiece vocabularies (family ``spm``) run through the same engine: the compiler builds each
character from its byte tokens with "synthetic" merges ranked before every real one, so merging
starts from characters as SentencePiece does, and a synthetic id left at the end (a character, or
part of one, that no token completes) is turned back into its ``<0xXX>`` tokens: the byte fallback.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from itertools import chain, islice

from services.tokenizer.fileformat import CHAR3_END, CHAR3_FIRST, FLAG_STABLE, NO_ID
from services.tokenizer.pretokenize import PreTokenizer
from services.tokenizer.tables import ID_BITS, NO_RANK

HEAP_MIN_SYMBOLS = 96  # below this the list scan (C-level min/index) beats heap bookkeeping
CHUNK_MIN_CHARS = 6  # shorter non-ASCII pieces are cheaper to merge whole than to cut
MAX_CACHED_CHARS = 64  # longer pieces rarely repeat; keeping them would make memory unbounded
# Long non-ASCII pieces (Chinese clauses) are mostly unique (86% seen once in the Chinese bench
# corpus) and would only evict the rest; their chunks are cached instead, which is nearly as fast.
MAX_CACHED_NON_ASCII = 8


@dataclass(frozen=True)
class CacheOptions:
    """Per-process cache bounds in entries; each cache holds at most twice its figure."""

    piece_entries: int = 16384  # ~200 B each for English words
    chunk_entries: int = 8192
    pair_entries: int = 32768  # ~100 B each
    prefill_pieces: int = 4096  # frequent whole-word tokens warmup() caches (fewer than piece_entries)

    def __post_init__(self) -> None:
        if min(self.piece_entries, self.chunk_entries, self.pair_entries) < 1:
            raise ValueError("cache sizes must be positive")
        if self.prefill_pieces < 0:
            raise ValueError("prefill_pieces must not be negative")


@dataclass(frozen=True)
class MergeTables:
    """Views on the mapped file that BPE reads (see fileformat for the sections)."""

    byte_ids: list[int]  # 256 entries, -1 = byte missing from the vocabulary
    rank_of: Callable[[int], int]  # pair key -> rank or NO_RANK (open addressing on the mmap)
    rank_ids: memoryview  # rank -> merged token id
    token_id_of: Callable[[bytes], int]  # token bytes -> id or -1
    flags: memoryview  # u8 per token
    unsafe_pairs: memoryview  # u8[65536]
    max_token_bytes: int
    char3: memoryview  # u32: BPE of each character U+0800..U+FFFF, three slots, NO_ID padded
    # SentencePiece: synthetic id vocab_size + k (a character, or part of one, that no token completes)
    # -> its <0xXX> byte tokens (the byte fallback); empty for byte-level vocabularies.
    vocab_size: int = 0
    expansions: tuple[tuple[int, ...], ...] = ()


class TwoGenerationCache:
    """Bounded map: ``get`` reads the young generation; ``lookup`` also promotes from the old one."""

    __slots__ = ("_limit", "young", "old", "get")

    def __init__(self, limit: int):
        self._limit = limit
        self.clear()

    def clear(self) -> None:
        self.young: dict = {}
        self.old: dict = {}
        self.get = self.young.get

    def lookup(self, key):
        value = self.get(key)
        if value is None:
            value = self.old.get(key)
            if value is not None:
                self.put(key, value)
        return value

    def put(self, key, value) -> None:
        young = self.young
        young[key] = value
        if len(young) >= self._limit:
            self.old = young
            self.young = {}
            self.get = self.young.get

    def __len__(self) -> int:
        return len(self.young) + len(self.old)


class BpeEngine:
    def __init__(self, tables: MergeTables, pretokenizer: PreTokenizer, options: CacheOptions):
        self._t = tables
        self._findall = pretokenizer.fast_findall
        self._ignore_merges = pretokenizer.ignore_merges
        self._exact_findall = pretokenizer.exact_findall
        self._rare = pretokenizer.rare_search
        self._options = options
        self._byte_id = tables.byte_ids.__getitem__
        self._rank_ids = tables.rank_ids
        missing = [b for b in range(256) if tables.byte_ids[b] < 0]
        self._drop = bytes(missing)
        self._missing = bytes(int(b in missing) for b in range(256))
        # Chunking reasons about a character's first and last byte only, which is sound when no
        # continuation byte can be dropped; the 3-byte path also needs every E0-EF lead byte.
        self._chunking = not any(0x80 <= b <= 0xBF for b in missing)
        self._fast3 = self._chunking and not any(0xE0 <= b <= 0xEF for b in missing)
        self._unsafe3 = _unsafe_boundary_regex(tables.unsafe_pairs)
        self._not_rare3 = bytes(b for b in range(256) if b not in pretokenizer.rare_leads3)
        self._pieces = TwoGenerationCache(options.piece_entries)
        self._chunk_cache = TwoGenerationCache(options.chunk_entries)
        self._pairs: dict[int, int] = {}
        self._synthetic = tables.vocab_size if tables.expansions else 0  # 0: nothing to expand

    def cache_sizes(self) -> dict[str, int]:
        return {"pieces": len(self._pieces), "chunks": len(self._chunk_cache), "pairs": len(self._pairs)}

    def prefill(self, words: Iterable[tuple[str, int]]) -> int:
        """Cache (text, id) pairs in the order given, up to ``prefill_pieces``. The compiler chose
        them (section WORDS): each text is one whole piece, holds no rare code point, and BPE of it
        is exactly [id]. Returns how many were cached."""
        limit = min(self._options.prefill_pieces, self._options.piece_entries - 1)
        added = 0
        for text, token in islice(words, limit):
            self._pieces.put(text, (token,))
            added += 1
        return added

    def without_dropped_bytes(self, data: bytes) -> bytes:
        """The bytes BPE actually sees: those missing from the vocabulary are dropped."""
        return data.translate(None, self._drop)

    # -- text -> ids -------------------------------------------------------------------------

    def encode_segment(self, text: str) -> list[int]:
        """Ids of a text that holds no special token."""
        pieces = self._findall(text)
        cache = self._pieces
        if text.isascii():  # usually all hits: no intermediate list; a miss yields None, which chain refuses
            try:
                return list(chain.from_iterable(map(cache.get, pieces)))
            except TypeError:
                pass
        found = list(map(cache.get, pieces))
        old_get = cache.old.get
        k = -1
        try:
            while True:
                k = found.index(None, k + 1)  # jump from miss to miss at C speed
                piece = pieces[k]
                value = old_get(piece)
                if value is None:
                    value = self._piece_ids(piece)
                    if value is None:  # holds a code point the fast pattern misclassifies
                        return self._encode_exact(text)
                if len(piece) <= (MAX_CACHED_CHARS if piece.isascii() else MAX_CACHED_NON_ASCII):
                    cache.put(piece, value)
                found[k] = value
        except ValueError:  # no miss left
            return list(chain.from_iterable(found))

    def _encode_exact(self, text: str) -> list[int]:
        """Rare path, uncached: nothing holding such a code point may ever enter the caches,
        which is what guarantees that every text containing one arrives here."""
        out: list[int] = []
        for piece in self._exact_findall(text):
            data = piece.encode()
            token = self._t.token_id_of(data) if self._ignore_merges else -1
            out += [token] if token >= 0 else self.bpe_bytes(data)
        return out

    def _piece_ids(self, piece: str) -> tuple[int, ...] | None:
        """BPE of one piece, or None when it needs the exact pattern."""
        if self._ignore_merges:  # Llama 3: a piece that is a vocabulary token is that token
            if self._rare is not None and not piece.isascii() and self._rare(piece):
                return None
            token = self._t.token_id_of(piece.encode())
            if token >= 0:
                return (token,)
        if piece.isascii():
            return tuple(self.bpe_bytes(piece.encode()))
        data = piece.encode()
        head = int(piece[0] < "\x80")  # a leading space (or other ASCII) before 3-byte characters
        # No 4-byte character and 3 bytes per character on average: then every one has 3 bytes.
        if self._fast3 and len(data) - head == 3 * (len(piece) - head) and len(piece) > 1 and max(data) < 0xF0:
            if data[head::3].translate(None, self._not_rare3) and self._rare(piece):
                return None
            if ((head and (self._missing[data[0]] or self._t.unsafe_pairs[data[0] << 8 | data[1]]))
                    or (self._unsafe3 is not None and self._unsafe3.search(data, head))):
                chunks = self._chunks3(piece, data, head)
            else:
                chunks = piece  # the common case: every character is a chunk of its own
        else:
            if self._rare is not None and self._rare(piece):
                return None
            if len(piece) < CHUNK_MIN_CHARS or not self._chunking:
                return tuple(self.bpe_bytes(data))
            chunks = self._chunks(piece)
        cache = self._chunk_cache
        found = list(map(cache.get, chunks))
        if None in found:
            for k, value in enumerate(found):
                if value is None:
                    chunk = chunks[k]
                    value = cache.lookup(chunk) or self._chunk_ids(chunk)
                    if len(chunk) <= MAX_CACHED_CHARS:
                        cache.put(chunk, value)
                    found[k] = value
        return tuple(chain.from_iterable(found))

    def _chunk_ids(self, chunk: str) -> tuple[int, ...]:
        """A single 3-byte character is read from the compiler's table; anything else is merged."""
        if len(chunk) == 1 and CHAR3_FIRST <= ord(chunk) < CHAR3_END:
            base = 3 * (ord(chunk) - CHAR3_FIRST)
            return tuple(i for i in self._t.char3[base:base + 3] if i != NO_ID)
        return tuple(self.bpe_bytes(chunk.encode()))

    def _chunks3(self, piece: str, data: bytes, head: int) -> list[str]:
        """Chunks of [ASCII head] + 3-byte characters: every boundary is a cut except those where
        the unsafe-boundary regex matches (found in C, usually none or a few)."""
        chunks = list(piece)
        if head and (self._missing[data[0]] or self._t.unsafe_pairs[data[0] << 8 | data[1]]):
            chunks[0:2] = [chunks[0] + chunks[1]]
            head += 1
        if self._unsafe3 is not None:
            # A match (x, y) ends a character at byte s and starts the next at s + 1.
            for start in reversed([m.start() for m in self._unsafe3.finditer(data, head)]):
                k = (start + 1 - head) // 3 + (head > 0)  # chunk index of the character after
                chunks[k - 1:k + 1] = [chunks[k - 1] + chunks[k]]
        return chunks

    def _chunks(self, piece: str) -> list[str]:
        """General case: walk the characters and cut where the byte pair is safe."""
        unsafe, missing = self._t.unsafe_pairs, self._missing
        out, start, prev_last = [], 0, -1  # prev_last -1: no cut allowed before this character
        for i, ch in enumerate(piece):
            cp = ord(ch)
            if cp < 0x80:
                first = last = cp
            else:
                last = 0x80 | (cp & 0x3F)
                first = (0xC0 | cp >> 6) if cp < 0x800 else (0xE0 | cp >> 12) if cp < 0x10000 else (0xF0 | cp >> 18)
            if missing[first]:  # a dropped byte joins its neighbours: never cut next to it
                prev_last = -1
                continue
            if prev_last >= 0 and not unsafe[prev_last << 8 | first]:
                out.append(piece[start:i])
                start = i
            prev_last = last
        out.append(piece[start:])
        return out

    # -- bytes -> ids ------------------------------------------------------------------------

    def bpe_bytes(self, data: bytes) -> list[int]:
        if len(data) <= self._t.max_token_bytes:
            token = self._t.token_id_of(data)
            if token >= 0 and self._t.flags[token] & FLAG_STABLE:
                return [token]
        ids = list(map(self._byte_id, data.translate(None, self._drop)))
        ids = self._merge_heap(ids) if len(ids) > HEAP_MIN_SYMBOLS else self._merge_list(ids)
        if self._synthetic and max(ids, default=0) >= self._synthetic:  # SentencePiece's byte fallback
            base, expansions = self._synthetic, self._t.expansions
            ids = [j for i in ids for j in (expansions[i - base] if i >= base else (i,))]
        return ids

    def _rank(self, key: int) -> int:
        rank = self._pairs.get(key)
        if rank is None:
            rank = self._t.rank_of(key)
            if len(self._pairs) >= self._options.pair_entries:
                self._pairs.clear()
            self._pairs[key] = rank
        return rank

    def _ranks(self, ids: list[int]) -> list[int]:
        keys = [a << ID_BITS | b for a, b in zip(ids, ids[1:])]
        ranks = list(map(self._pairs.get, keys))
        if None in ranks:
            rank = self._rank
            ranks = [r if r is not None else rank(k) for r, k in zip(ranks, keys)]
        return ranks

    def _merge_list(self, ids: list[int]) -> list[int]:
        """O(n^2) but each step is a C-level min/index over a short list."""
        ranks = self._ranks(ids)  # ranks[i] belongs to the pair (ids[i], ids[i + 1])
        rank, rank_ids = self._rank, self._rank_ids
        while ranks:
            best = min(ranks)
            if best == NO_RANK:
                break
            i = ranks.index(best)  # leftmost of the lowest rank
            new = rank_ids[best]
            ids[i] = new
            del ids[i + 1]
            del ranks[i]
            if i:
                ranks[i - 1] = rank(ids[i - 1] << ID_BITS | new)
            if i < len(ranks):
                ranks[i] = rank(new << ID_BITS | ids[i + 1])
        return ids

    def _merge_heap(self, ids: list[int]) -> list[int]:
        """Same order as _merge_list: a min-heap of (rank, position), stale entries skipped."""
        n = len(ids)
        if n < 2:
            return ids
        rank, rank_ids = self._rank, self._rank_ids
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap = [(r, i) for i, r in enumerate(self._ranks(ids)) if r != NO_RANK]
        heapify(heap)
        while heap:
            best, i = heappop(heap)
            j = nxt[i]
            if j < 0 or ids[i] < 0 or rank(ids[i] << ID_BITS | ids[j]) != best:
                continue  # the pair this entry described has changed
            new = rank_ids[best]
            ids[i] = new
            ids[j] = -1
            k = nxt[j]
            nxt[i] = k
            if k >= 0:
                prv[k] = i
                r = rank(new << ID_BITS | ids[k])
                if r != NO_RANK:
                    heappush(heap, (r, i))
            p = prv[i]
            if p >= 0:
                r = rank(ids[p] << ID_BITS | new)
                if r != NO_RANK:
                    heappush(heap, (r, p))
        return [t for t in ids if t >= 0]


def _unsafe_boundary_regex(unsafe: memoryview) -> re.Pattern | None:
    """Bytes regex for (continuation byte, 3-byte lead byte) pairs that some token contains."""
    branches = []
    for lead in range(0xE0, 0xF0):
        tails = [x for x in range(0x80, 0xC0) if unsafe[x << 8 | lead]]
        if tails:
            branches.append("[" + "".join(f"\\x{x:02x}" for x in tails) + f"]\\x{lead:02x}")
    return re.compile("|".join(branches).encode()) if branches else None
