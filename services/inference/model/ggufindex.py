"""The GGUF's tensor table, kept beside the model so a start reads the blocks without parsing the file.

gguf-py's GGUFReader parses every metadata field, the vocabulary's ~100k strings included: 6.6 s for
SmolLM2's file on a 2-core host, more than the rest of a start. The table it finds (each tensor's
name, ggml type, shape and byte range) is written once to `<model dir>/gguf-index.json` (`make model`
does it; a start that finds no table, or one made for another file, makes it again), and a start
then reads each tensor's bytes straight from the file.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from shared.jsonfile import write_json

log = logging.getLogger(__name__)

INDEX_NAME = "gguf-index.json"


@dataclass(frozen=True)
class TensorEntry:
    ggml_type: int
    shape: tuple[int, ...]  # rows first: [out, in] for a weight, as torch orders it
    offset: int             # bytes from the start of the file
    nbytes: int


def _identity(gguf: Path) -> dict:
    st = gguf.stat()
    return {"gguf": str(gguf.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def build(gguf: Path) -> dict[str, TensorEntry]:
    """The table of `gguf`, read with gguf-py."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    return {t.name: TensorEntry(int(t.tensor_type), tuple(int(d) for d in reversed(t.shape.tolist())),
                                int(t.data_offset), int(t.n_bytes)) for t in reader.tensors}


def index(model_dir: Path, gguf: Path) -> dict[str, TensorEntry]:
    """`gguf`'s table from `model_dir`'s stored one when it was made for this very file, else built
    (and stored, when the folder is writable)."""
    path = model_dir / INDEX_NAME
    try:
        data = json.loads(path.read_text())
        if data["source"] == _identity(gguf):
            return {name: TensorEntry(e["ggml_type"], tuple(e["shape"]), e["offset"], e["nbytes"])
                    for name, e in data["tensors"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    table = build(gguf)
    try:
        write_json(path, {"source": _identity(gguf), "tensors": {n: asdict(e) for n, e in table.items()}})
    except OSError as exc:  # a read-only model folder: every start parses the file again
        log.warning("GGUF tensor table not stored; each start parses the file", extra={"error": str(exc)})
    return table


def read(gguf: Path, entry: TensorEntry) -> np.ndarray:
    """The tensor's bytes, in memory of their own (no mapping of the file is kept): uint8 [rows, bytes per
    row] for blocks, float32 `shape` for F32 tensors."""
    raw = np.fromfile(gguf, dtype=np.uint8, count=entry.nbytes, offset=entry.offset)
    if entry.ggml_type == 0:
        return raw.view(np.float32).reshape(entry.shape)
    return raw.reshape(entry.shape[0], -1)
