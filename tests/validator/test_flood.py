"""The quarantine under a flood of refused inputs: a repeated payload is stored once, each source
is capped per window, every drop is counted and said; oversized payloads are stored clipped with
the hash and size of the whole; invisible-only prompts are refused and kept. Real Redis."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from services.validator.core import ValidatorCore
from services.validator.flood import DUPLICATE, SOURCE_CAP, FloodGate
from services.validator.output_pipeline import PipelineConfig
from services.validator.quarantine import QuarantineConfig
from services.validator.records import QuarantineRecord
from shared.clip import HEAD, TRUNCATED, canonical_json, clip_payload
from shared.errors import INVISIBLE_INPUT, InvalidInput
from tests.validator.test_core import entries

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = PipelineConfig.load(ROOT / "config" / "validator" / "pipeline.yaml")


@pytest.fixture
def make_core(tmp_path):
    cores, drops = [], []

    def build(url, **quarantine):
        cfg = QuarantineConfig(redis_url=url, spill_path=tmp_path / f"q{len(cores)}.spill",
                               probe_interval_s=0.05, **quarantine)
        core = ValidatorCore.build(ROOT / "config" / "contracts", PIPELINE, cfg, on_drop=drops.append)
        core.start()
        cores.append(core)
        return core
    build.drops = drops
    yield build
    for core in cores:
        core.close()


def reject(core, prompt: str, source="web") -> InvalidInput:
    with pytest.raises(InvalidInput) as exc:
        core.validate_input(json.dumps({"prompt": prompt, "max_tokens": 8}), source=source,
                            domain="default", trace_id="0" * 32)
    return exc.value


def test_a_repeated_payload_is_stored_once_and_the_repeats_are_counted(make_core, redis_url):
    core = make_core(redis_url)
    first = reject(core, "render {{ secrets }}")
    repeats = [reject(core, "render {{ secrets }}") for _ in range(4)]
    assert [e.metadata["quarantine_id"] for e in repeats] == [first.metadata["quarantine_id"]] * 4
    assert {e.metadata["quarantine_dropped"] for e in repeats} == {DUPLICATE}
    assert "quarantine_dropped" not in first.metadata
    assert [r.record_id for r in entries(redis_url)] == [first.metadata["quarantine_id"]]
    assert make_core.drops == [DUPLICATE] * 4


def test_each_source_is_capped_per_window(make_core, redis_url):
    core = make_core(redis_url, max_per_source=3)
    errs = [reject(core, f"case {i} {{{{ x }}}}") for i in range(5)]
    assert [e.metadata.get("quarantine_dropped", "") for e in errs] == ["", "", "", SOURCE_CAP, SOURCE_CAP]
    assert all(e.reason == "PROMPT_INJECTION" for e in errs)       # the answer is the same refusal
    other = reject(core, "case 9 {{ x }}", source="mobile")
    assert "quarantine_dropped" not in other.metadata
    assert len(entries(redis_url)) == 4 and make_core.drops == [SOURCE_CAP] * 2


def test_the_gate_forgets_after_its_windows():
    now = [100.0]
    gate = FloodGate(dedup_window_s=10, max_per_source=1, source_window_s=5, max_tracked=100,
                     clock=lambda: now[0])

    def record(text):
        return QuarantineRecord(kind="input", reason="R", rule="r", trace_id="", source="web",
                                domain="default", payload={"prompt": text})
    assert gate.admit(record("a")) is None
    assert gate.admit(record("b")).why == SOURCE_CAP
    assert gate.admit(record("a")).why == DUPLICATE
    now[0] += 5
    assert gate.admit(record("b")) is None
    now[0] += 6
    assert gate.admit(record("a")) is None                 # its first copy is older than the dedup window
    assert gate.admit(record("c")).why == SOURCE_CAP
    assert gate.admit(record("a")).why == DUPLICATE


def test_an_oversized_payload_is_stored_clipped_with_the_hash_and_size_of_the_whole(make_core, redis_url):
    core = make_core(redis_url)
    payload = {"prompt": "\u0001" * 700_000, "max_tokens": 8}
    whole = canonical_json(payload).encode()
    with pytest.raises(InvalidInput) as exc:
        core.quarantine_rejected(json.dumps(payload), source="web", domain="default", trace_id="0" * 32,
                                 reason="PROMPT_TOO_LARGE", message="too large")
    [rec] = entries(redis_url)
    assert rec.record_id == exc.value.metadata["quarantine_id"]
    assert rec.payload[TRUNCATED] == {"sha256": hashlib.sha256(whole).hexdigest(), "bytes": len(whole)}
    assert rec.fingerprint == hashlib.sha256(whole).hexdigest()
    assert len(rec.payload[HEAD].encode()) <= 65536 and whole.decode().startswith(rec.payload[HEAD])


def test_a_payload_the_gateway_clipped_keeps_the_whole_hash(make_core, redis_url):
    core = make_core(redis_url)
    clipped = clip_payload({"prompt": "\u0001" * 700_000}, 65536)
    for _ in range(2):
        with pytest.raises(InvalidInput):
            core.quarantine_rejected(json.dumps(clipped), source="web", domain="default", trace_id="0" * 32,
                                     reason="PROMPT_TOO_LARGE", message="too large")
    [rec] = entries(redis_url)           # the repeat is a duplicate of the whole payload
    assert rec.payload == clipped and rec.fingerprint == clipped[TRUNCATED]["sha256"]


def test_an_invisible_prompt_is_refused_and_quarantined(make_core, redis_url):
    core = make_core(redis_url)
    err = reject(core, "\u200b\u200d\u2060\ufeff")
    assert err.reason == INVISIBLE_INPUT and err.metadata["rule"] == "default.visible_text"
    [rec] = entries(redis_url)
    assert (rec.record_id, rec.reason, rec.payload["prompt"]) == (err.metadata["quarantine_id"], INVISIBLE_INPUT,
                                                                  "\u200b\u200d\u2060\ufeff")
