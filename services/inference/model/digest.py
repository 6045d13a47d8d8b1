"""The identity of the served model: a sha256 over its directory's config and weight files.

Gate results (var/gate/<sha>.json), warm-start records and adapters' base fingerprints are keyed by it.
Hashing ~500 MB of weights takes a second or two, so each file's hash is cached by (size, mtime).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from services.inference.model import ggufindex
from shared.config import var_dir
from shared.jsonfile import write_json


def model_sha256(model_dir: Path) -> str:
    """sha256 over the model directory's config and weight files, each hashed once per (size, mtime)."""
    cache_path = var_dir() / "warm" / "file-hashes.json"
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    total = hashlib.sha256()
    changed = False
    files = (p for p in Path(model_dir).iterdir()
             if p.suffix in (".json", ".safetensors") and p.name != ggufindex.INDEX_NAME)  # the index is derived
    for path in sorted(files):
        st = path.stat()
        key = str(path.resolve())
        entry = cache.get(key)
        if not entry or entry["size"] != st.st_size or entry["mtime_ns"] != st.st_mtime_ns:
            digest = hashlib.sha256()
            with path.open("rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
            entry = cache[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest.hexdigest()}
            changed = True
        total.update(f"{path.name}:{entry['sha256']}\n".encode())
    if changed:
        try:
            write_json(cache_path, cache)
        except OSError:  # a read-only var/: the next start hashes the files again
            pass
    return total.hexdigest()
