"""Comparing a replayed request with its original replay record (pure: no database, no grpc).

A replay is comparable only when the engine facts recorded for both match (same weights format,
dtype, engine...), the tokenizer's vocabulary and chat-template hashes match, the prompt encoded to
the same ids, and the same LoRA adapter version served both; otherwise a token mismatch would say
nothing about determinism, so the outcome is "not comparable" with the fields that differ. A hash a
record lacks (written before records carried it) is not compared: the prompt ids still are.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from services.feedback.records import ReplayRecord

TOKENIZER_FIELDS = ("vocab_sha256", "chat_template_sha256")


@dataclass(frozen=True)
class Outcome:
    result: str                       # identical | mismatch | not_comparable | cannot_run
    position: int | None = None       # first differing output position (mismatch)
    original: int | None = None       # token there in the original (None: the original had ended)
    replayed: int | None = None       # token there in the replay (None: the replay had ended)
    fields: tuple[str, ...] = field(default_factory=tuple)  # what differs (not_comparable)
    replay_trace_id: str = ""

    def describe(self) -> str:
        if self.result == "identical":
            return "identical"
        if self.result == "mismatch":
            return (f"mismatch at output position {self.position}: original token {_tok(self.original)}, "
                    f"replay token {_tok(self.replayed)}")
        if self.result == "not_comparable":
            return "not comparable: " + ", ".join(self.fields) + " differ"
        return "cannot run: " + ", ".join(self.fields)


def _tok(t: int | None) -> str:
    return "(end)" if t is None else str(t)


def can_run(record: ReplayRecord) -> Outcome | None:
    """None when the record holds what a replay needs, else the cannot_run outcome saying why."""
    if not record.prompt_stored or record.messages is None:
        return Outcome("cannot_run", fields=("the prompt was not stored (replay.store_prompts: false)",))
    return None


def compare(original: ReplayRecord, replay: ReplayRecord) -> Outcome:
    engines = original.engine, replay.engine
    differ = sorted(f"engine.{k}" for k in set(engines[0]) | set(engines[1]) if engines[0].get(k) != engines[1].get(k))
    differ += [f for f in TOKENIZER_FIELDS
               if getattr(original, f) and getattr(replay, f) and getattr(original, f) != getattr(replay, f)]
    if original.prompt_ids != replay.prompt_ids:
        differ.append("prompt_ids")
    if original.adapter != replay.adapter:  # a record from before adapters: the base model ("") served it
        differ.append("adapter")
    if differ:
        return Outcome("not_comparable", fields=tuple(differ), replay_trace_id=replay.trace_id)
    a, b = original.output_ids or (), replay.output_ids or ()
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else None
        y = b[i] if i < len(b) else None
        if x != y:
            return Outcome("mismatch", position=i, original=x, replayed=y, replay_trace_id=replay.trace_id)
    return Outcome("identical", replay_trace_id=replay.trace_id)
