"""Ids -> text, whole or streamed, as the reference's ByteLevel (or SentencePiece) decoder does it.

Each token maps to bytes (special tokens to their text); the concatenation is decoded as UTF-8 with
U+FFFD for each maximal invalid subsequence (Rust's ``from_utf8_lossy`` and Python's ``"replace"``
follow the same Unicode recommendation). The stream decoder holds back a trailing, still-valid
incomplete UTF-8 sequence, so it never emits half a character, and the concatenation of its outputs
equals ``decode`` of all the ids pushed. SentencePiece vocabularies (``▁`` is already a space and
``<0xXX>`` its byte in the compiled token bytes) drop one leading space of the whole output when the
model adds a space prefix, as Hugging Face's Strip decoder and llama.cpp do.
"""
from __future__ import annotations

import operator
from collections.abc import Iterable

from shared.errors import InvalidInput

# Second-byte ranges that keep a sequence valid (Unicode Table 3-7), for lead bytes E0..F4.
_SECOND = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def _sequence_length(lead: int) -> int:
    """Length of the UTF-8 sequence a lead byte starts; 0 for bytes that cannot start one."""
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0


def complete_prefix(data: bytes) -> int:
    """Length of the prefix of ``data`` that can be decoded now without splitting a character.

    What follows it is the start of a valid sequence that later bytes may complete. Cutting just
    before a lead byte never changes how the prefix decodes, since a lead byte cannot continue
    anything before it.
    """
    n = len(data)
    for back in range(1, min(4, n) + 1):
        byte = data[n - back]
        if 0x80 <= byte <= 0xBF:
            continue  # continuation byte: look further back for its lead byte
        need = _sequence_length(byte)
        if need <= back:  # ASCII, an invalid byte, or a sequence that is already complete
            return n
        if back >= 2:
            low, high = _SECOND.get(byte, (0x80, 0xBF))
            if not low <= data[n - back + 1] <= high:
                return n  # already invalid: nothing to wait for
        return n - back
    return n


class Decoder:
    def __init__(self, offsets: memoryview, blob: memoryview, special_ids: frozenset[int],
                 strip_leading_space: bool = False):
        self._offsets = offsets
        self._blob = blob
        self.vocab_size = len(offsets) - 1
        self.special_ids = special_ids
        self.strip_leading_space = strip_leading_space  # SentencePiece's space prefix (HF's Strip decoder)

    def check_ids(self, ids: Iterable[int]) -> list[int]:
        """Validate ids: integers in [0, vocab_size). Raises InvalidInput."""
        if isinstance(ids, (str, bytes)):
            raise InvalidInput("token ids must be a sequence of integers", reason="INVALID_TOKEN_ID")
        ids = list(ids)
        if not all(type(i) is int for i in ids):
            ids = [self._as_int(i, pos) for pos, i in enumerate(ids)]
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            pos, bad = next((p, i) for p, i in enumerate(ids) if not 0 <= i < self.vocab_size)
            raise InvalidInput(f"token id {bad} at position {pos} is outside [0, {self.vocab_size})",
                               reason="TOKEN_ID_OUT_OF_RANGE",
                               metadata={"token_id": bad, "position": pos, "vocab_size": self.vocab_size})
        return ids

    @staticmethod
    def _as_int(value, pos: int) -> int:
        if isinstance(value, bool):
            raise InvalidInput(f"token id at position {pos} is a bool", reason="INVALID_TOKEN_ID",
                               metadata={"position": pos})
        try:
            return operator.index(value)
        except TypeError:
            raise InvalidInput(f"token id at position {pos} is not an integer: {value!r}"[:200],
                               reason="INVALID_TOKEN_ID", metadata={"position": pos}) from None

    def token_bytes(self, ids: list[int]) -> bytes:
        """Concatenated bytes of already-validated ids."""
        off, blob = self._offsets, self._blob
        return b"".join([blob[off[i]:off[i + 1]] for i in ids])

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = self.check_ids(ids)
        if skip_special_tokens:
            special = self.special_ids
            ids = [i for i in ids if i not in special]
        text = self.token_bytes(ids).decode("utf-8", "replace")
        return text[1:] if self.strip_leading_space and text[:1] == " " else text


class StreamDecoder:
    """``push(id)`` / ``extend(ids)`` -> str emit whole characters only; ``finish() -> str``
    flushes the rest. Ids are checked before any is taken: a bad one leaves the state unchanged."""

    def __init__(self, decoder: Decoder, skip_special_tokens: bool = True):
        self._decoder = decoder
        self._skip = decoder.special_ids if skip_special_tokens else frozenset()
        self._pending = b""
        self._at_start = decoder.strip_leading_space  # the output's first space is still to drop

    def push(self, token_id: int) -> str:
        return self.extend((token_id,))

    def extend(self, token_ids: Iterable[int]) -> str:
        ids = self._decoder.check_ids(token_ids)
        if self._skip:
            ids = [i for i in ids if i not in self._skip]
        if not ids:
            return ""
        data = self._pending + self._decoder.token_bytes(ids)
        cut = complete_prefix(data)
        self._pending = data[cut:]
        return self._strip(data[:cut].decode("utf-8", "replace")) if cut else ""

    def _strip(self, text: str) -> str:
        if self._at_start and text:
            self._at_start = False
            return text[1:] if text[0] == " " else text
        return text

    def finish(self) -> str:
        """Flush what is held back (an incomplete sequence decodes to U+FFFD) and reset."""
        data, self._pending = self._pending, b""
        text = self._strip(data.decode("utf-8", "replace"))
        self._at_start = self._decoder.strip_leading_space
        return text
