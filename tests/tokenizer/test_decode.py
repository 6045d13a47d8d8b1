"""decode() and the streaming decoder: exact text, whole characters only, bad ids rejected."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.tokenizer.decoding import complete_prefix
from shared.errors import InvalidInput


def test_decode_round_trip(tok):
    text = "Hello, 世界! 👩\u200d💻 x  1\n\tend"
    assert tok.decode(tok.encode_ids(text)) == text


def test_special_tokens_kept_or_skipped(tok):
    ids = tok.encode_ids("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


@pytest.mark.parametrize("ids, reason", [
    ([49152], "TOKEN_ID_OUT_OF_RANGE"),
    ([5, -1], "TOKEN_ID_OUT_OF_RANGE"),
    ([10**12], "TOKEN_ID_OUT_OF_RANGE"),
    ([1.0], "INVALID_TOKEN_ID"),
    ([True], "INVALID_TOKEN_ID"),
    (["7"], "INVALID_TOKEN_ID"),
    ([None], "INVALID_TOKEN_ID"),
    ("123", "INVALID_TOKEN_ID"),
])
def test_bad_ids(tok, ids, reason):
    with pytest.raises(InvalidInput) as err:
        tok.decode(ids)
    assert err.value.reason == reason


def test_out_of_range_names_position_and_id(tok):
    with pytest.raises(InvalidInput) as err:
        tok.decode([1, 2, 99999, 3])
    assert err.value.metadata == {"token_id": "99999", "position": "2", "vocab_size": "49152"}


def test_integer_like_ids_are_accepted(tok):
    class Index:
        def __index__(self):
            return 28

    assert tok.decode([Index(), 28]) == tok.decode([28, 28])


def test_empty_ids(tok):
    assert tok.decode([]) == ""
    stream = tok.stream_decoder()
    assert stream.finish() == ""


def test_emoji_split_across_tokens_comes_out_whole(tok):
    ids = tok.encode_ids("😀")
    assert len(ids) > 1  # the emoji is several byte-level tokens
    stream = tok.stream_decoder()
    pieces = [stream.push(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "😀"
    assert stream.finish() == ""


def test_cjk_streams_character_by_character(tok):
    text = "中文分词"
    stream = tok.stream_decoder()
    emitted = [piece for piece in (stream.push(i) for i in tok.encode_ids(text)) if piece]
    assert "".join(emitted) == text and all(len(piece) >= 1 for piece in emitted)


def test_stream_skips_special_tokens_by_default(tok):
    ids = tok.encode_ids("<|im_start|>hi<|im_end|>")
    plain = tok.stream_decoder()
    assert "".join(plain.push(i) for i in ids) + plain.finish() == "hi"
    keep = tok.stream_decoder(skip_special_tokens=False)
    assert "".join(keep.push(i) for i in ids) + keep.finish() == "<|im_start|>hi<|im_end|>"


def test_stream_flushes_an_unfinished_character_as_replacement(tok):
    first_byte_of_emoji = tok.encode_ids("😀")[0]
    stream = tok.stream_decoder()
    assert stream.push(first_byte_of_emoji) == ""
    assert stream.finish() == tok.decode([first_byte_of_emoji]) == "\ufffd"
    assert stream.finish() == ""  # finish resets


def test_stream_rejects_bad_ids_and_keeps_state(tok):
    ids = tok.encode_ids("😀")
    stream = tok.stream_decoder()
    assert stream.push(ids[0]) == ""
    with pytest.raises(InvalidInput):
        stream.push(-5)
    assert "".join(stream.push(i) for i in ids[1:]) + stream.finish() == "😀"


@pytest.mark.parametrize("data, cut", [
    (b"", 0), (b"abc", 3), (b"\xe4\xb8\xad", 3),  # complete
    (b"a\xe4", 1), (b"a\xe4\xb8", 1), (b"\xf0\x9f\x98", 0),  # valid prefixes are held back
    (b"a\xe0\x80", 3),  # E0 80 can never become valid: nothing to wait for
    (b"a\xed\xa0", 3),  # would be a surrogate
    (b"a\xf4\x90", 3),  # beyond U+10FFFF
    (b"a\xff", 2), (b"a\xc0", 2),  # bytes that start nothing
    (b"\x80\x80\x80\x80", 4),  # continuation bytes only
    (b"\xe4\xb8\xad\x80", 4),  # a complete character plus a stray continuation byte
])
def test_complete_prefix(data, cut):
    assert complete_prefix(data) == cut


# Ids that hold pieces of multi-byte characters, so that random lists often split one.
SPLIT_TEXT = "😀中é👩\u200d💻\ufffd"


@settings(max_examples=300, deadline=None)
@given(picks=st.lists(st.tuples(st.booleans(), st.integers(0, 49151)), max_size=24),
       cuts=st.lists(st.integers(0, 24), max_size=6))
def test_stream_batches_concatenate_to_decode_and_each_prefix_is_a_fresh_decoders_answer(tok, picks, cuts):
    # The gateway's DecodeStream sends ids in batches of any size. A retry on a new stream resends
    # every id so far and skips the text already sent, which relies on the second property.
    pieces = tok.encode_ids(SPLIT_TEXT)
    ids = [pieces[n % len(pieces)] if split else n for split, n in picks]
    bounds = sorted({min(c, len(ids)) for c in cuts} | {len(ids)})
    stream, sent, start = tok.stream_decoder(), "", 0
    for end in bounds:
        sent += stream.extend(ids[start:end])
        assert sent == tok.stream_decoder().extend(ids[:end])
        start = end
    assert sent + stream.finish() == tok.decode(ids, skip_special_tokens=True)
