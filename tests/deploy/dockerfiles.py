"""Helpers for tests/deploy: read deploy/docker/Dockerfile (every stage's image) as build stages and instructions."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuations joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def stages_of(text: str) -> list[dict]:
    """One dict per build stage: base image, name, and its instructions."""
    stages: list[dict] = []
    for word, args in instructions(text):
        if word == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append({"base": parts[0], "name": name, "body": []})
        elif stages:
            stages[-1]["body"].append((word, args))
    return stages


DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"


def dockerfile() -> str:
    return DOCKERFILE.read_text()


def section(stage: str, text: str | None = None) -> list[tuple[str, str]]:
    """The instructions of the image `--build-arg STAGE=<stage>` builds: its base sections' (FROM
    name -> ... -> an external image) followed by its own, in build order."""
    by_name = {s["name"]: s for s in stages_of(text or dockerfile()) if s["name"]}
    assert stage in by_name, f"no section named {stage!r} in {DOCKERFILE.relative_to(ROOT)}"
    chain, st = [], by_name[stage]
    while st is not None:
        chain.append(st)
        st = by_name.get(st["base"])
    return [ins for st in reversed(chain) for ins in st["body"]]
