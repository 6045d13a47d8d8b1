"""Comparing a replay with its original record: identical, first differing token, not comparable."""
from __future__ import annotations

from dataclasses import replace

from services.feedback.records import ReplayRecord, stored_body
from services.feedback.replay import can_run, compare
from testing.records import record


def body(trace_id="a" * 32, **kw) -> ReplayRecord:
    """A record as the store gives it back."""
    return ReplayRecord.from_body(stored_body(record(trace_id, **kw), store_prompts=True))


def test_identical():
    assert compare(body(), body("b" * 32)).describe() == "identical"


def test_first_differing_position_with_both_tokens():
    out = compare(body(output=(1, 2, 3, 4)), body("b" * 32, output=(1, 2, 9, 4)))
    assert (out.result, out.position, out.original, out.replayed) == ("mismatch", 2, 3, 9)
    assert "position 2" in out.describe() and "3" in out.describe() and "9" in out.describe()


def test_a_shorter_replay_differs_where_it_ended():
    out = compare(body(output=(1, 2, 3)), body("b" * 32, output=(1, 2)))
    assert (out.position, out.original, out.replayed) == (2, 3, None)
    assert "(end)" in out.describe()


def test_a_different_engine_or_prompt_is_not_comparable_naming_the_fields():
    other = replace(body("b" * 32, prompt=(9, 9), output=(0,)), engine={"format": "bfloat16"})
    out = compare(body(), other)
    assert out.result == "not_comparable" and out.fields == ("engine.format", "prompt_ids")
    assert out.describe() == "not comparable: engine.format, prompt_ids differ"


def test_a_different_tokenizer_or_chat_template_is_not_comparable_naming_the_hashes():
    original = replace(body(), vocab_sha256="v1" * 32, chat_template_sha256="c1" * 32)
    replay = replace(body("b" * 32), vocab_sha256="v2" * 32, chat_template_sha256="c2" * 32)
    out = compare(original, replay)           # even with the same prompt ids and output
    assert out.result == "not_comparable" and out.fields == ("vocab_sha256", "chat_template_sha256")
    assert out.describe() == "not comparable: vocab_sha256, chat_template_sha256 differ"
    replay = replace(replay, chat_template_sha256=original.chat_template_sha256)
    assert compare(original, replay).fields == ("vocab_sha256",)
    replay = replace(replay, vocab_sha256=original.vocab_sha256)
    assert compare(original, replay).result == "identical"


def test_a_record_written_before_the_hashes_existed_is_still_compared():
    replay = replace(body("b" * 32), vocab_sha256="v" * 64, chat_template_sha256="c" * 64)
    assert compare(body(), replay).result == "identical"


def test_hashes_only_cannot_run():
    assert can_run(ReplayRecord.from_body(stored_body(record("a" * 32), store_prompts=False))).result == "cannot_run"
    assert can_run(body()) is None
