"""Install size of each stage image's Python dependencies: the gateway, tokenizer and validator
images install requirements.lock without its dev-only, bench-only and inference-only lines; the
inference image adds the inference-only lines (the torch stack).

For each group, ``pip install --dry-run --ignore-installed --no-deps --report`` into a scratch
target resolves exactly what the image's pip would install (nothing is installed); the size of each
resolved distribution is then summed from its installed files (RECORD) in this checkout's .venv,
which holds the same pins (torch is the CPU build, as in the images).

    .venv/bin/python -m bench.stage_sizes            # prints a Markdown table
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def group_lines() -> dict[str, list[str]]:
    core, heavy = [], []
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if "==" not in line or line.startswith("#") or "# dev-only" in line or "# bench-only" in line:
            continue
        (heavy if "# inference-only" in line else core).append(line.split()[0])
    return {"gateway / tokenizer / validator": core, "inference": core + heavy}


def resolve(pins: list[str]) -> list[str]:
    """Names pip would install for ``pins`` (dry run into an empty scratch target)."""
    with tempfile.TemporaryDirectory() as scratch:
        req = Path(scratch) / "req.txt"
        req.write_text("\n".join(pins) + "\n")
        report = Path(scratch) / "report.json"
        # The CPU torch wheel: the Makefile's wheel folder when there is one (as `make venv` uses).
        find_links = ["--find-links", "/opt/wheels"] if os.path.isdir("/opt/wheels") else []
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
                        "--no-deps", "--target", str(Path(scratch) / "t"), "--report", str(report),
                        *find_links, "-r", str(req)], check=True)
        return [i["metadata"]["name"] for i in json.loads(report.read_text())["install"]]


def installed_bytes(name: str) -> int:
    dist = metadata.distribution(name)
    return sum(os.path.getsize(p) for f in dist.files or () if os.path.isfile(p := dist.locate_file(f)))


def main() -> None:
    rows = []
    for group, pins in group_lines().items():
        names = resolve(pins)
        total = sum(installed_bytes(n) for n in names)
        torch = any(re.fullmatch(r"torch", n, re.I) for n in names)
        rows.append((group, len(names), total, torch))
    base = rows[-1][2]
    print("| image group | distributions | installed MiB | ratio to inference | torch |")
    print("| --- | --- | --- | --- | --- |")
    for group, count, total, torch in rows:
        print(f"| {group} | {count} | {total / 2**20:.1f} | {total / base:.3f} | {'yes' if torch else 'no'} |")


if __name__ == "__main__":
    main()
