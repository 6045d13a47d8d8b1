"""ReportFailure: the gateway reports answers that output validation blocked, and they count against
the replica's output_limit breaker (the breaker for business errors)."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from keel.inference.v1 import inference_pb2
from services.inference.engine.breaker import BreakerConfig, TripRule
from services.inference.servicer import InferenceServicer
from shared import errors
from shared.metrics import metrics_for


@pytest.mark.asyncio
async def test_reported_output_limit_failures_trip_the_breaker(make_engine):
    engine = await make_engine(breaker=BreakerConfig(output_limit=TripRule(60.0, 2)))
    servicer = InferenceServicer(engine, metrics_for("inference", CollectorRegistry()))
    request = inference_pb2.ReportFailureRequest(kind="output_limit", cause="forbidden")
    await servicer.ReportFailure(request, None)
    assert engine.stats().breaker["output_limit"].level == 0
    await servicer.ReportFailure(request, None)
    assert engine.stats().breaker["output_limit"].level == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["oom", "numerical_instability", "", "anything"])
async def test_only_output_limit_may_be_reported(make_engine, kind):
    engine = await make_engine()
    servicer = InferenceServicer(engine, metrics_for("inference", CollectorRegistry()))
    with pytest.raises(errors.InvalidInput) as exc:
        await servicer.ReportFailure(inference_pb2.ReportFailureRequest(kind=kind), None)
    assert exc.value.reason == "UNKNOWN_FAILURE_KIND"
    assert all(b.level == 0 for b in engine.stats().breaker.values())
