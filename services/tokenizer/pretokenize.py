"""Pre-tokenization: special tokens first, then Digits(individual_digits) + the GPT-2 ByteLevel regex.

The reference runs two steps: Digits isolates every numeric character, then the ByteLevel regex
``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`` splits each
remaining segment on its own. ``FAST_PATTERN`` does both in one ``findall``: a numeric character is
always a piece by itself (no leading space), and whitespace in front of a numeric character behaves as
at the end of a segment, so ``\\s+(?!\\S)`` becomes ``\\s+(?![^\\s\\p{N}])``.

``\\p{L}``/``\\p{N}`` in the `regex` module follow a newer Unicode than the reference. The
compiler (``unicode_pin.pinned_patterns``) lists the code points where the two disagree
(``rare_class``) and builds an exact pattern with set operations (``exact_pattern``, slower).
At run time the fast pattern is used, and a text falls back to the exact one only when one of its
uncached pieces holds such a code point (``BpeEngine`` never caches those pieces, so every text
that has one is checked).
"""
from __future__ import annotations

from dataclasses import dataclass

import regex

# Letters first: ~12% faster, same result, since no two alternatives can start at the same character
# except the contractions, which keep their order before the "other" class.
FAST_PATTERN = r""" ?\p{L}+|'(?:[stmd]|re|ve|ll)|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
PRETOKENIZERS = ("smollm",)  # GGUF ``tokenizer.ggml.pre`` values this module implements


@dataclass(frozen=True)
class PinnedPatterns:
    rare_class: str  # character class of the code points `regex` misclassifies; "" when none
    exact_pattern: str  # FAST_PATTERN with those code points classified as the reference does
    rare_leads3: list[int]  # UTF-8 lead bytes of the 3-byte ones, for a cheap pre-filter


class PreTokenizer:
    """Splits text into (special token id | text segment) and segments into pieces."""

    def __init__(self, special_tokens: dict[str, int], pinned: PinnedPatterns):
        self.fast_findall = regex.compile(FAST_PATTERN).findall
        self.exact_findall = regex.compile(pinned.exact_pattern, regex.V1).findall
        # None when the installed `regex` agrees with the reference everywhere.
        self.rare_search = regex.compile(pinned.rare_class, regex.V1).search if pinned.rare_class else None
        self.rare_leads3 = frozenset(pinned.rare_leads3)
        self._special_ids = dict(special_tokens)
        # Longest first: at the leftmost match position the alternation then picks the longest
        # token, which is Hugging Face's leftmost-longest rule for added tokens.
        by_length = sorted(special_tokens, key=len, reverse=True)
        self._special_split = regex.compile(
            "(" + "|".join(regex.escape(tok) for tok in by_length) + ")").split if by_length else None
        starts = {tok[0] for tok in special_tokens}
        # A text without this character holds no special token (a one-character substring test is
        # far cheaper than the split regex); None when the tokens start with different characters.
        self.special_marker = starts.pop() if len(starts) == 1 else None
        self._special_starts = frozenset(tok[0] for tok in special_tokens)

    def split_special(self, text: str) -> list[str | int]:
        """Text -> alternating non-empty segments (str) and special token ids (int), in order."""
        if self._special_split is None or not any(ch in text for ch in self._special_starts):
            return [text] if text else []
        parts = self._special_split(text)
        out: list[str | int] = []
        for i, part in enumerate(parts):
            if i % 2:
                out.append(self._special_ids[part])
            elif part:
                out.append(part)
        return out
