"""The quality gate's probe set, stored as token ids (gate_probes.json), so the gate runs without a tokenizer.

The file holds the chat prompts of `bench/bench_inference.py` (10 forms x 20 subjects) rendered with the
model's chat template, each with the position its scoring starts at (the first token of the user's
text: the shared system preamble before it says nothing about a format), and the sha256 of those
sequences. `bench/gate_formats.py --write-probes` writes it (it alone needs the tokenizer); the gate at
first start (startgate.py) and `bench/gate_formats.py` read it. A file whose ids do not hash to the
stored digest is refused with a ConfigError: a gate scored on other prompts would not be this gate.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from shared.config import ConfigError

from services.inference.startup.gate import Sequence

PROBES_FILE = Path(__file__).with_name("gate_probes.json")
ABOUT = ("The quality gate's probe set (docs/inference-formats.md): the chat prompts of bench/bench_inference.py "
         "rendered with the model's chat template, as token ids; score_from is the first position scored. "
         "Written by `bench/gate_formats.py --write-probes`; sha256 covers the sequences.")


def describe(n: int) -> str:
    """How a stored gate result was measured (the `probe_set` of var/gate/<model sha256>.json)."""
    return (f"{n} chat prompts of services/inference/startup/gate_probes.json, teacher-forced, "
            "scored from the user's text to the assistant header")


def digest(sequences: list[Sequence]) -> str:
    rows = [[s.score_from, list(s.ids)] for s in sequences]
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def write(sequences: list[Sequence], path: Path = PROBES_FILE) -> None:
    """One sequence per line, so a change shows as a readable diff."""
    lines = ",\n".join(json.dumps({"score_from": s.score_from, "ids": list(s.ids)}, separators=(",", ":"))
                       for s in sequences)
    path.write_text(f'{{\n "about": {json.dumps(ABOUT)},\n "sha256": "{digest(sequences)}",\n'
                    f' "sequences": [\n{lines}\n ]\n}}\n')


def load(n: int | None = None, path: Path | None = None) -> list[Sequence]:
    """The first `n` probe sequences (all of them for None) of `path` (default PROBES_FILE); ConfigError
    when the file is unreadable, malformed or corrupted (its ids do not hash to its sha256), or holds
    fewer than `n`."""
    path = path or PROBES_FILE
    fix = "restore it (`git checkout`, or `bench/gate_formats.py --write-probes`) or set formats.gate_at_start: false"
    try:
        data = json.loads(path.read_text())
        sequences = [Sequence(tuple(int(i) for i in s["ids"]), int(s["score_from"])) for s in data["sequences"]]
        stored = data["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"field 'formats.gate_at_start' breaks rule 'probe set': {path} is unreadable "
                          f"({type(exc).__name__}: {exc}); {fix}") from exc
    if digest(sequences) != stored:
        raise ConfigError(f"field 'formats.gate_at_start' breaks rule 'probe set': {path} is corrupted: its token ids "
                          f"hash to sha256 {digest(sequences)[:16]}..., the file says {str(stored)[:16]}...; {fix}")
    bad = [k for k, s in enumerate(sequences) if not 1 <= s.score_from < len(s.ids) or min(s.ids) < 0]
    if bad:
        raise ConfigError(f"field 'formats.gate_at_start' breaks rule 'probe set': {path}: sequences {bad[:5]} "
                          f"have no position to score or a negative id; {fix}")
    if n is not None and n > len(sequences):
        raise ConfigError(f"field 'formats.gate_prompts' breaks rule 'maximum': {n} > the {len(sequences)} "
                          f"prompts of {path}")
    return sequences[:n]
