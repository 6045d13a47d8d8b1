"""A client that walks away from a stream frees the model at once: the gateway cancels its call to
the inference stage, whose row leaves the batch and stops generating (seen in its metrics)."""
from __future__ import annotations

import time

import grpc
import pytest

from testing.mesh import wait_until
from tests.e2e.test_observability import scrape

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def value(port: int, name: str, **labels) -> float:
    samples = scrape(port).get(name, [])
    return sum(s.value for s in samples if s.name in (name, name + "_total")
               and all(s.labels.get(k) == v for k, v in labels.items()))


def test_a_cancelled_stream_stops_its_generation(mesh, api_md, gateway_request):
    port = mesh.layout["stages"]["inference"]["metrics_ports"][0]
    batch, tokens = "keel_inference_running_batch_size", "keel_inference_generated_tokens"
    cancelled = dict(service="inference", method="Generate", code="CANCELLED")
    wait_until(lambda: value(port, batch) == 0, 30, "an idle inference stage")
    cancelled_before = value(port, "keel_requests", **cancelled)
    with grpc.insecure_channel(mesh.gateway) as ch:
        stream = mesh.stub(ch).GenerateStream(
            gateway_request("Write a very long story about a lighthouse keeper.", max_tokens=1000),
            metadata=api_md, timeout=300)
        deltas = 0
        for event in stream:
            deltas += event.WhichOneof("event") == "delta"
            if deltas == 3:
                break
        assert value(port, batch) == 1 or wait_until(lambda: value(port, batch) == 1, 5, "the row in the batch")
        stream.cancel()
    wait_until(lambda: value(port, "keel_requests", **cancelled) == cancelled_before + 1, 30,
               "the inference call to end as CANCELLED")
    wait_until(lambda: value(port, batch) == 0, 10, "the row to leave the batch")
    generated = value(port, tokens)
    assert generated >= 3
    time.sleep(2.0)  # the counter is live; a row still generating adds ~10 tokens a second
    assert value(port, tokens) == generated
