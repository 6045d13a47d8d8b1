"""BPE engine internals: merge strategies agree, chunking is sound, caches stay bounded and correct,
the rare-code-point path is taken when (and only when) it must be."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.tokenizer import bpe
from services.tokenizer.bpe import CacheOptions, TwoGenerationCache
from services.tokenizer.core import Tokenizer
from tests.tokenizer.conftest import corpus_files, read_corpus

MIXED = st.sampled_from(list("aé中文的一。，ア한Жß ") + ["😀", "\u200d", "\u0301", "\x04", "\U00040000", "x"])
THREE_BYTE = st.characters(min_codepoint=0x800, max_codepoint=0xFFFF, exclude_categories=("Cs",))


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=2, max_size=200))
def test_heap_merge_equals_list_merge(tok, data):
    engine = tok._bpe
    ids = [engine._byte_id(b) for b in engine.without_dropped_bytes(data)]
    assert engine._merge_heap(list(ids)) == engine._merge_list(list(ids))


@settings(max_examples=200, deadline=None)
@given(st.lists(MIXED, min_size=1, max_size=60).map("".join))
def test_chunking_matches_whole_piece_bpe(tok, piece):
    engine = tok._bpe
    assert "".join(engine._chunks(piece)) == piece
    assert engine._piece_ids(piece) == tuple(engine.bpe_bytes(piece.encode()))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["", " ", "x"]), st.text(alphabet=THREE_BYTE, min_size=1, max_size=60))
def test_three_byte_chunking_matches_whole_piece_bpe(tok, head, body):
    engine = tok._bpe
    piece = head + body
    data = piece.encode()
    chunks = engine._chunks3(piece, data, len(head)) if len(piece) > 1 else [piece]
    assert "".join(chunks) == piece
    expected = engine.bpe_bytes(data)
    assert [i for chunk in chunks for i in engine.bpe_bytes(chunk.encode())] == expected
    if tok._pre.rare_search is None or not tok._pre.rare_search(piece):
        assert engine._piece_ids(piece) == tuple(expected)


def test_long_input_takes_the_heap_path(tok, ref_ids, monkeypatch):
    def quadratic(ids):
        assert len(ids) <= bpe.HEAP_MIN_SYMBOLS, "a long input reached the O(n^2) merge"
        return original(ids)

    original = tok._bpe._merge_list
    monkeypatch.setattr(tok._bpe, "_merge_list", quadratic)
    text = "q" * 5_000 + "zx" * 3_000
    assert tok._bpe.bpe_bytes(text.encode()) == ref_ids(text)


def test_two_generation_cache_is_bounded_and_promotes():
    cache = TwoGenerationCache(limit=4)
    for i in range(100):
        cache.put(i, (i,))
        assert len(cache) <= 8
    assert cache.lookup(99) == (99,) and cache.lookup(0) is None
    old_key = next(iter(cache.old))
    assert cache.lookup(old_key) == (old_key,) and old_key in cache.young


def test_prefill_caches_whole_words_with_their_ids(compiled_file, ref_ids):
    fresh = Tokenizer.open(compiled_file, CacheOptions(prefill_pieces=500))
    fresh.warmup()
    words = {key: value for key, value in fresh._bpe._pieces.young.items() if len(value) == 1}
    assert len(words) >= 500
    for text, ids in words.items():
        assert ref_ids(text) == list(ids), text


def test_tiny_caches_still_give_reference_ids(compiled_file, ref_ids):
    tiny = Tokenizer.open(compiled_file, CacheOptions(piece_entries=8, chunk_entries=4, pair_entries=16))
    tiny.warmup()  # prefill is clamped to the cache size
    for path in corpus_files():
        for line in read_corpus(path).split("\n"):
            assert tiny.encode_ids(line) == ref_ids(line), f"{path.name}: {line!r}"
    sizes = tiny.cache_sizes()
    assert sizes["pieces"] <= 16 and sizes["chunks"] <= 8 and sizes["pairs"] <= 16


@pytest.mark.parametrize("options", [{"piece_entries": 0}, {"chunk_entries": -1}, {"pair_entries": 0},
                                     {"prefill_pieces": -1}])
def test_cache_options_reject_non_positive_sizes(options):
    with pytest.raises(ValueError):
        CacheOptions(**options)


@pytest.mark.parametrize("text", ["a\U00010940b", "中文\U000323b0字", "x \U0001246f 1", "\ua7ce\u0558"])
def test_rare_code_points_take_the_exact_path_and_are_never_cached(compiled_file, ref_ids, monkeypatch, text):
    fresh = Tokenizer.open(compiled_file)
    calls = []
    exact = fresh._bpe._encode_exact
    monkeypatch.setattr(fresh._bpe, "_encode_exact", lambda t: calls.append(t) or exact(t))
    for _ in range(2):  # the second time too: nothing cached may bypass the check
        assert fresh.encode_ids(text) == ref_ids(text)
    assert len(calls) == 2
    cached = [*fresh._bpe._pieces.young, *fresh._bpe._pieces.old, *fresh._bpe._chunk_cache.young]
    assert not [key for key in cached if fresh._pre.rare_search(key)]


def test_plain_text_never_takes_the_exact_path(compiled_file, monkeypatch):
    fresh = Tokenizer.open(compiled_file)
    monkeypatch.setattr(fresh._bpe, "_encode_exact", lambda t: pytest.fail(f"exact path for {t!r}"))
    for path in corpus_files():
        if path.name != "unicode_new.txt":
            fresh.encode_ids(read_corpus(path))


def test_code_point_classes_match_reference(tok, ref_ids):
    """Each code point in letter, digit, space and punctuation context, sampled over all planes
    plus every code point the `regex` module classifies differently from the reference."""
    rare = tok._pre.rare_search
    sample = [cp for cp in range(0x80, 0x110000, 97) if not 0xD800 <= cp < 0xE000]
    sample += [cp for cp in range(0x80, 0x110000) if not 0xD800 <= cp < 0xE000 and rare(chr(cp))][::7]
    for cp in sample:
        c = chr(cp)
        text = f"a{c}b {c}1 {c}{c} x{c}  {c}"
        assert tok.encode_ids(text) == ref_ids(text), hex(cp)


def test_three_byte_table_matches_the_merge_loop(tok):
    """The compiler's per-character table (section CHR3) against the runtime merge, every 3rd code point."""
    engine = tok._bpe
    for cp in range(0x800, 0x10000, 3):
        if not 0xD800 <= cp < 0xE000:
            assert engine._chunk_ids(chr(cp)) == tuple(engine.bpe_bytes(chr(cp).encode())), hex(cp)
