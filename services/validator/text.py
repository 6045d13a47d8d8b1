"""Small text helpers shared by the input rules and the output probes.

Matching is done on a *normalised* copy of the text (NFKC, format characters removed,
casefolded) so that fullwidth ``＜ｓｃｒｉｐｔ`` or a zero-width joiner inside ``<|im_start|>``
cannot slip past a pattern written in plain ASCII.
"""
from __future__ import annotations

import re
import unicodedata

import regex

# CJK Unified Ideographs (+ extension A, compatibility ideographs). Kana and Hangul are not
# counted: the share rule is about Chinese text.
_CJK_RANGES = ((0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0x20000, 0x2EBEF))
_WORD = re.compile(r"[a-z0-9]+(?:['’][a-z]+)?")
_FORMAT_CHARS = regex.compile(r"\p{Cf}+")
# What renders as nothing: format and control characters, separators (spaces, line and
# paragraph separators), combining marks with no base to sit on, private-use, unassigned and
# surrogate code points, and the blank "letters" used as invisible filler (Hangul fillers,
# the blank Braille pattern).
_INVISIBLE = regex.compile(r"[\p{Cf}\p{Cc}\p{Z}\p{Mn}\p{Me}\p{Co}\p{Cn}\p{Cs}"
                           r"\u115F\u1160\u3164\uFFA0\u2800]+")


def is_cjk(ch: str) -> bool:
    code = ord(ch)
    return any(lo <= code <= hi for lo, hi in _CJK_RANGES)


def normalise(text: str) -> str:
    """NFKC + casefold, with Unicode format characters (zero-width space/joiner, BOM, bidi
    controls: category Cf) dropped."""
    if text.isascii():   # NFKC is the identity on ASCII, which has no format characters
        return text.lower()
    if not unicodedata.is_normalized("NFKC", text):
        text = unicodedata.normalize("NFKC", text)
    return _FORMAT_CHARS.sub("", text.casefold())


def visible_count(text: str) -> int:
    """How many characters of ``text`` render as something visible."""
    return len(text) - sum(len(run) for run in _INVISIBLE.findall(text))


def cjk_share(text: str) -> float:
    """CJK ideographs over all letters, digits and ideographs (spaces and punctuation do not
    count either way). 0.0 for text without any of them."""
    counted = cjk = 0
    for ch in text:
        if ch.isalnum():
            counted += 1
            cjk += is_cjk(ch)
    return cjk / counted if counted else 0.0


def content_tokens(text: str) -> set[str]:
    """Token set for overlap measures: lowercased ASCII words plus CJK character bigrams
    (Chinese has no spaces; bigrams are the usual segmentation-free stand-in). A lone CJK
    character between non-CJK characters is kept as a unigram."""
    norm = normalise(text)
    tokens = set(_WORD.findall(norm))
    run: list[str] = []
    for ch in norm + " ":
        if is_cjk(ch):
            run.append(ch)
            continue
        if len(run) == 1:
            tokens.add(run[0])
        tokens.update(run[i] + run[i + 1] for i in range(len(run) - 1))
        run = []
    return tokens


def term_regex(term: str) -> str:
    """Regex for one configured term, matched on normalised text. ASCII words get word
    boundaries (``LPR`` must not match inside ``HELPRS``); CJK terms match as substrings."""
    body = re.escape(normalise(term))
    if term.isascii() and term[:1].isalnum() and term[-1:].isalnum():
        return rf"(?<![a-z0-9]){body}(?![a-z0-9])"
    return body


def inflected_regex(word: str) -> str:
    """Like :func:`term_regex`, but an English word also matches its regular inflections
    (increase → increases/increased/increasing; rise → rises/rising; fall → falls/falling)."""
    norm = normalise(word)
    if not (norm.isascii() and norm.isalpha()):
        return term_regex(word)
    stem = norm[:-1] if norm.endswith("e") else norm
    endings = "e|es|ed|ing" if norm.endswith("e") else "s|es|ed|ing|"
    return rf"(?<![a-z0-9]){re.escape(stem)}(?:{endings})(?![a-z0-9])"
