"""The compiled tokenizer file: a versioned, little-endian, 64-byte-aligned flat binary.

Layout::

    header   magic "KEELTOK\\0", format version, header size, section count, CRC-32 of the whole
             file except the CRC field, SHA-256/size/mtime of the source GGUF
    table    one (tag, offset, length) entry per section
    sections each starts on a 64-byte boundary; arrays are little-endian u32/i32/u8

Workers ``mmap`` the file read-only, so the tables are page-cache pages shared by every process.
Readers check magic, version and every section's bounds on open; the CRC is checked by
``Tokenizer.self_check`` (it reads every page, which opening deliberately does not).
"""
from __future__ import annotations

import json
import os
import struct
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

from shared.errors import Fatal

MAGIC = b"KEELTOK\x00"
FORMAT_VERSION = 4  # 2: META names the family's fast pattern, ignore_merges, add_bos/eos;
# 3: add_space_prefix and synthetic (SentencePiece); 4: 18-bit token ids (u64 pair keys, u32 CHAR3)
ALIGN = 64
HEADER = struct.Struct("<8sIIII32sQQ")  # magic, version, header_size, n_sections, crc32, sha, size, mtime
SECTION = struct.Struct("<4sIQQ")      # tag, reserved, offset, length
CRC_OFFSET = 20                        # byte offset of the crc32 field inside HEADER

# Section tags and what they hold (n = vocab size, m = merge count).
META = b"META"  # UTF-8 JSON: ids, special tokens, chat template, patterns, BPE flags, self-check probes
TOKEN_OFFSETS = b"TOFF"  # u32[n+1]: token i's bytes are TOKEN_BYTES[off[i]:off[i+1]]
TOKEN_BYTES = b"TBYT"  # what decoding each token yields
TOKEN_FLAGS = b"TFLG"  # u8[n]: FLAG_SPECIAL | FLAG_STABLE
TOKEN_HASH = b"THSH"  # u32[2^k] open addressing on crc32(bytes): id+1, 0 = empty
PAIR_KEYS = b"PKEY"  # u64[2^k] open addressing on (left << 18 | right), 2^64 - 1 = empty (tables.py)
PAIR_RANKS = b"PRNK"  # u32[2^k] merge rank of the pair in the same slot
RANK_IDS = b"RKID"  # u32[m]: id of the token a merge of that rank produces
BYTE_IDS = b"BYID"  # i32[256]: id of each single byte, -1 when the vocabulary lacks it
UNSAFE_PAIRS = b"XBIG"  # u8[65536]: 1 when bytes (a, b) occur adjacent inside a token, b starting a char
WORDS = b"WORD"  # u32[]: stable tokens that are one whole piece, in merge order (cache prefill)
CHAR3 = b"CHR3"  # u32[3 * 63488]: BPE of each character U+0800..U+FFFF, padded with NO_ID
REQUIRED = (META, TOKEN_OFFSETS, TOKEN_BYTES, TOKEN_FLAGS, TOKEN_HASH, PAIR_KEYS, PAIR_RANKS,
            RANK_IDS, BYTE_IDS, UNSAFE_PAIRS, WORDS, CHAR3)
CHAR3_FIRST, CHAR3_END = 0x800, 0x10000
NO_ID = 0xFFFFFFFF  # padding in CHAR3; no id reaches it (ids are below 2^18, tables.MAX_VOCAB)

FLAG_SPECIAL = 1  # an added special token: matched before pre-tokenization, never produced by merges
FLAG_STABLE = 2  # BPE of the token's own bytes yields exactly this token (a cache-miss shortcut)


class CompiledFileError(Fatal):
    """The compiled tokenizer file is missing, damaged, or from another format version."""


@dataclass(frozen=True)
class SourceInfo:
    sha256: bytes
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Header:
    version: int
    header_size: int
    crc32: int
    source: SourceInfo
    sections: dict[bytes, tuple[int, int]]  # tag -> (offset, length)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def require_little_endian() -> None:
    if sys.byteorder != "little" or struct.calcsize("I") != 4 or struct.calcsize("i") != 4:
        raise Fatal("the compiled tokenizer format needs a little-endian host with 4-byte ints",
                    reason="UNSUPPORTED_HOST")


