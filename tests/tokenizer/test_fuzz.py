"""Property tests against the reference: random text for encode, random ids for decode and streaming."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

VOCAB = 49152
SPECIAL_IDS = list(range(17))

# Pieces that stress the boundaries: special tokens and their fragments, digits in several scripts,
# whitespace kinds, contractions, CJK, emoji sequences, combining marks, bytes missing from the
# vocabulary, and code points the `regex` module classifies differently from the reference.
FRAGMENTS = [
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<reponame>", "<", "|", ">", "<|", "|>",
    "im_", "_start", "1", "9", "٣", "１", "²", "½", "三", " ", "  ", "\t", "\n", "\r\n", "\u00a0", "\u3000",
    "'s", "'S", "'ll", "'", "a", "Z", "é", "e\u0301", "中", "文", "的", "一", "。", "，", "😀", "👩\u200d💻",
    "🇫🇷", "\u200d", "\ufe0f", "\x04", "\x06", "\U00040000", "\U00010940", "\U00011de0", "\U0001246f",
    "hello", " world", "!!", "...", "==", "->", "\\", "$",
]
CONFIG = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@CONFIG
@given(st.text(max_size=120))
def test_encode_random_unicode(tok, ref_ids, text):
    assert tok.encode_ids(text) == ref_ids(text)


@CONFIG
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join))
def test_encode_hostile_fragments(tok, ref_ids, text):
    assert tok.encode_ids(text) == ref_ids(text)


ids_strategy = st.lists(st.one_of(st.integers(0, VOCAB - 1), st.sampled_from(SPECIAL_IDS)), max_size=60)


@CONFIG
@given(ids_strategy, st.booleans())
def test_decode_random_ids(tok, reference, ids, skip):
    assert tok.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


@CONFIG
@given(ids_strategy, st.booleans())
def test_stream_concatenation_equals_decode(tok, ids, skip):
    stream = tok.stream_decoder(skip_special_tokens=skip)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.finish() == tok.decode(ids, skip_special_tokens=skip)


# Characters whose UTF-8 holds no byte missing from the vocabulary (controls, planes 4-11), so
# the text survives a round trip.
ROUND_TRIP_CHARS = st.characters(exclude_categories=("Cs", "Cc")).filter(lambda c: not 0x40000 <= ord(c) <= 0xBFFFF)


@CONFIG
@given(st.text(alphabet=ROUND_TRIP_CHARS, min_size=1, max_size=80))
def test_stream_never_splits_a_character(tok, text):
    """Ids of valid text decode, token by token, into whole characters only: no U+FFFD ever
    appears mid-stream and the pieces add up to the text."""
    ids = tok.encode_ids(text)
    stream = tok.stream_decoder()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.finish() == text
    if "\ufffd" not in text:
        assert all("\ufffd" not in piece for piece in pieces)
