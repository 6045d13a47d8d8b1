"""The breaker's fallback format is counted: requests and tokens served in it, through the servicer."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from keel.common.v1 import common_pb2
from keel.inference.v1 import inference_pb2
from services.inference.servicer import InferenceServicer
from shared.metrics import metrics_for
from tests.inference.helpers import prompt
from tests.inference.test_breaker import FAST_TRIP, trip


class _Context:
    """The one call the servicer makes on a grpc context."""

    def time_remaining(self):
        return None


async def _generate(servicer: InferenceServicer, max_tokens: int) -> None:
    req = inference_pb2.GenerateRequest(prompt_ids=prompt(5), sampling=common_pb2.SamplingParams(max_tokens=max_tokens))
    async for _ in servicer.Generate(req, _Context()):
        pass


@pytest.mark.asyncio
async def test_requests_run_in_the_fallback_format_are_counted_with_their_tokens(make_engine):
    engine = await make_engine(breaker=FAST_TRIP)  # serves float32; fallback bfloat16 at level 2
    registry = CollectorRegistry()
    servicer = InferenceServicer(engine, metrics_for("inference", registry))

    def value(name: str) -> float:
        return registry.get_sample_value(name) or 0.0

    await _generate(servicer, 3)
    assert value("keel_inference_precision_fallbacks_total") == 0
    trip(engine, 2)
    await _generate(servicer, 4)
    await _generate(servicer, 2)
    assert value("keel_inference_precision_fallbacks_total") == 2
    assert value("keel_inference_fallback_format_tokens_total") == 6
    assert value("keel_inference_generated_tokens_total") == 9
