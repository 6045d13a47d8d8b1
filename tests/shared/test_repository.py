"""What git tracks: no symbolic links (a link committed from a working tree points at that one
machine's files, e.g. a node_modules under /tmp, and breaks every other clone)."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from shared.config import ROOT_DIR


@pytest.mark.skipif(not (ROOT_DIR / ".git").exists() or not shutil.which("git"), reason="not a git checkout")
def test_no_tracked_file_is_a_symbolic_link():
    staged = subprocess.run(["git", "ls-files", "--stage"], cwd=ROOT_DIR, capture_output=True, text=True,
                            check=True).stdout.splitlines()
    links = [line.split("\t", 1)[1] for line in staged if line.startswith("120000 ")]
    assert links == []
