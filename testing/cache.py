"""Test fixtures built once into var/ and kept: a folder is written under a temporary name beside its
final one and renamed, so a run killed half-way, or two processes building at once, never leave a
partial folder behind."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def built_once(out: Path, build: Callable[[Path], None]) -> Path:
    """`out`, made by `build(folder)` the first time (a folder that already exists is taken as built)."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, out)
        except OSError:  # another process built it first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
