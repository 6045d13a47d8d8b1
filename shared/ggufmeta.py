"""A GGUF file's header: its metadata (key -> value) and its tensor table, read in one pass.

gguf-py's GGUFReader builds a numpy view per field and per array element: 4-7 s for a 49k-token
vocabulary on a 2-core host, longer than the rest of a stage's start. This reader walks the same
layout (GGUF v2/v3, little-endian: magic, version, tensor count, KV count, the KV pairs, the tensor
infos, then the data aligned to `general.alignment`) with struct and bulk numpy reads, and returns
plain Python values: str, int, float, bool, and lists of them (numeric arrays as lists too).
Only the header is read; the tensors' bytes stay in the file (`Tensor.offset` is from its start).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
HEADER_MAX = 64 << 20  # bytes read for the header; a longer one is refused as cut short

# GGUF value types: id -> (struct format, numpy dtype) for the fixed-size ones.
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9


class GgufError(ValueError):
    """The file is not a GGUF this reader understands (its message says where it stopped)."""


class CutShort(GgufError):
    """The bytes read end inside the header."""


@dataclass(frozen=True)
class Tensor:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # rows first, as torch orders it: [out, in] for a weight
    offset: int             # bytes from the start of the file


@dataclass(frozen=True)
class Header:
    version: int
    metadata: dict[str, object]
    tensors: dict[str, Tensor]

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch(self, key: str, default=None):
        """`<architecture>.<key>`, e.g. arch("context_length")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


class _Cursor:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def take(self, fmt: str):
        value = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        raw = self.data[self.pos:self.pos + n]
        if len(raw) != n:
            raise CutShort("the file ends inside a string")
        self.pos += n
        return raw.decode("utf-8", errors="surrogateescape")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.take(_SCALARS[kind][0])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, n = self.take("<I"), self.take("<Q")
            if item in _SCALARS:
                dtype = np.dtype(_SCALARS[item][1])
                end = self.pos + n * dtype.itemsize
                if end > len(self.data):
                    raise CutShort("the file ends inside an array")
                values = np.frombuffer(self.data, dtype=dtype, count=n, offset=self.pos).tolist()
                self.pos = end
                return values
            return [self.value(item) for _ in range(n)]
        raise GgufError(f"unknown GGUF value type {kind} at byte {self.pos}")


def read(path: str | Path) -> Header:
    """The header of the GGUF at `path`; GgufError when it is not one. The file's first bytes are read
    in growing chunks until the header parses (a few MB even for a 150k-token vocabulary; the weights
    behind it are never read), at most HEADER_MAX."""
    path = Path(path)
    size = path.stat().st_size
    chunk = 4 << 20
    while True:
        with path.open("rb") as f:
            data = f.read(min(chunk, size, HEADER_MAX))
        try:
            return _parse(path, data)
        except CutShort:
            if len(data) >= min(size, HEADER_MAX):
                raise
            chunk *= 4


def _parse(path: Path, data: bytes) -> Header:
    c = _Cursor(data)
    try:
        if c.data[:4] != MAGIC:
            raise GgufError(f"{Path(path).name} is not a GGUF file (no GGUF magic)")
        c.pos = 4
        version = c.take("<I")
        if version not in (2, 3):
            raise GgufError(f"GGUF version {version}; this reader takes 2 and 3")
        n_tensors, n_kv = c.take("<Q"), c.take("<Q")
        metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = c.string()
            metadata[key] = c.value(c.take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            dims = [c.take("<Q") for _ in range(c.take("<I"))]
            infos.append((name, dims, c.take("<I"), c.take("<Q")))
    except struct.error as exc:
        raise CutShort(f"{Path(path).name}: the header is cut short ({exc})") from exc
    align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-c.pos // align) * align
    tensors = {name: Tensor(name, kind, tuple(reversed(dims)), start + offset) for name, dims, kind, offset in infos}
    return Header(version, metadata, tensors)
