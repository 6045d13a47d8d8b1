"""The tokenizer stage's core: ``Tokenizer.open(compiled_file)`` and text <-> ids, grpc-free.

Opening maps the compiled file (see fileformat) read-only and parses its header and metadata;
nothing proportional to the vocabulary is copied into the process. ``warmup()`` (jinja2, the
regexes, every code path once) and ``self_check()`` (checksum, probes computed by the compiler's
independent BPE) run before the server reports SERVING. Safe to share between threads: the caches
only ever hold correct values, and a race at worst drops an entry.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import regex

from services.tokenizer import fileformat as ff
from services.tokenizer.bpe import BpeEngine, CacheOptions, MergeTables
from services.tokenizer.decoding import Decoder, StreamDecoder
from services.tokenizer.pretokenize import PinnedPatterns, PreTokenizer
from services.tokenizer.tables import pair_rank_lookup, token_id_lookup
from shared import toolformat
from shared.encoding import fingerprint
from shared.errors import Fatal, InvalidInput, NotReady

_SIDES = ("left", "right")
# The sections that decide which ids a text gets (the rest are caches and checks derived from them).
_VOCAB_SECTIONS = (ff.TOKEN_OFFSETS, ff.TOKEN_BYTES, ff.BYTE_IDS, ff.PAIR_KEYS, ff.PAIR_RANKS, ff.RANK_IDS)
_WARMUP_TEXTS = ("The quick brown fox, 1984 -- isn't it?", "日本語と中文的句子没有空格所以很长。",
                 "    for i in range(10):\n        print(i)\n", "emoji 👩\u200d💻 ok")
_WARMUP_CHATS = ([("user", _WARMUP_TEXTS[0])], [("system", "Be brief."), ("user", _WARMUP_TEXTS[1])],
                 [("user", "hi"), ("assistant", _WARMUP_TEXTS[2]), ("user", _WARMUP_TEXTS[3])])


@dataclass(frozen=True)
class EncodeOptions:
    max_length: int | None = None
    truncation_side: str = "left"  # which end loses tokens when longer than max_length
    pad_to_max_length: bool = False
    padding_side: str = "left"
    pad_token_id: int = 2  # SmolLM2-Instruct pads with <|im_end|>, which is also its eos
    max_input_bytes: int = 1_000_000

    def __post_init__(self) -> None:
        problems = []
        if self.max_length is not None and (type(self.max_length) is not int or self.max_length < 1):
            problems.append("max_length must be a positive integer or None")
        if self.truncation_side not in _SIDES or self.padding_side not in _SIDES:
            problems.append("truncation_side and padding_side must be 'left' or 'right'")
        if self.pad_to_max_length and self.max_length is None:
            problems.append("pad_to_max_length needs max_length")
        if type(self.pad_token_id) is not int or self.pad_token_id < 0:
            problems.append("pad_token_id must be a non-negative integer")
        if type(self.max_input_bytes) is not int or self.max_input_bytes < 1:
            problems.append("max_input_bytes must be a positive integer")
        if problems:
            raise InvalidInput("; ".join(problems), reason="INVALID_OPTIONS")


@dataclass(frozen=True)
class Encoding:
    input_ids: list[int]
    attention_mask: list[int]
    position_ids: list[int]
    truncated: bool
    original_length: int  # token count before truncation and padding
    fingerprint: str  # sha256 hex of the three lists, see fingerprint()


class Tokenizer:
    def __init__(self, image: memoryview, header: ff.Header, meta: dict, cache: CacheOptions):
        self._image, self._header, self._meta = image, header, meta
        section = {tag: image[off:off + length] for tag, (off, length) in header.sections.items()}
        self.vocab_size: int = meta["vocab_size"]
        self.bos_token_id: int = meta["bos_token_id"]
        self.eos_token_id: int = meta["eos_token_id"]
        self.pad_token_id: int = meta["pad_token_id"]
        self.special_tokens: dict[str, int] = {tok: i for tok, i in meta["special_tokens"]}
        offsets = _u32(section, ff.TOKEN_OFFSETS, self.vocab_size + 1)
        blob = section[ff.TOKEN_BYTES]
        if offsets[-1] != len(blob):
            raise ff.CompiledFileError("token table and token bytes disagree", reason="COMPILED_FILE_CORRUPT")
        flags = _sized(section, ff.TOKEN_FLAGS, self.vocab_size)
        tables = MergeTables(
            byte_ids=list(_sized(section, ff.BYTE_IDS, 1024).cast("i")),
            rank_of=pair_rank_lookup(_table(section, ff.PAIR_KEYS, "Q"), _table(section, ff.PAIR_RANKS)),
            rank_ids=_u32(section, ff.RANK_IDS, meta["n_merges"]),
            token_id_of=token_id_lookup(_table(section, ff.TOKEN_HASH), offsets, blob),
            flags=flags, unsafe_pairs=_sized(section, ff.UNSAFE_PAIRS, 65536),
            max_token_bytes=meta["max_token_bytes"],
            char3=_sized(section, ff.CHAR3, 12 * (ff.CHAR3_END - ff.CHAR3_FIRST)).cast("I"),
            vocab_size=self.vocab_size, expansions=tuple(map(tuple, meta["synthetic"])))
        self.add_bos_token: bool = meta["add_bos_token"]
        self.add_eos_token: bool = meta["add_eos_token"]
        self._pre = PreTokenizer(self.special_tokens, PinnedPatterns(
            meta["rare_class"], meta["exact_pattern"], meta["rare_leads3"], meta["fast_pattern"]),
            ignore_merges=meta["ignore_merges"])
        self._bpe = BpeEngine(tables, self._pre, cache)
        # SentencePiece (family spm): ▁ in the text is a space, and each text segment gets the space prefix.
        self.add_space_prefix: bool = meta["add_space_prefix"]
        self._prefix_unless_space: bool = meta["prefix_unless_space"]  # HF's Metaspace: not before a space
        if meta["pretokenizer"] == "spm":
            self._ids = self._ids_spm
        self._decoder = Decoder(offsets, blob, frozenset(self.special_tokens.values()), self.add_space_prefix)
        self._words = _u32_array(section, ff.WORDS)
        self._chat = None
        # "model" (the model's Jinja template) or "plain" (chat.PlainRenderer: the model has none).
        self.chat_template_kind = "model" if meta.get("chat_template") else "plain"
        # How the template shows tool calls (shared/toolformat.py): "generic" when it cannot.
        self.tool_format = toolformat.detect(meta.get("chat_template"))
        # Identity of the encoding, for replay records (EncodeResponse); computed by warmup().
        self.vocab_sha256 = self.chat_template_sha256 = ""

    @classmethod
    def open(cls, compiled_file: Path, cache: CacheOptions = CacheOptions()) -> Tokenizer:
        """Map the compiled file; raises CompiledFileError (a Fatal) when it is unusable."""
        ff.require_little_endian()
        try:
            with open(compiled_file, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    raise ff.CompiledFileError(f"{compiled_file} is empty", reason="COMPILED_FILE_TRUNCATED")
                image = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        except OSError as exc:
            raise ff.CompiledFileError(f"cannot map {compiled_file}: {exc}",
                                       reason="COMPILED_FILE_UNREADABLE") from exc
        header = ff.parse_header(image)
        meta = ff.parse_meta(image, header)
        if meta.get("regex_version") != regex.__version__:
            raise ff.CompiledFileError(
                f"compiled with regex {meta.get('regex_version')}, running {regex.__version__}: recompile",
                reason="COMPILED_FILE_STALE")
        try:
            return cls(image, header, meta, cache)
        except (KeyError, TypeError, ValueError) as exc:
            raise ff.CompiledFileError(f"inconsistent compiled file: {exc!r}",
                                       reason="COMPILED_FILE_CORRUPT") from exc

    # -- readiness ---------------------------------------------------------------------------

    def self_check(self) -> None:
        """Checksum of the whole file, then the compiler's probes through every encode path."""
        if ff.file_crc32(self._image) != self._header.crc32:
            raise Fatal("compiled tokenizer file fails its checksum", reason="SELF_CHECK_FAILED")
        wrong = [text for text, expected in self._meta["probes"] if self._ids(text) != expected]
        wrong += [tok for tok, i in self.special_tokens.items() if self._ids(tok) != [i]]
        for text, expected in self._meta["probes"]:
            lossless = self._bpe.without_dropped_bytes(text.encode()).decode("utf-8", "replace")
            if self._decoder.decode(expected) != lossless:
                wrong.append(text)
        if wrong:
            raise Fatal(f"tokenizer self-check failed on {len(wrong)} probe(s)", reason="SELF_CHECK_FAILED",
                        metadata={"first": repr(wrong[0])[:200]})

    def warmup(self) -> None:
        """Import and compile what requests need, put frequent words in the piece cache, and run
        each code path once (streamed decoding is checked against whole decoding on the way)."""
        self.vocab_sha256, self.chat_template_sha256 = self._identity()
        if self._meta.get("chat_template"):
            from services.tokenizer.chat import ChatRenderer
            self._chat = ChatRenderer(self._meta["chat_template"], self._meta["special_strings"])
        else:
            from services.tokenizer.chat import PlainRenderer
            self._chat = PlainRenderer()
        self._bpe.prefill(self._stable_words())
        texts = [*_WARMUP_TEXTS, *(text for text, _ in self._meta["probes"])]
        if self._chat is not None:
            for _ in range(8):  # jinja2 and the interpreter settle after a few renders, not one
                for messages in _WARMUP_CHATS:
                    self.render_chat(messages, add_generation_prompt=False)
            texts += [self.render_chat(messages) for messages in _WARMUP_CHATS]
        for text in texts:
            for options in (EncodeOptions(), EncodeOptions(max_length=8, pad_to_max_length=True),
                            EncodeOptions(max_length=8, truncation_side="right", padding_side="right")):
                self.encode(text, options)
            ids = self.encode_ids(text.encode())
            stream = self.stream_decoder(skip_special_tokens=False)
            if "".join(map(stream.push, ids)) + stream.finish() != self.decode(ids):
                raise Fatal("the stream decoder disagrees with decode", reason="SELF_CHECK_FAILED",
                            metadata={"text": repr(text)[:200]})

    def _identity(self) -> tuple[str, str]:
        """(vocabulary hash, chat-template hash): sha256 hex of what decides the ids a text gets
        (the vocabulary, merge and byte tables, special tokens, pre-tokenizer pattern and BPE
        flags), and of the chat template with the special strings it is rendered with (without a
        template: the hash of chat.PLAIN_TEMPLATE_ID, the plain rendering's name).
        Computed once per process."""
        vocab = hashlib.sha256(b"keel.tokenizer.vocab.v1\x00")
        for tag in _VOCAB_SECTIONS:
            off, length = self._header.sections[tag]
            vocab.update(tag + length.to_bytes(8, "little"))
            vocab.update(self._image[off:off + length])
        meta = self._meta
        identity = [meta["special_tokens"], meta["pretokenizer"], meta["exact_pattern"]]
        if meta["ignore_merges"] or meta["add_bos_token"] or meta["add_eos_token"]:  # SmolLM2's hash unchanged
            identity += [meta["ignore_merges"], meta["add_bos_token"], meta["add_eos_token"]]
        if meta["add_space_prefix"] or meta["synthetic"]:
            identity += [meta["add_space_prefix"], meta["synthetic"], meta["prefix_unless_space"]]
        vocab.update(json.dumps(identity, sort_keys=True, ensure_ascii=False).encode())
        template = meta.get("chat_template") or ""
        if template:
            chat = hashlib.sha256(json.dumps([template, meta.get("special_strings", {})], sort_keys=True,
                                             ensure_ascii=False).encode()).hexdigest()
        else:
            from services.tokenizer.chat import PLAIN_TEMPLATE_ID
            chat = hashlib.sha256(PLAIN_TEMPLATE_ID.encode()).hexdigest()
        return vocab.hexdigest(), chat

    def _stable_words(self) -> Iterable[tuple[str, int]]:
        """The compiler's list of whole-piece tokens BPE reproduces, most frequent merges first."""
        for token in self._words:
            yield self._decoder.token_bytes([token]).decode("utf-8"), token

    # -- encode ------------------------------------------------------------------------------

    def encode(self, text: str | bytes, options: EncodeOptions = EncodeOptions()) -> Encoding:
        if not isinstance(options, EncodeOptions):
            raise InvalidInput("options must be EncodeOptions", reason="INVALID_OPTIONS")
        if not 0 <= options.pad_token_id < self.vocab_size:
            raise InvalidInput(f"pad_token_id {options.pad_token_id} is outside the vocabulary",
                               reason="INVALID_OPTIONS")
        text = _checked_text(text, options.max_input_bytes)
        if not text:
            raise InvalidInput("input text is empty", reason="EMPTY_INPUT")
        ids = self._ids(text)
        # The file's add_bos_token/add_eos_token (a text that already starts with BOS, as rendered
        # chat templates do, does not get a second one).
        if self.add_bos_token and 0 <= self.bos_token_id and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        if self.add_eos_token and 0 <= self.eos_token_id:
            ids.append(self.eos_token_id)
        original = len(ids)
        limit = options.max_length
        truncated = limit is not None and original > limit
        if truncated:
            ids = ids[original - limit:] if options.truncation_side == "left" else ids[:limit]
        mask, positions = [1] * len(ids), list(range(len(ids)))
        pad = limit - len(ids) if options.pad_to_max_length else 0
        if pad > 0:
            fill = [options.pad_token_id] * pad
            if options.padding_side == "left":
                ids, mask, positions = fill + ids, [0] * pad + mask, [0] * pad + positions
            else:
                ids, mask, positions = ids + fill, mask + [0] * pad, positions + [0] * pad
        return Encoding(ids, mask, positions, truncated, original, fingerprint(ids, mask, positions))

    def encode_ids(self, text: str | bytes, max_input_bytes: int = EncodeOptions.max_input_bytes) -> list[int]:
        """Raw ids: no truncation, no padding; an empty text gives []."""
        if type(text) is not str or len(text) > max_input_bytes or not text.isascii():
            text = _checked_text(text, max_input_bytes)  # ASCII str within the limit needs no more checks
        return self._ids(text)

    def _ids(self, text: str) -> list[int]:
        marker = self._pre.special_marker
        if marker is not None and marker not in text:
            return self._bpe.encode_segment(text)
        parts = self._pre.split_special(text)
        if len(parts) == 1 and type(parts[0]) is str:
            return self._bpe.encode_segment(parts[0])
        out: list[int] = []
        for part in parts:
            if type(part) is int:
                out.append(part)
            else:
                out += self._bpe.encode_segment(part)
        return out

    def _ids_spm(self, text: str) -> list[int]:
        """SentencePiece: a space before each text segment (at the start and after a special token)
        when the model says so, and ▁ in the text is the same symbol as a space."""
        out: list[int] = []
        prefix = " " if self.add_space_prefix else ""
        unless_space = self._prefix_unless_space
        for part in self._pre.split_special(text):
            if type(part) is int:
                out.append(part)
            else:
                part = part.replace("\u2581", " ")
                out += self._bpe.encode_segment(part if unless_space and part[0] == " " else prefix + part)
        return out

    # -- chat and decode ---------------------------------------------------------------------

    def render_chat(self, messages: list[tuple[str, str]], add_generation_prompt: bool = True,
                    tools: Sequence[dict] = (), extras: Sequence[dict] = ()) -> str:
        """The chat as the model's template renders it (services/tokenizer/chat.py: ``tools`` and
        a turn's ``extras`` in transformers' shape)."""
        if self._chat is None:
            raise NotReady("render_chat before warmup()", reason="NOT_WARMED_UP")
        return self._chat.render(messages, add_generation_prompt, tools, extras)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._decoder.decode(ids, skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        return StreamDecoder(self._decoder, skip_special_tokens)

    def cache_sizes(self) -> dict[str, int]:
        return self._bpe.cache_sizes()


def _checked_text(text: str | bytes, limit: int) -> str:
    """Type, size and UTF-8 checks shared by every entry point."""
    if isinstance(text, str):
        if len(text) > limit:  # every character is at least one byte: no need to encode to know
            raise _too_large(len(text), limit)
        if not text.isascii():
            try:
                size = len(text.encode("utf-8"))
            except UnicodeEncodeError as exc:
                raise InvalidInput("text holds a lone surrogate, which is not valid UTF-8",
                                   reason="INVALID_UTF8", metadata={"offset": exc.start}) from None
            if size > limit:
                raise _too_large(size, limit)
        return text
    if isinstance(text, (bytes, bytearray, memoryview)):
        data = bytes(text)
        if len(data) > limit:
            raise _too_large(len(data), limit)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInput(f"input is not valid UTF-8 at byte {exc.start}", reason="INVALID_UTF8",
                               metadata={"offset": exc.start}) from None
    raise InvalidInput(f"text must be str or bytes, not {type(text).__name__}", reason="INVALID_INPUT_TYPE")


def _too_large(size: int, limit: int) -> InvalidInput:
    return InvalidInput(f"input is over {limit} bytes", reason="INPUT_TOO_LARGE",
                        metadata={"limit": limit, "size_at_least": size})


def _sized(section: dict, tag: bytes, length: int) -> memoryview:
    view = section[tag]
    if len(view) != length:
        raise ff.CompiledFileError(f"section {tag.decode()} has {len(view)} bytes, expected {length}",
                                   reason="COMPILED_FILE_CORRUPT")
    return view


def _u32(section: dict, tag: bytes, count: int) -> memoryview:
    return _sized(section, tag, 4 * count).cast("I")


def _u32_array(section: dict, tag: bytes) -> memoryview:
    view = section[tag]
    if len(view) % 4:
        raise ff.CompiledFileError(f"section {tag.decode()} is not a u32 array", reason="COMPILED_FILE_CORRUPT")
    return view.cast("I")


def _table(section: dict, tag: bytes, fmt: str = "I") -> memoryview:
    """A power-of-two table of u32 (``fmt`` "I") or u64 ("Q") slots."""
    view = section[tag]
    size = 8 if fmt == "Q" else 4
    slots = len(view) // size
    if len(view) % size or slots < 2 or slots & (slots - 1):
        raise ff.CompiledFileError(f"section {tag.decode()} is not a power-of-two table",
                                   reason="COMPILED_FILE_CORRUPT")
    return view.cast(fmt)
