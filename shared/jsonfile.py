"""Atomic JSON files under var/ (warm-start records, gate results, the adapter registry's base)."""
from __future__ import annotations

import json
import os
from pathlib import Path


def write_json(path: Path, data: dict, **dumps) -> None:
    """Write `data` to `path` through a temporary file and a rename: a process killed mid-write leaves
    the old file or none, never half of one. Raises OSError where the folder cannot be written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, **dumps))
    tmp.replace(path)
