"""The quality gate's prompt set, stored as token ids (gate_prompts.json), so the gate runs without a tokenizer.

The file holds the chat prompts below (FORMS x SUBJECTS: 10 x 20, which the benchmarks send too) rendered
with the model's chat template, each with the position its scoring starts at (the first token of the user's
text: the shared system preamble before it says nothing about a format), and the sha256 of those
sequences. `python -m services.inference.formats.gate --write-prompts` writes it (it alone needs the
tokenizer); the gate at first start (startgate.py) and `python -m services.inference.formats.gate` read it.
A file whose ids do not hash to the stored digest is refused with a ConfigError: a gate scored on other
prompts would not be this gate.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from services.inference.formats.quality import Sequence
from shared.config import ConfigError

PROMPTS_FILE = Path(__file__).with_name("gate_prompts.json")
ABOUT = ("The quality gate's prompt set (docs/inference-formats.md): the chat prompts of "
         "services/inference/formats/gateprompts.py "
         "rendered with the model's chat template, as token ids; score_from is the first position scored. "
         "Written by `python -m services.inference.formats.gate --write-prompts`; sha256 covers the sequences.")
SUBJECTS = ["the moon", "photosynthesis", "the French revolution", "prime numbers", "volcanoes", "coffee",
            "the internet", "black holes", "honey bees", "the Roman empire", "climate change", "chess",
            "the human heart", "electric cars", "jazz music", "glaciers", "vaccines", "the printing press",
            "octopuses", "solar panels"]
FORMS = ["Explain {} in two sentences.", "Write a short poem about {}.", "Give three facts about {}.",
         "What is the history of {}?", "Why is {} important?", "Describe {} to a child.",
         "List common misconceptions about {}.", "Write a tweet about {}.", "How does {} work?",
         "Summarize what you know about {}."]


def chat_prompts(tok, n: int) -> list[list[int]]:
    """The first n prompts (FORMS x SUBJECTS) as token ids, rendered with `tok`'s chat template."""
    texts = [f.format(s) for f in FORMS for s in SUBJECTS][:n]
    out = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
    return [list(p["input_ids"] if hasattr(p, "keys") else p) for p in out]


def describe(n: int) -> str:
    """How a stored gate result was measured (the `prompt_set` of var/gate/<model sha256>.json)."""
    return (f"{n} chat prompts of services/inference/formats/gate_prompts.json, teacher-forced, "
            "scored from the user's text to the assistant header")


def digest(sequences: list[Sequence]) -> str:
    rows = [[s.score_from, list(s.ids)] for s in sequences]
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def write(sequences: list[Sequence], path: Path = PROMPTS_FILE) -> None:
    """One sequence per line, so a change shows as a readable diff."""
    lines = ",\n".join(json.dumps({"score_from": s.score_from, "ids": list(s.ids)}, separators=(",", ":"))
                       for s in sequences)
    path.write_text(f'{{\n "about": {json.dumps(ABOUT)},\n "sha256": "{digest(sequences)}",\n'
                    f' "sequences": [\n{lines}\n ]\n}}\n')


def load(n: int | None = None, path: Path | None = None) -> list[Sequence]:
    """The first `n` prompt sequences (all of them for None) of `path` (default PROMPTS_FILE); ConfigError
    when the file is unreadable, malformed or corrupted (its ids do not hash to its sha256), or holds
    fewer than `n`."""
    path = path or PROMPTS_FILE
    fix = ("restore it (`git checkout`, or `python -m services.inference.formats.gate --write-prompts`) "
           "or set formats.gate_at_start: false")
    try:
        data = json.loads(path.read_text())
        sequences = [Sequence(tuple(int(i) for i in s["ids"]), int(s["score_from"])) for s in data["sequences"]]
        stored = data["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"field 'formats.gate_at_start' breaks rule 'prompt set': {path} is unreadable "
                          f"({type(exc).__name__}: {exc}); {fix}") from exc
    if digest(sequences) != stored:
        raise ConfigError(f"field 'formats.gate_at_start' breaks rule 'prompt set': {path} is corrupted: its token ids "
                          f"hash to sha256 {digest(sequences)[:16]}..., the file says {str(stored)[:16]}...; {fix}")
    bad = [k for k, s in enumerate(sequences) if not 1 <= s.score_from < len(s.ids) or min(s.ids) < 0]
    if bad:
        raise ConfigError(f"field 'formats.gate_at_start' breaks rule 'prompt set': {path}: sequences {bad[:5]} "
                          f"have no position to score or a negative id; {fix}")
    if n is not None and n > len(sequences):
        raise ConfigError(f"field 'formats.gate_prompts' breaks rule 'maximum': {n} > the {len(sequences)} "
                          f"prompts of {path}")
    return sequences[:n]
