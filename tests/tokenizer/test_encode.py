"""encode(): truncation and padding made explicit, position ids, fingerprints, and bad input."""
from __future__ import annotations

import hashlib
from array import array

import pytest

from services.tokenizer.core import EncodeOptions
from shared.encoding import fingerprint
from shared.errors import InvalidInput

TEXT = "The quick brown fox jumps over the lazy dog"


def ids_of(tok):
    return tok.encode_ids(TEXT)


def test_plain_encoding(tok, ref_ids):
    enc = tok.encode(TEXT)
    assert enc.input_ids == ref_ids(TEXT)
    assert enc.attention_mask == [1] * len(enc.input_ids)
    assert enc.position_ids == list(range(len(enc.input_ids)))
    assert not enc.truncated and enc.original_length == len(enc.input_ids)


def test_bytes_input_equals_str_input(tok):
    assert tok.encode("héllo 世界".encode()) == tok.encode("héllo 世界")


@pytest.mark.parametrize("side, keep", [("left", slice(-4, None)), ("right", slice(0, 4))])
def test_truncation_is_reported(tok, side, keep):
    full = ids_of(tok)
    enc = tok.encode(TEXT, EncodeOptions(max_length=4, truncation_side=side))
    assert enc.input_ids == full[keep]
    assert enc.truncated and enc.original_length == len(full)
    assert enc.attention_mask == [1] * 4 and enc.position_ids == [0, 1, 2, 3]


def test_exact_length_is_not_truncation(tok):
    n = len(ids_of(tok))
    enc = tok.encode(TEXT, EncodeOptions(max_length=n))
    assert not enc.truncated and enc.original_length == n


def test_left_padding(tok):
    full = ids_of(tok)
    pad = 12 - len(full) if len(full) < 12 else pytest.fail("test text too long")
    enc = tok.encode(TEXT, EncodeOptions(max_length=12, pad_to_max_length=True, padding_side="left", pad_token_id=2))
    assert enc.input_ids == [2] * pad + full
    assert enc.attention_mask == [0] * pad + [1] * len(full)
    assert enc.position_ids == [0] * pad + list(range(len(full)))
    assert not enc.truncated


def test_right_padding_with_other_pad_id(tok):
    full = ids_of(tok)
    enc = tok.encode(TEXT, EncodeOptions(max_length=15, pad_to_max_length=True, padding_side="right", pad_token_id=0))
    pad = 15 - len(full)
    assert enc.input_ids == full + [0] * pad
    assert enc.attention_mask == [1] * len(full) + [0] * pad
    assert enc.position_ids == list(range(len(full))) + [0] * pad


def test_truncate_and_pad_together(tok):
    enc = tok.encode(TEXT, EncodeOptions(max_length=3, pad_to_max_length=True))
    assert len(enc.input_ids) == 3 and enc.truncated and enc.attention_mask == [1, 1, 1]


def test_fingerprint_is_sha256_of_the_three_lists(tok):
    enc = tok.encode(TEXT, EncodeOptions(max_length=12, pad_to_max_length=True))
    digest = hashlib.sha256(b"keel.tokenizer.encoding.v1\x00")
    digest.update(len(enc.input_ids).to_bytes(4, "little"))
    for values in (enc.input_ids, enc.attention_mask, enc.position_ids):
        digest.update(array("I", values).tobytes())
    assert enc.fingerprint == digest.hexdigest()
    assert fingerprint(enc.input_ids, enc.attention_mask, enc.position_ids) == enc.fingerprint


def test_fingerprint_tells_masks_apart(tok):
    """Same ids, different padding side: different fingerprints."""
    left = tok.encode("hi", EncodeOptions(max_length=4, pad_to_max_length=True, padding_side="left"))
    right = tok.encode("hi", EncodeOptions(max_length=4, pad_to_max_length=True, padding_side="right"))
    assert sorted(left.input_ids) == sorted(right.input_ids) and left.fingerprint != right.fingerprint


@pytest.mark.parametrize("text, reason", [
    ("", "EMPTY_INPUT"),
    (b"", "EMPTY_INPUT"),
    (b"abc\xff", "INVALID_UTF8"),
    (b"\xc3", "INVALID_UTF8"),  # truncated sequence
    (b"\xed\xa0\x80", "INVALID_UTF8"),  # an encoded surrogate
    (b"\xc0\xaf", "INVALID_UTF8"),  # overlong
    ("lone \ud800 surrogate", "INVALID_UTF8"),
    (None, "INVALID_INPUT_TYPE"),
    (123, "INVALID_INPUT_TYPE"),
    (["a"], "INVALID_INPUT_TYPE"),
])
def test_bad_input(tok, text, reason):
    with pytest.raises(InvalidInput) as err:
        tok.encode(text)
    assert err.value.reason == reason


def test_invalid_utf8_reports_the_offset(tok):
    with pytest.raises(InvalidInput) as err:
        tok.encode(b"ok \xe4\xb8 then")
    assert err.value.metadata["offset"] == "3"


@pytest.mark.parametrize("text", ["x" * 101, "é" * 51, b"x" * 101, "中" * 34])
def test_input_over_the_byte_limit(tok, text):
    with pytest.raises(InvalidInput) as err:
        tok.encode(text, EncodeOptions(max_input_bytes=100))
    assert err.value.reason == "INPUT_TOO_LARGE"


@pytest.mark.parametrize("text", ["x" * 100, "é" * 50, "中" * 33])
def test_input_at_the_byte_limit_is_accepted(tok, text):
    assert tok.encode(text, EncodeOptions(max_input_bytes=100)).input_ids


def test_default_limit_applies_to_encode_ids(tok):
    with pytest.raises(InvalidInput) as err:
        tok.encode_ids("a" * 1_000_001)
    assert err.value.reason == "INPUT_TOO_LARGE"
    assert tok.encode_ids("") == []


@pytest.mark.parametrize("options", [
    {"max_length": 0}, {"max_length": -3}, {"max_length": 2.5}, {"truncation_side": "middle"},
    {"padding_side": "up"}, {"pad_to_max_length": True}, {"pad_token_id": -1}, {"max_input_bytes": 0},
])
def test_bad_options(options):
    with pytest.raises(InvalidInput) as err:
        EncodeOptions(**options)
    assert err.value.reason == "INVALID_OPTIONS"


def test_pad_id_outside_vocabulary(tok):
    with pytest.raises(InvalidInput) as err:
        tok.encode("hi", EncodeOptions(pad_token_id=tok.vocab_size))
    assert err.value.reason == "INVALID_OPTIONS"


def test_options_must_be_encode_options(tok):
    with pytest.raises(InvalidInput):
        tok.encode("hi", {"max_length": 3})


def test_vocabulary_facts(tok):
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.special_tokens["<|im_end|>"] == 2 and len(tok.special_tokens) == 17
