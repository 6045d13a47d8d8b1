"""Pre-tokenization: special tokens first, then the family's regex (GGUF ``tokenizer.ggml.pre``).

Families (``FAMILIES``), each with exactly llama.cpp's pattern (src/llama-vocab.cpp, ``regex_exprs``):

* ``smollm``: Digits(individual_digits) then the GPT-2 ByteLevel regex
  ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``.
  ``FAST_PATTERN`` does both in one ``findall``: a numeric character is always a piece by itself (no
  leading space), and whitespace in front of a numeric character behaves as at the end of a segment,
  so ``\\s+(?!\\S)`` becomes ``\\s+(?![^\\s\\p{N}])``.
* ``gpt2`` (GGUF pre ``gpt-2`` or ``gpt2``): the GPT-2 regex alone (llama.cpp keeps the text no
  alternative matches as pieces, which is what the trailing ``|\\s+`` does here).
* ``llama-bpe`` (Llama 3): ``(?i:'s|...)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}``
  ``| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+``
  with the contractions spelled ``'[sS]`` as llama.cpp adapts them; BPE ignores merges (a piece that
  is a vocabulary token is that token), as llama.cpp and the Hugging Face file say.
* ``qwen2``: the Llama 3 pattern with ``\\p{N}`` instead of ``\\p{N}{1,3}``, merges not ignored.
* ``spm``: SentencePiece-style BPE (GGUF ``tokenizer.ggml.model`` "llama": Llama 2, Mistral v0.x), which
  has no regex: the text's spaces stand for ``▁``, and a segment is cut before each run of spaces
  (``SPM_WORDS``) when no token of the vocabulary has a space after another character, so no merge can
  cross such a cut; otherwise the whole segment is one piece (``SPM_WHOLE``). No Unicode classes, so
  nothing to pin.

The compiler stores the family's fast pattern and its Unicode-pinned exact variant in the compiled
file, so workers need no family code. ``\\p{L}``/``\\p{N}`` in the `regex` module follow a newer
Unicode than the reference. The compiler (``unicode_pin.pinned_patterns``) lists the code points where
the two disagree (``rare_class``) and builds an exact pattern with set operations (``exact_pattern``,
slower). At run time the fast pattern is used, and a text falls back to the exact one only when one
of its uncached pieces holds such a code point (``BpeEngine`` never caches those pieces, so every text
that has one is checked).
"""
from __future__ import annotations

from dataclasses import dataclass

import regex

# Letters first: ~12% faster, same result, since no two alternatives can start at the same character
# except the contractions, which keep their order before the "other" class.
FAST_PATTERN = r""" ?\p{L}+|'(?:[stmd]|re|ve|ll)|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_TAIL = r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = _CONTRACTIONS + r"""|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}""" + _LLAMA3_TAIL
QWEN2_PATTERN = _CONTRACTIONS + r"""|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}""" + _LLAMA3_TAIL
# The Split regexes the families' tokenizer.json files carry (Hugging Face form), for folder mapping.
_HF_CONTRACTIONS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
HF_LLAMA3 = _HF_CONTRACTIONS + r"""|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}""" + _LLAMA3_TAIL
HF_QWEN2 = _HF_CONTRACTIONS + r"""|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}""" + _LLAMA3_TAIL
SPM_WORDS = r" *[^ ]+| +"  # SentencePiece: a cut before each run of spaces (see the module's doc)
SPM_WHOLE = r"(?s).+"  # ... or none, when a token has a space after another character


@dataclass(frozen=True)
class Family:
    name: str
    pattern: str  # the splitting regex as the reference applies it (the pin rewrites its classes)
    fast_pattern: str  # what the runtime's findall uses; same pieces as ``pattern`` (smollm: one pass)
    hf_split: str | None  # the Split regex of a tokenizer.json of this family (None: ByteLevel's own)
    hf_digits: bool  # the tokenizer.json runs Digits(individual_digits) first
    ignore_merges: bool  # a piece that is a vocabulary token is that token (llama.cpp, HF ignore_merges)


FAMILIES = {
    "smollm": Family("smollm", GPT2_PATTERN, FAST_PATTERN, None, True, False),
    "gpt2": Family("gpt2", GPT2_PATTERN, GPT2_PATTERN, None, False, False),
    "llama-bpe": Family("llama-bpe", LLAMA3_PATTERN, LLAMA3_PATTERN, HF_LLAMA3, False, True),
    "qwen2": Family("qwen2", QWEN2_PATTERN, QWEN2_PATTERN, HF_QWEN2, False, False),
    "spm": Family("spm", SPM_WORDS, SPM_WORDS, None, False, False),
}
GGUF_PRE_NAMES = {"smollm": "smollm", "gpt2": "gpt2", "gpt-2": "gpt2", "llama-bpe": "llama-bpe", "qwen2": "qwen2"}
PRETOKENIZERS = tuple(GGUF_PRE_NAMES)  # GGUF ``tokenizer.ggml.pre`` values this module implements


@dataclass(frozen=True)
class PinnedPatterns:
    rare_class: str  # character class of the code points `regex` misclassifies; "" when none
    exact_pattern: str  # the fast pattern with those code points classified as the reference does
    rare_leads3: list[int]  # UTF-8 lead bytes of the 3-byte ones, for a cheap pre-filter
    fast_pattern: str = FAST_PATTERN  # the family's pattern for the `regex` module's own classes


class PreTokenizer:
    """Splits text into (special token id | text segment) and segments into pieces."""

    def __init__(self, special_tokens: dict[str, int], pinned: PinnedPatterns, ignore_merges: bool = False):
        self.fast_findall = regex.compile(pinned.fast_pattern).findall
        self.ignore_merges = ignore_merges
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
