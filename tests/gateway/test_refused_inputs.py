"""Every input the gateway refuses reaches the quarantine: requests without any prompt, seeds
outside the mesh's range, and payloads too large to send whole (clipped, with the whole's hash)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from keel.gateway.v1 import gateway_pb2
from services.gateway.contract import Ask, Limits
from services.gateway.pipeline import payload_of
from services.gateway.servicer import to_ask
from services.gateway.values import Call
from shared import errors
from shared.clip import HEAD, TRUNCATED, canonical_json
from shared.controls import SEED_MAX
from testing.upstreams import FakeUpstreams
from tests.gateway.test_pipeline import pipeline

ROOT = Path(__file__).resolve().parents[2]
CHANNEL_LIMIT = 4 * 1024 * 1024


async def refused(up, a: Ask) -> errors.InvalidInput:
    with pytest.raises(errors.InvalidInput) as exc:
        await pipeline(up).generate(a, Call(1e12, "t" * 32))
    return exc.value


@pytest.mark.asyncio
async def test_a_request_with_no_prompt_at_all_is_quarantined():
    up = FakeUpstreams()
    err = await refused(up, to_ask(gateway_pb2.GenerateRequest(), Limits(max_context_tokens=2048)))
    assert err.reason == "EMPTY_PROMPT" and err.metadata["quarantine_id"] == "q-1"
    assert [r for r, _ in up.quarantined] == ["EMPTY_PROMPT"]
    assert up.quarantined[0][1]["messages"] == []


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", [2**63, 2**64 - 1])
async def test_a_seed_above_the_mesh_range_is_refused_early_and_quarantined(seed):
    req = gateway_pb2.GenerateRequest(prompt="hello", sampling={"seed": seed, "max_tokens": 8})
    up = FakeUpstreams()
    err = await refused(up, to_ask(req, Limits(max_context_tokens=2048)))
    assert err.reason == errors.SEED_OUT_OF_RANGE and err.metadata["limit"] == str(SEED_MAX)
    assert [(r, p["seed"]) for r, p in up.quarantined] == [(errors.SEED_OUT_OF_RANGE, seed)]
    assert "generate" not in up.calls


@pytest.mark.asyncio
async def test_the_largest_seed_of_the_range_is_served():
    up = FakeUpstreams()
    await pipeline(up).generate(Ask(messages=(("user", "hi"),), max_tokens=8, seed=SEED_MAX),
                                Call(1e12, "t" * 32))
    assert up.seeds == [SEED_MAX]


def test_the_validator_contract_has_the_same_seed_range():
    contract = json.loads((ROOT / "config" / "contracts" / "default.schema.json").read_text())
    assert (contract["properties"]["seed"]["minimum"], contract["properties"]["seed"]["maximum"]) == (0, SEED_MAX)


@pytest.mark.asyncio
async def test_a_payload_too_large_for_the_channel_is_quarantined_clipped_with_its_hash():
    a = Ask(messages=(("user", "\u0001" * 700_000),), max_tokens=8)
    whole = canonical_json(payload_of(a)).encode()
    assert len(whole) > CHANNEL_LIMIT        # escaped, it would not fit in one message
    up = FakeUpstreams()
    err = await refused(up, a)
    assert err.reason == "PROMPT_TOO_LARGE"
    [(reason, sent)] = up.quarantined
    assert sent[TRUNCATED] == {"sha256": hashlib.sha256(whole).hexdigest(), "bytes": len(whole)}
    assert whole.decode().startswith(sent[HEAD])
    assert len(canonical_json(sent).encode()) < 2 * Limits(max_context_tokens=2048).max_quarantine_payload_bytes