def write(path: Path, sections: dict[bytes, bytes], source: SourceInfo) -> None:
    """Write atomically: readers see the old file or the complete new one, never a partial one."""
    require_little_endian()
    header_size = _align(HEADER.size + SECTION.size * len(sections))
    table, layout, offset = [], [], header_size
    for tag, data in sections.items():
        table.append(SECTION.pack(tag, 0, offset, len(data)))
        layout.append((offset, data))
        offset = _align(offset + len(data))
    image = bytearray(offset)
    image[HEADER.size:HEADER.size + len(b"".join(table))] = b"".join(table)
    for start, data in layout:
        image[start:start + len(data)] = data
    image[:HEADER.size] = HEADER.pack(MAGIC, FORMAT_VERSION, header_size, len(sections), 0,
                                      source.sha256, source.size, source.mtime_ns)
    struct.pack_into("<I", image, CRC_OFFSET, file_crc32(image))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # per process: concurrent writers never collide
    try:
        with open(tmp, "wb") as out:
            out.write(image)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def file_crc32(image) -> int:
    """CRC-32 of the whole image with the CRC field itself skipped."""
    view = memoryview(image)
    return zlib.crc32(view[CRC_OFFSET + 4:], zlib.crc32(view[:CRC_OFFSET]))


def parse_header(image) -> Header:
    """Check magic, version and section bounds; raise CompiledFileError with a precise reason."""
    size = len(image)
    if size < HEADER.size:
        raise CompiledFileError(f"file is {size} bytes, shorter than the header",
                                reason="COMPILED_FILE_TRUNCATED")
    magic, version, header_size, n_sections, crc, sha, src_size, mtime = HEADER.unpack_from(image, 0)
    if magic != MAGIC:
        raise CompiledFileError(f"bad magic {magic!r}: not a compiled tokenizer file",
                                reason="COMPILED_FILE_BAD_MAGIC")
    if version != FORMAT_VERSION:
        raise CompiledFileError(f"format version {version}, this build reads {FORMAT_VERSION}: recompile",
                                reason="COMPILED_FILE_VERSION", metadata={"version": version})
    if header_size < HEADER.size + SECTION.size * n_sections or header_size > size:
        raise CompiledFileError("section table runs past the end of the file",
                                reason="COMPILED_FILE_TRUNCATED")
    sections = {}
    for i in range(n_sections):
        tag, _, offset, length = SECTION.unpack_from(image, HEADER.size + SECTION.size * i)
        if offset % ALIGN or offset < header_size:
            raise CompiledFileError(f"section {tag!r} is misplaced", reason="COMPILED_FILE_CORRUPT")
        if offset + length > size:
            raise CompiledFileError(f"section {tag!r} ends at {offset + length}, file has {size} bytes",
                                    reason="COMPILED_FILE_TRUNCATED")
        sections[tag] = (offset, length)
    expected = _align(max((offset + length for offset, length in sections.values()), default=header_size))
    if size != expected:  # the writer pads the last section to the alignment: sizes must agree
        raise CompiledFileError(f"file has {size} bytes, its sections need {expected}",
                                reason="COMPILED_FILE_TRUNCATED" if size < expected else "COMPILED_FILE_CORRUPT")
    missing = [tag.decode() for tag in REQUIRED if tag not in sections]
    if missing:
        raise CompiledFileError(f"sections missing: {missing}", reason="COMPILED_FILE_CORRUPT")
    return Header(version, header_size, crc, SourceInfo(sha, src_size, mtime), sections)


def parse_meta(image, header: Header) -> dict:
    offset, length = header.sections[META]
    try:
        return json.loads(bytes(image[offset:offset + length]))
    except ValueError as exc:
        raise CompiledFileError(f"metadata is not JSON: {exc}", reason="COMPILED_FILE_CORRUPT") from exc


def read_summary(path: Path) -> tuple[Header, dict] | None:
    """Header and metadata of an existing file, or None when it is absent or unreadable."""
    try:
        image = path.read_bytes()
        header = parse_header(image)
        return header, parse_meta(image, header)
    except (OSError, CompiledFileError):
        return None
