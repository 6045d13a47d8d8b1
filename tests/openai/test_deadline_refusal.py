"""Inference's refusal of a request that cannot finish by its deadline (DEADLINE_UNREACHABLE,
docs/inference.md) reaches an OpenAI client as 429 with Retry-After: carried hop by hop as the
mesh carries it (gRPC status with ErrorInfo and RetryInfo: inference -> gateway -> HTTP stage),
then mapped by the HTTP stage's generic rule for RESOURCE_EXHAUSTED with a retry hint."""
from __future__ import annotations

import grpc

from services.inference.engine.admission import MIN_PACE_STEPS, deadline_refusal
from services.inference.engine.stats import Pace
from services.openai import httperrors
from shared import client, errors
from shared.interceptor import to_status


def across_a_hop(err: errors.KeelError, *, public: bool) -> errors.KeelError:
    """What the caller's client makes of ``err`` answered by a stage (public: by the gateway)."""
    code, message, trailers = to_status(err, public=public)
    return client.translate(grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), message))


def test_an_unreachable_deadline_is_429_with_retry_after_over_http():
    # 4,000 tokens ahead over 8 rows at 10 tokens/s each: 50 s before a row, 60 s in all; 55 s left.
    refusal = deadline_refusal(55.0, max_tokens=100, ahead_tokens=4000, batch=8,
                               pace=Pace(row_tokens_per_s=10.0, steps=MIN_PACE_STEPS))
    at_http = across_a_hop(across_a_hop(refusal, public=False), public=True)
    assert (at_http.code, at_http.reason) == ("RESOURCE_EXHAUSTED", errors.DEADLINE_UNREACHABLE)
    assert at_http.retry_after_ms == refusal.retry_after_ms == 50_000
    assert httperrors.http_status(at_http) == 429
    assert httperrors.headers(at_http, "") == {"retry-after": "50", "retry-after-ms": "50000", "x-should-retry": "true"}
    body = httperrors.error_body(at_http)["error"]
    assert (body["type"], body["code"]) == ("rate_limit_error", "DEADLINE_UNREACHABLE")
    assert "cannot finish within its deadline" in body["message"]
