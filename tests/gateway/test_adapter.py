"""The `adapter` field through the gateway, with the inference side faked: the contract's syntax
check, the adapter carried to inference and echoed back, the engine's refusals passed through to
the client unchanged and never retried, the usage metrics by served adapter, and the replay record."""
from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from keel.feedback.v1 import feedback_pb2
from keel.gateway.v1 import gateway_pb2
from keelctl.replay import request_of
from services.feedback.records import ReplayRecord, stored_body
from services.feedback.replay import compare
from services.feedback.servicer import record_from_proto
from services.gateway.adapter_usage import AdapterUsage
from services.gateway.contract import Limits, check_ask
from services.gateway.recording import to_record
from services.gateway.servicer import to_ask, to_response
from services.gateway.values import Call, Done, Step
from shared import errors, metrics
from testing.records import record
from testing.upstreams import FakeUpstreams
from tests.gateway.test_pipeline import ask, pipeline

# What the fake engine knows: one accepted adapter (newest version 2) and one refused at start.
ACCEPTED = {"pirate": "pirate@2", "pirate@1": "pirate@1", "pirate@2": "pirate@2"}
REFUSED = {"drifted": "BASE_FINGERPRINT_MISMATCH"}


class AdapterUpstreams(FakeUpstreams):
    """FakeUpstreams whose engine resolves adapters as the inference stage does (docs/lora.md)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.adapters: list[str] = []

    async def generate(self, enc, ask, seed, timeout, md):
        self.calls.append("generate")
        self.adapters.append(ask.adapter)
        if ask.adapter in REFUSED:
            raise errors.PreconditionFailed(f"adapter {ask.adapter} was refused at start", reason="ADAPTER_REFUSED",
                                            metadata={"adapter": ask.adapter, "refusal_reason": REFUSED[ask.adapter]})
        if ask.adapter and ask.adapter not in ACCEPTED:
            raise errors.NotFound(f"no adapter {ask.adapter}", reason="ADAPTER_NOT_FOUND",
                                  metadata={"adapter": ask.adapter})
        for t in self.tokens:
            yield Step(t, 0.5)
        yield Done("stop", 3, len(self.tokens), seed, {"format": "float32"}, "inference-a",
                   ACCEPTED.get(ask.adapter, ""))


CALL = Call(1e12, "t" * 32)


@pytest.mark.parametrize("name", ["pirate", "pirate@2", "Team_a.v2-x@2024-01-01", "a", "x" * 64 + "@" + "y" * 64])
def test_adapter_names_the_contract_accepts(name):
    check_ask(ask(adapter=name), Limits(max_context_tokens=2048))


@pytest.mark.parametrize("name", ["@1", "pirate@", "pirate@1@2", "../etc/passwd", "pi rate", "pirate\n", "-x",
                                  "pirate@-1", "pïrate", "a{b}", "x" * 65, "x@" + "y" * 65, "x" * 40_000])
def test_malformed_adapter_is_invalid_argument_naming_the_field(name):
    with pytest.raises(errors.InvalidInput) as exc:
        check_ask(ask(adapter=name), Limits(max_context_tokens=2048))
    assert exc.value.reason == errors.INVALID_ADAPTER and exc.value.metadata == {"field": "adapter"}


@pytest.mark.asyncio
async def test_malformed_adapter_never_reaches_inference():
    up = AdapterUpstreams()
    with pytest.raises(errors.InvalidInput):
        await pipeline(up).generate(ask(adapter="bad name"), CALL)
    assert "generate" not in up.calls and up.quarantined[0][0] == errors.INVALID_ADAPTER


@pytest.mark.asyncio
async def test_adapter_is_carried_to_inference_and_the_served_one_echoed():
    up = AdapterUpstreams()
    ans = await pipeline(up).generate(ask(adapter="pirate"), CALL)
    assert up.adapters == ["pirate"] and ans.adapter == "pirate@2"
    assert (await pipeline(up).generate(ask(), CALL)).adapter == ""  # the base model


@pytest.mark.asyncio
async def test_stream_done_echoes_the_served_adapter():
    up = AdapterUpstreams()
    items = [item async for item in pipeline(up).stream(ask(adapter="pirate@1"), CALL)]
    assert up.adapters == ["pirate@1"] and items[-1].adapter == "pirate@1"
    assert to_response(items[-1]).adapter == "pirate@1"


@pytest.mark.parametrize("name, cls, reason, metadata", [
    ("ghost", errors.NotFound, "ADAPTER_NOT_FOUND", {"adapter": "ghost"}),
    ("drifted", errors.PreconditionFailed, "ADAPTER_REFUSED",
     {"adapter": "drifted", "refusal_reason": REFUSED["drifted"]}),
])
@pytest.mark.asyncio
async def test_engine_refusals_reach_the_client_unchanged_and_are_never_retried(name, cls, reason, metadata):
    for streaming in (False, True):
        up = AdapterUpstreams()
        with pytest.raises(cls) as exc:
            if streaming:
                [item async for item in pipeline(up).stream(ask(adapter=name), CALL)]
            else:
                await pipeline(up).generate(ask(adapter=name), CALL)
        public = {k: v for k, v in exc.value.metadata.items() if k not in errors.INTERNAL_METADATA_KEYS}
        assert exc.value.reason == reason and public == metadata  # what the client sees (shared/interceptor.py)
        assert exc.value.metadata["retry_stop"] == "non_retryable"
        assert up.calls.count("generate") == 1  # no retry, no silent fallback to the base model
        assert up.adapters == [name]


def test_servicer_converts_the_adapter_both_ways():
    limits = Limits(max_context_tokens=2048)
    assert to_ask(gateway_pb2.GenerateRequest(prompt="hi", adapter="pirate@2"), limits).adapter == "pirate@2"
    assert to_ask(gateway_pb2.GenerateRequest(prompt="hi"), limits).adapter == ""


@pytest.mark.asyncio
async def test_usage_counts_requests_and_tokens_by_the_served_adapter_only():
    registry = CollectorRegistry()
    usage = AdapterUsage(metrics.metrics_for("gateway", registry))
    served = []
    up = AdapterUpstreams(tokens=(5, 6))
    p = pipeline(up)
    p._on_served = served.append
    await p.generate(ask(adapter="pirate"), CALL)
    await p.generate(ask(), CALL)
    with pytest.raises(errors.NotFound):
        await p.generate(ask(adapter="ghost"), CALL)
    for s in served:
        usage.served(s)

    def value(name, **labels):
        return registry.get_sample_value(name, labels)
    assert value("keel_gateway_adapter_requests_total", adapter="pirate@2") == 1
    assert value("keel_gateway_adapter_requests_total", adapter="base") == 1
    assert value("keel_gateway_adapter_tokens_total", adapter="pirate@2", kind="completion") == 2
    assert value("keel_gateway_adapter_tokens_total", adapter="pirate@2", kind="prompt") == 3
    # Names a client asked for never become labels: only what the engine answered with.
    assert value("keel_gateway_adapter_requests_total", adapter="pirate") is None
    assert value("keel_gateway_adapter_requests_total", adapter="ghost") is None


@pytest.mark.asyncio
async def test_replay_record_keeps_the_served_adapter_and_a_replay_asks_for_exactly_it():
    served = []
    up = AdapterUpstreams()
    p = pipeline(up)
    p._on_served = served.append
    await p.generate(ask(adapter="pirate", seed=3), CALL)
    record = ReplayRecord.from_body(stored_body(record_from_proto(to_record(served[0], 1)), True))
    assert record.adapter == "pirate@2"
    assert request_of(record).adapter == "pirate@2"  # the version that served, not "newest"


def test_a_replay_with_another_adapter_is_not_comparable():
    original = record("a" * 32)
    original = replace(original, adapter="pirate@2")
    assert compare(original, replace(original, adapter="")).fields == ("adapter",)
    assert compare(original, original).result == "identical"
    # Records written before adapters existed have no key: they were served by the base model.
    legacy = {k: v for k, v in stored_body(original, True).items() if k != "adapter"}
    assert compare(ReplayRecord.from_body(legacy), replace(original, adapter="")).result == "identical"


def test_feedback_record_without_adapter_is_the_base_model():
    assert record_from_proto(feedback_pb2.ReplayRecord(trace_id="a" * 32)).adapter == ""
