"""The servicer (protobuf <-> engine) on the tiny model: the variant RPCs and fields, and a refused field."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from keel.common.v1 import common_pb2
from keel.inference.v1 import inference_pb2
from services.inference.servicer import InferenceServicer
from shared.errors import InvalidInput, PermissionDenied
from shared.metrics import metrics_for
from tests.inference.helpers import prompt


class _Context:
    """The one call the servicer makes on a grpc context."""

    def time_remaining(self):
        return None


async def _finished(servicer: InferenceServicer) -> inference_pb2.Finished:
    req = inference_pb2.GenerateRequest(prompt_ids=prompt(7), sampling=common_pb2.SamplingParams(max_tokens=3))
    events = [ev async for ev in servicer.Generate(req, _Context())]
    return events[-1].finished


@pytest.mark.asyncio
async def test_set_and_get_variant_convert_and_finished_names_the_variant(make_engine):
    engine = await make_engine(variants={"fallback": "int8"})
    registry = CollectorRegistry()
    servicer = InferenceServicer(engine, metrics_for("inference", registry))

    got = await servicer.GetVariant(inference_pb2.GetVariantRequest(), _Context())
    assert got.active == "primary" and dict(got.variants) == {"primary": "float32", "fallback": "int8"}
    first = await _finished(servicer)
    assert (first.variant, first.engine["format"]) == ("primary", "float32")

    switched = await servicer.SetVariant(inference_pb2.SetVariantRequest(variant="fallback", actor="test"), _Context())
    assert (switched.active, switched.previous) == ("fallback", "primary")
    assert (await servicer.GetVariant(inference_pb2.GetVariantRequest(), _Context())).active == "fallback"
    second = await _finished(servicer)
    assert (second.variant, second.engine["format"]) == ("fallback", "int8")
    # a variant is chosen, not a breaker fallback: nothing counted as a precision fallback
    assert (registry.get_sample_value("keel_inference_precision_fallbacks_total") or 0) == 0


@pytest.mark.asyncio
async def test_set_variant_with_an_unknown_name_raises_unknown_variant(make_engine):
    engine = await make_engine(variants={"fallback": "int8"})
    servicer = InferenceServicer(engine, metrics_for("inference", CollectorRegistry()))
    with pytest.raises(InvalidInput) as err:
        await servicer.SetVariant(inference_pb2.SetVariantRequest(variant="nope", actor="test"), _Context())
    assert err.value.reason == "UNKNOWN_VARIANT" and err.value.code == "INVALID_ARGUMENT"


@pytest.mark.asyncio
async def test_a_request_setting_the_deprecated_faults_field_is_refused(make_engine):
    servicer = InferenceServicer(await make_engine(), metrics_for("inference", CollectorRegistry()))
    req = inference_pb2.GenerateRequest(prompt_ids=prompt(7), sampling=common_pb2.SamplingParams(max_tokens=3),
                                        faults=inference_pb2.FaultSpec(slow_step_ms=5))
    with pytest.raises(PermissionDenied) as e:
        [ev async for ev in servicer.Generate(req, _Context())]
    assert e.value.reason == "FAULT_INJECTION_DISABLED" and e.value.metadata["field"] == "faults"
