"""The identity of the served model: a sha256 over its directory's config and weight files (or over the
GGUF file itself, for a model served straight from one).

Gate results (var/gate/<sha>.json), warm-start records and adapters' base fingerprints are keyed by it.
Hashing ~500 MB of weights takes a second or two, so each file's hash is cached by (size, mtime).
"""
from __future__ import annotations

from pathlib import Path

from services.inference.model import ggufindex
from shared.modelfile import digest_files


def model_sha256(model_dir: Path) -> str:
    """sha256 over the model directory's config and weight files, or of a GGUF file
    (shared/modelfile.digest_files)."""
    if Path(model_dir).is_file():
        return digest_files([Path(model_dir)])
    files = (p for p in Path(model_dir).iterdir()
             if p.suffix in (".json", ".safetensors") and p.name != ggufindex.INDEX_NAME)  # the index is derived
    return digest_files(sorted(files))
