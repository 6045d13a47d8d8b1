"""The fingerprint of a tokenized input: the tokenizer stage computes it for every encoding, the
gateway for an input the client sent already tokenized, so both name the same ids alike (logged
with any fault, kept in replay records)."""
from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

_FINGERPRINT_TAG = b"keel.tokenizer.encoding.v1\x00"


def fingerprint(input_ids: Sequence[int], attention_mask: Sequence[int], position_ids: Sequence[int]) -> str:
    """SHA-256 over a tag, the length (u32) and the three lists as u32, all little-endian."""
    digest = hashlib.sha256(_FINGERPRINT_TAG)
    digest.update(len(input_ids).to_bytes(4, "little"))
    for values in (input_ids, attention_mask, position_ids):
        digest.update(array("I", values).tobytes())  # the host is little-endian (checked at open)
    return digest.hexdigest()


def ids_fingerprint(ids: Sequence[int]) -> str:
    """The fingerprint of unpadded ids (mask all ones, positions 0..n-1), as the tokenizer gives it."""
    return fingerprint(ids, [1] * len(ids), range(len(ids)))
