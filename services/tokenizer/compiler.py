"""Compile a model's tokenizer into the flat binary that every worker mmaps (see fileformat).

Run: python -m services.tokenizer.compiler [--gguf PATH] [--out PATH]   (what `make vocab` does)

Sources: a GGUF (``tokenizer.ggml.model`` "gpt2", ``tokenizer.ggml.pre`` one of
``pretokenize.PRETOKENIZERS``) or a Hugging Face folder (tokenizer.json with a byte-level BPE model
and a pre-tokenizer that maps onto one of the same families, plus tokenizer_config.json); or
SentencePiece-style BPE (family ``spm``: Llama 2, Mistral v0.x): a GGUF with ``tokenizer.ggml.model``
"llama" (merges by the score of the merged token, ``▁`` for spaces, ``<0xXX>`` byte fallback, the
space prefix ``tokenizer.ggml.add_space_prefix`` and BOS by default, as llama.cpp does), or a folder
whose tokenizer.json is ``BPE(byte_fallback=True)`` with the normalizer Prepend("▁") + Replace(" ",
"▁") (or the Metaspace pre-tokenizer) and the decoder ByteFallback/Fuse/Strip. Anything
else is refused with PreconditionFailed reason UNSUPPORTED_TOKENIZER naming what was found and what
is supported. The family's pattern goes into the file, so workers need no family code.

Idempotent: an existing output built from the same GGUF (same size and mtime, or else the same
SHA-256) by the same builder (format version, this compiler's code, `regex` version) is kept as it
is. The slow parts (parsing the GGUF, the Unicode scan, verifying every token) run only when
something changed.

The self-check probes stored in the file are computed here by a deliberately naive, dictionary-based
BPE, so ``Tokenizer.self_check`` compares the fast runtime against an independent implementation.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from array import array
from dataclasses import dataclass
from pathlib import Path

import regex

from services.tokenizer import fileformat as ff
from services.tokenizer import tables
from services.tokenizer.pretokenize import (
    FAMILIES,
    GGUF_PRE_NAMES,
    PRETOKENIZERS,
    SPM_WHOLE,
    SPM_WORDS,
    Family,
    PinnedPatterns,
)
from services.tokenizer.unicode_pin import pinned_patterns
from shared.errors import PreconditionFailed

# tokenizer.ggml.token_type values
GGUF_NORMAL, GGUF_UNKNOWN, GGUF_CONTROL, GGUF_USER_DEFINED, GGUF_UNUSED, GGUF_BYTE = 1, 2, 3, 4, 5, 6
MAX_WORDS = 16384  # length of the cache-prefill list (section WORDS)
PROBES = (  # each exercises a different runtime path; ids come from the naive reference below
    "Hello, world! It's 2024-11-29, isn't it?",
    "x  1",
    "!\x04!",
    "中文分词测试，这是一个没有空格的很长的句子。",
    "中" * 40,
    "a" * 400,
    "👨\u200d👩\u200d👧 🇫🇷 é ñ",
    "<|im_start|>user\nhi<|im_end|>\n",
    "def f(x):\n    return x**2  # 平方\n\n\n",
    "\U00010940\U00011de0 ab 三",
)


@dataclass(frozen=True)
class GgufVocab:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    pad_id: int
    unk_id: int
    chat_template: str | None
    pretokenizer: str  # the family's name (pretokenize.FAMILIES)
    add_bos: bool = False
    add_eos: bool = False
    ignore_merges: bool = False
    scores: list[float] | None = None  # spm from a GGUF: merges go by the merged token's score
    add_space_prefix: bool = False  # spm: a space before each text segment (start, after a special token)
    prefix_unless_space: bool = False  # ... except before a segment that starts with one (HF's Metaspace)


VOCAB_NAME = "vocab.kvoc"  # the compiled vocabulary's name in the model's folder under var/models/


def compiled_path(source) -> Path:
    """Where the tokenizer stage maps the vocabulary of `source` (a shared.modelfile.ModelSource)."""
    return source.cache_dir / VOCAB_NAME


def _unsupported(message: str) -> PreconditionFailed:
    return PreconditionFailed(message, reason="UNSUPPORTED_TOKENIZER")


def read_gguf(gguf_file: Path) -> GgufVocab:
    from shared import ggufmeta

    try:
        get = ggufmeta.read(gguf_file).metadata.get
    except ggufmeta.GgufError as exc:
        raise _unsupported(f"not a GGUF this reader understands: {exc}") from exc
    model = get("tokenizer.ggml.model")
    if model == "llama":
        return _read_gguf_spm(get)
    if model != "gpt2":
        raise _unsupported(f"tokenizer model {model!r}; supported: 'gpt2' (byte-level BPE), "
                           "'llama' (SentencePiece-style BPE)")
    pre = get("tokenizer.ggml.pre")
    if pre not in GGUF_PRE_NAMES:
        raise _unsupported(f"pre-tokenizer {pre!r}; supported: {', '.join(PRETOKENIZERS)}")
    if get("tokenizer.ggml.add_space_prefix", False):
        raise _unsupported("add_space_prefix is not implemented")
    family = FAMILIES[GGUF_PRE_NAMES[pre]]
    eos = get("tokenizer.ggml.eos_token_id", -1)
    return GgufVocab(
        tokens=list(get("tokenizer.ggml.tokens")), token_types=list(get("tokenizer.ggml.token_type")),
        merges=list(get("tokenizer.ggml.merges")), bos_id=get("tokenizer.ggml.bos_token_id", eos),
        eos_id=eos, pad_id=get("tokenizer.ggml.padding_token_id", eos),
        unk_id=get("tokenizer.ggml.unknown_token_id", -1), chat_template=get("tokenizer.chat_template"),
        pretokenizer=family.name,
        # llama.cpp's defaults where the file is silent: Llama 3 adds BOS, the others add nothing.
        add_bos=bool(get("tokenizer.ggml.add_bos_token", family.name == "llama-bpe")),
        add_eos=bool(get("tokenizer.ggml.add_eos_token", False)), ignore_merges=family.ignore_merges)


def _read_gguf_spm(get) -> GgufVocab:
    """tokenizer.ggml.model "llama" with llama.cpp's defaults: BOS added, a space prefix."""
    if get("tokenizer.ggml.remove_extra_whitespaces", False):
        raise _unsupported("SentencePiece remove_extra_whitespaces is not implemented")
    tokens = list(get("tokenizer.ggml.tokens"))
    eos = get("tokenizer.ggml.eos_token_id", 2)
    return GgufVocab(
        tokens=tokens, token_types=list(get("tokenizer.ggml.token_type") or [GGUF_NORMAL] * len(tokens)),
        merges=[], scores=[float(x) for x in get("tokenizer.ggml.scores") or [0.0] * len(tokens)],
        bos_id=get("tokenizer.ggml.bos_token_id", 1), eos_id=eos,
        pad_id=get("tokenizer.ggml.padding_token_id", eos), unk_id=get("tokenizer.ggml.unknown_token_id", 0),
        chat_template=get("tokenizer.chat_template"), pretokenizer="spm",
        add_bos=bool(get("tokenizer.ggml.add_bos_token", True)),
        add_eos=bool(get("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(get("tokenizer.ggml.add_space_prefix", True)))


HF_FILES = ("tokenizer.json", "tokenizer_config.json")


def _describe(node) -> str:
    return json.dumps(node, ensure_ascii=False)[:300]


def hf_family(pre_tokenizer) -> Family:
    """The family whose splitting a tokenizer.json's pre_tokenizer performs, or UNSUPPORTED_TOKENIZER."""
    steps = pre_tokenizer.get("pretokenizers", []) if (pre_tokenizer or {}).get("type") == "Sequence" \
        else [pre_tokenizer] if pre_tokenizer else []
    kinds = [step.get("type") for step in steps]
    last = steps[-1] if steps else {}
    if kinds and kinds[-1] == "ByteLevel" and not last.get("add_prefix_space", False):
        if kinds == ["ByteLevel"] and last.get("use_regex", True):
            return FAMILIES["gpt2"]
        first = steps[0]
        if (kinds == ["Digits", "ByteLevel"] and first.get("individual_digits") and last.get("use_regex", True)):
            return FAMILIES["smollm"]
        if kinds == ["Split", "ByteLevel"] and not last.get("use_regex", True) \
                and str(first.get("behavior", "")).lower() == "isolated" and not first.get("invert", False):
            pattern = (first.get("pattern") or {}).get("Regex")
            for family in FAMILIES.values():
                if family.name not in ("smollm", "spm") and \
                        pattern in (family.hf_split, family.pattern, family.fast_pattern):
                    return family
    supported = ", ".join(f"{name} ({f.hf_split or ('Digits+' if f.hf_digits else '') + 'ByteLevel'})"
                          for name, f in FAMILIES.items() if name != "spm")
    supported += f"; {_SPM_SUPPORTED}"
    raise _unsupported(f"pre-tokenizer {_describe(pre_tokenizer)}; supported: {supported}")


_SPM_NORMALIZER = {"type": "Sequence", "normalizers": [
    {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
_SPM_DECODER = ["Replace", "ByteFallback", "Fuse", "Strip"]
_SPM_SUPPORTED = ("spm (BPE byte_fallback, normalizer Prepend('▁')+Replace(' ', '▁') or pre-tokenizer "
                  "Metaspace, decoder Replace/ByteFallback/Fuse/Strip)")


def hf_spm(spec: dict) -> tuple[bool, bool]:
    """(add_space_prefix, prefix_unless_space) of a SentencePiece-style tokenizer.json (Llama 2's
    layout), or UNSUPPORTED_TOKENIZER naming the part that does not match. Metaspace (prepend_scheme
    "always") prepends ▁ only to a segment that does not already start with ▁ or a space."""
    norm, pre, decoder = spec.get("normalizer"), spec.get("pre_tokenizer"), spec.get("decoder") or {}
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    kinds = [step.get("type") for step in steps]
    strip = steps[-1] if steps else {}
    strip_one = kinds[-1:] == ["Strip"] and (strip.get("content"), strip.get("start"), strip.get("stop")) == (" ", 1, 0)
    if norm == _SPM_NORMALIZER and pre is None:
        prefix, metaspace = True, False
    elif norm is None and (pre or {}).get("type") == "Metaspace" and pre.get("replacement") == "▁" \
            and pre.get("split") is False and pre.get("prepend_scheme", "always") in ("always", "never"):
        prefix = metaspace = pre.get("prepend_scheme", "always") == "always"
    else:
        raise _unsupported(f"byte-fallback BPE with normalizer {_describe(norm)} and pre-tokenizer "
                           f"{_describe(pre)}; supported: {_SPM_SUPPORTED}")
    replace = steps[0] if steps else {}
    if (kinds not in (_SPM_DECODER, _SPM_DECODER[:-1]) or (replace.get("pattern"), replace.get("content"))
            != ({"String": "▁"}, " ") or strip_one != prefix):
        raise _unsupported(f"byte-fallback BPE with decoder {_describe(decoder)}; supported: {_SPM_SUPPORTED}")
    return prefix, metaspace


def _token_content(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def read_hf_folder(folder: Path) -> GgufVocab:
    """tokenizer.json (byte-level BPE) and tokenizer_config.json of a Hugging Face folder."""
    try:
        spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _unsupported(f"no readable tokenizer.json in {folder}: {exc}") from exc
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.exists() else {}
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise _unsupported(f"tokenizer model {model.get('type')!r}; supported: 'BPE' (byte-level)")
    if model.get("dropout") or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise _unsupported("tokenizer.json's BPE has dropout, a subword prefix or a word suffix")
    space_prefix = metaspace = False
    if model.get("byte_fallback"):
        space_prefix, metaspace = hf_spm(spec)
        family = FAMILIES["spm"]
    elif spec.get("normalizer") or (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise _unsupported(f"tokenizer.json has the normalizer {_describe(spec.get('normalizer'))} or the "
                           f"decoder {_describe(spec.get('decoder'))}; supported: byte-level BPE (ByteLevel "
                           f"decoder, no normalizer), {_SPM_SUPPORTED}")
    else:
        family = hf_family(spec.get("pre_tokenizer"))
    vocab = dict(model.get("vocab") or {})
    added = spec.get("added_tokens") or []
    n = max([*vocab.values(), *(a["id"] for a in added)], default=-1) + 1
    tokens: list = [None] * n
    types = [1] * n
    for tok, i in vocab.items():
        tokens[i] = tok
    for a in added:  # added tokens (special or not) are matched whole in text, before pre-tokenization
        tokens[a["id"]], types[a["id"]] = a["content"], GGUF_CONTROL
    if family.name == "spm":  # the byte tokens, as llama.cpp's converter types them
        for i, tok in enumerate(tokens):
            if types[i] == GGUF_NORMAL and tok is not None and regex.fullmatch(r"<0x[0-9A-F]{2}>", tok):
                types[i] = GGUF_BYTE
    if None in tokens:
        raise _unsupported(f"token id {tokens.index(None)} is unassigned in tokenizer.json")
    ids = {tok: i for i, tok in enumerate(tokens)}

    def token_id(key: str) -> int:
        return ids.get(_token_content(config.get(key)), -1)

    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    eos, bos, pad = token_id("eos_token"), token_id("bos_token"), token_id("pad_token")
    add_bos = config.get("add_bos_token")
    if add_bos is None:  # without the config's word: the post-processor's (TemplateProcessing "<s> $A")
        single = (spec.get("post_processor") or {}).get("single") or []
        add_bos = bool(single) and "SpecialToken" in single[0] and bos >= 0 \
            and single[0]["SpecialToken"].get("id") == tokens[bos]
    return GgufVocab(  # bos and pad default to eos, as read_gguf's do
        tokens=tokens, token_types=types, merges=merges, bos_id=bos if bos >= 0 else eos, eos_id=eos,
        pad_id=pad if pad >= 0 else eos, unk_id=token_id("unk_token"), chat_template=config.get("chat_template"),
        pretokenizer=family.name, add_bos=bool(add_bos),
        add_eos=bool(config.get("add_eos_token", False)), ignore_merges=bool(model.get("ignore_merges", False)),
        add_space_prefix=space_prefix, prefix_unless_space=metaspace)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by ByteLevel vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def reference_bpe(data: bytes, byte_ids: list[int], ranks: dict, rank_ids: list[int]) -> list[int]:
    """Naive BPE: rescan every pair after each merge. Slow and obviously right."""
    syms = [byte_ids[b] for b in data if byte_ids[b] >= 0]
    while len(syms) > 1:
        best_rank, best_i = tables.NO_RANK, -1
        for i in range(len(syms) - 1):
            rank = ranks.get((syms[i], syms[i + 1]), tables.NO_RANK)
            if rank < best_rank:
                best_rank, best_i = rank, i
        if best_i < 0:
            break
        syms[best_i:best_i + 2] = [rank_ids[best_rank]]
    return syms


def _reference_encode(text: str, specials: dict[str, int], findall, bpe, segment=lambda text: text) -> list[int]:
    """``bpe`` takes a piece's bytes (and applies ignore_merges where the family does); ``segment``
    rewrites each text segment between special tokens (SentencePiece: ▁ as a space, the space prefix)."""
    out, pos = [], 0
    while pos < len(text):
        hits = [(text.find(s, pos), -len(s), s) for s in specials if text.find(s, pos) >= 0]
        start, _, special = min(hits) if hits else (len(text), 0, None)  # leftmost, then longest
        if start > pos:
            for piece in findall(segment(text[pos:start])):
                out += bpe(piece.encode())
        if special is None:
            break
        out.append(specials[special])
        pos = start + len(special)
    return out


@dataclass
class _Merges:
    """The runtime's symbols and merges: byte -> id, pair (left, right) -> rank, rank -> merged id.

    SentencePiece vocabularies merge characters, the runtime merges from bytes: each character is
    built from its byte tokens by "synthetic" merges ranked before every real one, through synthetic
    ids above the vocabulary (a character that is a token is built into that token). A synthetic id
    left after merging is a character (or part of one) no token completes: it expands to its byte
    tokens, which is exactly SentencePiece's byte fallback."""

    byte_ids: list[int]
    ranks: dict[tuple[int, int], int]
    rank_ids: list[int]
    expansions: list[list[int]]  # synthetic id (vocab size + k) -> byte token ids


def _named_pairs(merges: list[str], normal: dict[str, int], spm: bool = False):
    """"left right" lines -> ([(left id, right id)], [merged id]) by rank."""
    pairs, rank_ids = [], []
    for line in merges:
        parts = line.split(" ")
        if spm:  # ▁ is a space in the runtime's symbols
            parts = [part.replace("▁", " ") for part in parts]
        if len(parts) != 2 or parts[0] not in normal or parts[1] not in normal or "".join(parts) not in normal:
            raise _unsupported(f"merge {line!r} does not name vocabulary tokens")
        pairs.append((normal[parts[0]], normal[parts[1]]))
        rank_ids.append(normal["".join(parts)])
    return pairs, rank_ids


def _byte_level_merges(vocab: GgufVocab, normal: dict[str, int]) -> _Merges:
    to_char = byte_to_unicode()
    byte_ids = [normal.get(to_char[b], -1) for b in range(256)]
    pairs, rank_ids = _named_pairs(vocab.merges, normal)
    ranks = {pair: r for r, pair in enumerate(pairs)}
    if len(ranks) != len(pairs):
        raise _unsupported("a merge pair repeats")
    return _Merges(byte_ids, ranks, rank_ids, [])


def _spm_merges(vocab: GgufVocab, normal: dict[str, int], byte_token: list[int]) -> _Merges:
    """Symbols are characters (a space stands for ▁). From a GGUF the score of the merged token ranks
    a pair (llama.cpp: highest score first, leftmost on ties), so every split of a token into two
    symbols is a pair and the pairs making one token share a rank; from an HF folder the merges list
    ranks them, and only characters that are tokens take part (others fall back to bytes at once)."""
    n = len(vocab.tokens)
    by_score = vocab.scores is not None
    chars = sorted({ch for tok in normal for ch in tok} if by_score else {tok for tok in normal if len(tok) == 1})
    symbol: dict[str, int] = {}
    expansions: list[list[int]] = []
    prefix_ids: dict[bytes, int] = {}
    byte_ids = list(byte_token)
    synthetic: dict[tuple[int, int], int] = {}

    def new_synthetic(data: bytes) -> int:
        expansions.append([byte_token[b] for b in data])
        return n + len(expansions) - 1

    for ch in chars:
        data = ch.encode()
        char_id = symbol[ch] = normal[ch] if ch in normal else new_synthetic(data)
        if len(data) == 1:
            byte_ids[data[0]] = char_id
            continue
        current = byte_token[data[0]]
        for k in range(1, len(data)):
            if k == len(data) - 1:
                target = char_id
            else:
                target = prefix_ids.get(data[:k + 1])
                if target is None:
                    target = prefix_ids[data[:k + 1]] = new_synthetic(data[:k + 1])
            synthetic.setdefault((current, byte_token[data[k]]), target)
            current = target
    ranks = {pair: r for r, pair in enumerate(synthetic)}
    rank_ids = list(synthetic.values())
    if by_score:
        scores = vocab.scores
        for tok in sorted((tok for tok in normal if len(tok) > 1), key=lambda tok: (-scores[normal[tok]], normal[tok])):
            rank, used = len(rank_ids), False
            for k in range(1, len(tok)):
                left, right = symbol.get(tok[:k], normal.get(tok[:k])), symbol.get(tok[k:], normal.get(tok[k:]))
                if left is not None and right is not None and (left, right) not in ranks:
                    ranks[(left, right)], used = rank, True
            if used:
                rank_ids.append(normal[tok])
    else:
        pairs, merged = _named_pairs(vocab.merges, normal, spm=True)
        base = len(rank_ids)
        for r, pair in enumerate(pairs):
            if pair in ranks:
                raise _unsupported("a merge pair repeats")
            ranks[pair] = base + r
        rank_ids += merged
    if n + len(expansions) > tables.MAX_VOCAB:
        raise _unsupported(f"{n} tokens and {len(expansions)} partial characters; ids must stay below "
                           f"{tables.MAX_VOCAB}")
    return _Merges(byte_ids, ranks, rank_ids, expansions)


def build_sections(vocab: GgufVocab, source_name: str) -> dict[bytes, bytes]:
    n = len(vocab.tokens)
    spm = vocab.pretokenizer == "spm"
    if n > tables.MAX_VOCAB:
        raise _unsupported(f"vocabulary of {n} tokens; pair keys hold ids below {tables.MAX_VOCAB}")
    if len(vocab.token_types) != n or len(set(vocab.tokens)) != n:
        raise _unsupported("token list and types disagree, or tokens repeat")
    types = vocab.token_types
    allowed = ((GGUF_NORMAL, GGUF_CONTROL, GGUF_UNKNOWN, GGUF_BYTE) if spm
               else (GGUF_NORMAL, GGUF_CONTROL, GGUF_USER_DEFINED, GGUF_UNUSED))
    if any(t not in allowed for t in types):
        raise _unsupported(f"token types {sorted(set(types) - set(allowed))} in a {vocab.pretokenizer} "
                           f"vocabulary; implemented: {list(allowed)}")
    to_byte = {c: b for b, c in byte_to_unicode().items()}
    # found whole in text, as llama.cpp matches them and HF its added tokens (user-defined: the converter's
    # type for a Hugging Face added token that is not special)
    matched = (GGUF_CONTROL, GGUF_UNKNOWN, GGUF_USER_DEFINED)
    special = {vocab.tokens[i]: i for i in range(n) if types[i] in matched}

    def decoded(i: int) -> bytes:
        tok = vocab.tokens[i]
        if types[i] in matched:
            return tok.encode()
        if spm:
            return bytes([int(tok[3:5], 16)]) if types[i] == GGUF_BYTE else tok.replace("▁", " ").encode()
        # the ByteLevel decoder's rule, including its raw-text fallback
        return bytes(to_byte[c] for c in tok) if all(c in to_byte for c in tok) else tok.encode()

    token_bytes = [decoded(i) for i in range(n)]
    if spm:
        byte_tokens = {tok: i for i, tok in enumerate(vocab.tokens) if types[i] == GGUF_BYTE}
        byte_token = [byte_tokens.get(f"<0x{b:02X}>", -1) for b in range(256)]
        if min(byte_token) < 0:
            raise _unsupported("a SentencePiece vocabulary without the 256 <0xXX> byte tokens")
        # A space stands for ▁ at run time: a token holding a real space can never be produced.
        normal = {tok.replace("▁", " "): i for i, tok in enumerate(vocab.tokens)
                  if types[i] == GGUF_NORMAL and " " not in tok}
        m = _spm_merges(vocab, normal, byte_token)
    else:
        normal = {tok: i for i, tok in enumerate(vocab.tokens) if types[i] not in matched}
        m = _byte_level_merges(vocab, normal)
    mergeable = set(normal.values())

    def bpe(data: bytes) -> list[int]:
        ids = reference_bpe(data, m.byte_ids, m.ranks, m.rank_ids)
        return [j for i in ids for j in (m.expansions[i - n] if i >= n else (i,))] if m.expansions else ids

    by_bytes = {token_bytes[i]: i for i in normal.values()}

    def piece_bpe(data: bytes) -> list[int]:  # ignore_merges: a piece that is a token is that token
        if vocab.ignore_merges and data in by_bytes:
            return [by_bytes[data]]
        return bpe(data)

    flags, unsafe = bytearray(n), bytearray(65536)
    for i in range(n):
        if types[i] in matched:
            flags[i] = ff.FLAG_SPECIAL
            continue
        if i not in mergeable:
            continue
        data = token_bytes[i]
        if bpe(data) == [i]:
            flags[i] = ff.FLAG_STABLE
        for k in range(1, len(data)):
            if not 0x80 <= data[k] <= 0xBF:
                unsafe[data[k - 1] << 8 | data[k]] = 1

    family = FAMILIES[vocab.pretokenizer]
    if spm:  # no regex classes to pin; a cut before spaces unless a token has a space after a character
        pattern = SPM_WHOLE if any(b" " in token_bytes[i].lstrip(b" ") for i in mergeable) else SPM_WORDS
        pinned = PinnedPatterns("", pattern, [], pattern)
    else:
        pinned = pinned_patterns(family)
    exact = regex.compile(pinned.exact_pattern, regex.V1).findall
    # The reference does not split a SentencePiece segment, so the probes also check the runtime's cuts.
    ref_split = (lambda text: [text] if text else []) if spm else exact
    space_prefix = spm and vocab.add_space_prefix

    def segment(text: str) -> str:
        if not spm:
            return text
        text = text.replace("▁", " ")
        return " " + text if space_prefix and not (vocab.prefix_unless_space and text[0] == " ") else text

    probes = [[text, _reference_encode(text, special, ref_split, piece_bpe, segment)] for text in PROBES]
    rare = regex.compile(pinned.rare_class, regex.V1).search if pinned.rare_class else None
    words = array("I")
    for token in dict.fromkeys(i for i in m.rank_ids if i < n):  # merge order: the most frequent pairs first
        text = token_bytes[token].decode("utf-8", "replace")
        if (len(words) < MAX_WORDS and flags[token] & ff.FLAG_STABLE and "\ufffd" not in text
                and exact(text) == [text] and not (rare is not None and rare(text))):
            words.append(token)
    names = {i: tok for tok, i in special.items()}
    meta = {
        "source_name": source_name, "vocab_size": n, "n_merges": len(m.rank_ids),
        "bos_token_id": vocab.bos_id, "eos_token_id": vocab.eos_id, "pad_token_id": vocab.pad_id,
        "unk_token_id": vocab.unk_id,
        "special_strings": {key: names.get(i, token_bytes[i].decode("utf-8", "replace")) for key, i in
                            (("bos_token", vocab.bos_id), ("eos_token", vocab.eos_id),
                             ("pad_token", vocab.pad_id), ("unk_token", vocab.unk_id)) if 0 <= i < n},
        "special_tokens": sorted([tok, i] for tok, i in special.items()),
        "chat_template": vocab.chat_template,
        "pretokenizer": vocab.pretokenizer, "fast_pattern": pinned.fast_pattern,
        "ignore_merges": vocab.ignore_merges, "add_bos_token": vocab.add_bos, "add_eos_token": vocab.add_eos,
        "add_space_prefix": space_prefix, "prefix_unless_space": space_prefix and vocab.prefix_unless_space,
        "synthetic": m.expansions,
        "regex_version": regex.__version__, "builder": builder_id(),
        "unicode": "letters as Unicode 16.0 (Oniguruma), numerics as Unicode 17.0 (Rust is_numeric)",
        "rare_class": pinned.rare_class, "exact_pattern": pinned.exact_pattern,
        "rare_leads3": pinned.rare_leads3,
        "max_token_bytes": max(len(b) for b in token_bytes), "probes": probes,
    }
    offsets = array("I", [0])
    for data in token_bytes:
        offsets.append(offsets[-1] + len(data))
    if spm:
        pair_keys, pair_ranks = tables.build_pair_table(list(m.ranks), list(m.ranks.values()))
        hashed: list[bytes | None] = [None] * n  # only what merging can produce (not <0xXX>, not specials)
        for i in sorted(mergeable):
            hashed[i] = token_bytes[i]
    else:
        pair_keys, pair_ranks = tables.build_pair_table(list(m.ranks))
        hashed = [None if flags[i] & ff.FLAG_SPECIAL else b for i, b in enumerate(token_bytes)]
    return {
        ff.META: json.dumps(meta, ensure_ascii=False).encode(),
        ff.TOKEN_OFFSETS: offsets.tobytes(),
        ff.TOKEN_BYTES: b"".join(token_bytes),
        ff.TOKEN_FLAGS: bytes(flags),
        ff.TOKEN_HASH: tables.build_token_table(hashed).tobytes(),
        ff.PAIR_KEYS: pair_keys.tobytes(),
        ff.PAIR_RANKS: pair_ranks.tobytes(),
        ff.RANK_IDS: array("I", m.rank_ids).tobytes(),
        ff.BYTE_IDS: array("i", m.byte_ids).tobytes(),
        ff.UNSAFE_PAIRS: bytes(unsafe),
        ff.WORDS: words.tobytes(),
        ff.CHAR3: _three_byte_table(bpe).tobytes(),
    }


def _three_byte_table(bpe) -> array:
    """BPE of every 3-byte character (surrogates left empty: they never reach BPE)."""
    table = array("I", [ff.NO_ID]) * (3 * (ff.CHAR3_END - ff.CHAR3_FIRST))
    for cp in range(ff.CHAR3_FIRST, ff.CHAR3_END):
        if not 0xD800 <= cp < 0xE000:
            ids = bpe(chr(cp).encode())
            base = 3 * (cp - ff.CHAR3_FIRST)
            table[base:base + len(ids)] = array("I", ids)
    return table


def builder_id() -> str:
    """Hash of the modules that decide what the file holds: a changed compiler rebuilds the file."""
    from services.tokenizer import pretokenize, unicode_pin

    digest = hashlib.sha256(regex.__version__.encode())
    for module in (sys.modules[__name__], ff, tables, pretokenize, unicode_pin):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()


def _sha256(path: Path) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.digest()


def _source_files(model: Path) -> list[Path]:
    if model.is_dir():
        if not (model / "tokenizer.json").exists():
            raise _unsupported(f"{model} has no tokenizer.json; supported: a GGUF or a Hugging Face folder")
        return [model / name for name in HF_FILES if (model / name).exists()]
    return [model]


def compile_vocab(model: Path, out_file: Path) -> Path:
    """Build ``out_file`` from ``model`` (a GGUF file or a Hugging Face folder) unless it already
    holds the same source's tables."""
    model, out_file = Path(model), Path(out_file)
    try:
        files = _source_files(model)
        stats = [f.stat() for f in files]
    except OSError as exc:
        raise PreconditionFailed(f"cannot read the GGUF: {exc}", reason="GGUF_NOT_FOUND") from exc
    size, mtime = sum(st.st_size for st in stats), max(st.st_mtime_ns for st in stats)
    summary = ff.read_summary(out_file)
    current = summary is not None and summary[1].get("builder") == builder_id()
    if current and (summary[0].source.size, summary[0].source.mtime_ns) == (size, mtime):
        return out_file
    sha = _sha256(files[0]) if len(files) == 1 else hashlib.sha256(b"".join(map(_sha256, files))).digest()
    if current and summary[0].source.sha256 == sha:
        return out_file
    ff.require_little_endian()
    vocab = read_hf_folder(model) if model.is_dir() else read_gguf(model)
    sections = build_sections(vocab, model.name)
    ff.write(out_file, sections, ff.SourceInfo(sha, size, mtime))
    return out_file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, help="default: the served model (shared/modelfile.py)")
    parser.add_argument("--out", type=Path, help="default: vocab.kvoc in the model's folder under var/models/")
    args = parser.parse_args(argv)
    from shared import modelfile
    source = modelfile.source(args.gguf)
    out = compile_vocab(source.path, args.out or compiled_path(source))
    print(f"compiled tokenizer ready at {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
