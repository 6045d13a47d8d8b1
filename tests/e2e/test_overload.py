"""Overload end to end: an inference stage that runs one request at a time and queues none, so a
second request is refused with RESOURCE_EXHAUSTED and a retry hint. The gateway must wait the
hint before its retry, then either succeed or stop with a clear RESOURCE_EXHAUSTED carrying a
google.rpc.ErrorInfo reason: never INTERNAL, never a hang.

One mesh for the module. Two scenarios run once, in this order, in the fixture (the gateway's
retry throttle is shared state, so the order is fixed): a contender whose deadline is shorter
than the hint, then a burst of contenders with time to spare. In each, a "hog" generation
streams in the engine's only slot while the contenders arrive.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2
from keelctl.ask import DEV_API_KEY
from testing.mesh import start_mesh, stop_mesh, wait_until
from tests.e2e.conftest import error_info

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ENV = {"KEEL_INFERENCE_ENGINE__MAX_BATCH_SIZE": "1", "KEEL_INFERENCE_ENGINE__MAX_QUEUED_REQUESTS": "0"}
MD = (("x-api-key", DEV_API_KEY),)
HOG_PROMPT = "Write a long story about a dragon who learns to bake bread."
BURST = 3
REFUSED_REASONS = {"QUEUE_FULL", "QUEUE_TIMEOUT"}


def request(prompt: str, max_tokens: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens))


def outcome(stub, timeout: float):
    """Generate once; the response, or the RpcError it ended with."""
    try:
        return stub.Generate(request("Name a colour.", 4), metadata=MD, timeout=timeout)
    except grpc.RpcError as err:
        return err


def burst_of(stub) -> list:
    with ThreadPoolExecutor(BURST) as pool:
        return list(pool.map(lambda _: outcome(stub, timeout=120), range(BURST)))


def with_hog(stub, max_tokens: int, contenders):
    """Start a streamed hog, wait for its first token (it then holds the engine's only slot), run
    ``contenders()``, then read the hog to its end, so the slot is free again when this returns.
    Returns (the hog's final response or error, what ``contenders()`` returned)."""
    hog = stub.GenerateStream(request(HOG_PROMPT, max_tokens), metadata=MD, timeout=300)
    first = next(hog)
    assert first.WhichOneof("event") == "delta"
    theirs = contenders()
    try:
        events = list(hog)
    except grpc.RpcError as err:
        return err, theirs
    return events[-1].done, theirs


def trace_of(err: grpc.RpcError) -> str:
    return dict(err.trailing_metadata() or ()).get("x-keel-trace-id", "")


def gateway_log(mesh) -> list[dict]:
    return mesh.log("gateway-0.0")


def inference_decisions(mesh, trace_id: str) -> list[dict]:
    return sorted((r for r in gateway_log(mesh) if r.get("event") == "retry_decision"
                   and r["trace_id"] == trace_id and r["upstream"] == "inference"), key=lambda r: r["attempt"])


def generate_attempts(mesh, trace_id: str) -> list[dict]:
    """The gateway's client spans of this trace's inference attempts, in attempt order."""
    spans = [s for s in mesh.spans(trace_id) if s["name"] == "call inference/Generate"]
    return sorted(spans, key=lambda s: s["attributes"]["rpc.attempt"])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    mesh = start_mesh(tmp_path_factory.mktemp("overload"), extra_env=ENV)
    try:
        with grpc.insecure_channel(mesh.gateway) as ch:
            stub = mesh.stub(ch)
            # 1. the hog has ~250 tokens to go: the hint is longer than the contender's deadline
            _, short = with_hog(stub, 256, lambda: outcome(stub, timeout=1.5))
            # 2. a short hog and a burst with a generous deadline: they wait the hint, then retry
            hog, burst = with_hog(stub, 24, lambda: burst_of(stub))
        traces = [trace_of(r) if isinstance(r, grpc.RpcError) else r.trace_id for r in burst]
        wait_until(lambda: all(len(generate_attempts(mesh, t)) >= 2 for t in traces), 30, "burst spans flushed")
        yield {"mesh": mesh, "short": short, "hog": hog, "burst": burst, "traces": traces}
    finally:
        stop_mesh(mesh)


def test_contender_whose_deadline_cannot_fit_the_hint_is_refused_at_once(run):
    err = run["short"]
    assert isinstance(err, grpc.RpcError), "a second request got in beside the running one"
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{err.code()}: {err.details()}"
    info = error_info(err)
    assert info.reason == "QUEUE_FULL" and info.domain == "keel.dev"
    assert "retry_stop" not in info.metadata, "retry bookkeeping stays in the gateway's log and trace"
    hint = int(dict(err.trailing_metadata())["grpc-retry-pushback-ms"])
    decision, = inference_decisions(run["mesh"], trace_of(err))
    assert decision["decision"] == "stop" and decision["reason"] == "deadline"
    assert decision["retry_after_ms"] == hint and decision["delay_source"] == "pushback"


def test_burst_ends_in_success_or_a_clear_resource_exhausted(run):
    assert isinstance(run["hog"], gateway_pb2.GenerateResponse), f"the hog failed: {run['hog']}"
    for r in run["burst"]:
        if isinstance(r, gateway_pb2.GenerateResponse):
            assert r.usage.completion_tokens > 0
            continue
        assert r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{r.code()}: {r.details()}"
        info = error_info(r)
        assert info.reason in REFUSED_REASONS
        assert "retry_stop" not in info.metadata, "retry bookkeeping stays in the gateway's log and trace"
        assert dict(r.trailing_metadata()).get("grpc-retry-pushback-ms"), "the client gets the hint too"
        last = inference_decisions(run["mesh"], trace_of(r))[-1]
        assert last["decision"] == "stop" and last["reason"] in {"max_attempts", "budget", "deadline"}
        assert last["attempt"] == len(generate_attempts(run["mesh"], trace_of(r)))


def test_burst_contenders_wait_the_hint_before_their_retry(run):
    mesh = run["mesh"]
    for trace_id in run["traces"]:
        first = inference_decisions(mesh, trace_id)[0]
        assert first["attempt"] == 1 and first["code"] == "RESOURCE_EXHAUSTED"
        assert first["decision"] == "retry" and first["delay_source"] == "pushback"
        hint = first["retry_after_ms"]
        assert hint is not None and hint >= 0
        assert hint <= first["delay_ms"] <= 1.5 * hint  # U(1, 1.5) x the hint (it is under the 30 s cap)
        one, two = generate_attempts(mesh, trace_id)[:2]
        assert one["status"] == "ERROR" and one["attributes"]["rpc.grpc.status"] == "RESOURCE_EXHAUSTED"
        waited_ms = (two["start_ns"] - one["end_ns"]) / 1e6
        assert waited_ms >= first["delay_ms"] - 1  # 1 ms: clock granularity of the two timestamps
