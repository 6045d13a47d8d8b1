"""Keel errors as HTTP statuses and OpenAI error objects, with the reason as `code` and the retry hint."""
from __future__ import annotations

import pytest

from services.openai import httperrors
from shared import errors


@pytest.mark.parametrize("err,status", [
    (errors.InvalidInput("x", reason="TEMPERATURE_OUT_OF_RANGE"), 400),
    (errors.InvalidInput("x", reason="PROMPT_TOO_LARGE"), 400),
    (errors.InvalidInput("x", reason="METHOD_NOT_ALLOWED"), 405),
    (errors.Overloaded("x", reason="MESSAGE_TOO_LARGE"), 413),
    (errors.InvalidInput("x", reason="HEADER_TOO_LARGE", metadata={"field": "x-api-key"}), 431),
    (errors.Unauthenticated("x", reason="INVALID_API_KEY"), 401),
    (errors.PermissionDenied("x"), 403),
    (errors.NotFound("x", reason="ADAPTER_NOT_FOUND", metadata={"adapter": "nope"}), 404),
    (errors.PreconditionFailed("x", reason="ADAPTER_REFUSED", metadata={"adapter": "a@1"}), 409),
    (errors.Overloaded("x", reason="RATE_LIMITED", retry_after_ms=1500), 429),
    (errors.NotReady("x", reason="NO_HEALTHY_UPSTREAM", retry_after_ms=200), 503),
    (errors.DeadlineExpired("x", reason="DEADLINE_EXCEEDED"), 504),
    (errors.Fatal("x"), 500),
    (errors.NumericalInstability("x", reason="NON_FINITE_LOGITS"), 500),
])
def test_status_by_class_and_reason(err, status):
    assert httperrors.http_status(err) == status
    body = httperrors.error_body(err)["error"]
    assert body["code"] == err.reason and body["message"] == "x"


def test_context_length_exceeded_is_openais_own_code():
    err = errors.InvalidInput("x", reason="CONTEXT_LENGTH_EXCEEDED",
                              metadata={"prompt_tokens": 2000, "max_tokens": 100, "context_tokens": 2048})
    body = httperrors.error_body(err)["error"]
    assert httperrors.http_status(err) == 400
    assert (body["code"], body["type"], body["param"]) == ("context_length_exceeded", "invalid_request_error",
                                                           "messages")
    assert set(body) == {"message", "type", "param", "code"}


def test_retry_after_is_whole_seconds_rounded_up_and_exact_in_ms():
    err = errors.Overloaded("slow down", reason="RATE_LIMITED", retry_after_ms=1500)
    assert httperrors.headers(err, "ab" * 16) == {"x-keel-trace-id": "ab" * 16, "retry-after": "2",
                                                   "retry-after-ms": "1500", "x-should-retry": "true"}
    assert httperrors.headers(errors.NotReady("x", retry_after_ms=10), "")["retry-after"] == "1"
    assert httperrors.headers(errors.InvalidInput("x"), "") == {"x-should-retry": "false"}


@pytest.mark.parametrize("err,retry", [
    (errors.PreconditionFailed("x", reason="ADAPTER_REFUSED"), "false"),
    (errors.NumericalInstability("x", reason="NON_FINITE_LOGITS"), "false"),
    (errors.Fatal("x"), "false"),
    (errors.DeadlineExpired("x"), "false"),  # the same request would most likely run out again
    (errors.NotReady("x", reason="NO_HEALTHY_UPSTREAM", retry_after_ms=100), "true"),
])
def test_only_recoverable_errors_invite_the_sdks_retry(err, retry):
    assert httperrors.headers(err, "")["x-should-retry"] == retry


@pytest.mark.parametrize("err", [
    errors.Overloaded("x", reason="MESSAGE_TOO_LARGE", retry_after_ms=1000),
    errors.InvalidInput("x", reason="PROMPT_TOO_LARGE"),
    errors.InvalidInput("x", reason="HEADER_TOO_LARGE"),
    errors.DeadlineExpired("x", retry_after_ms=1000),
])
def test_a_request_refused_for_its_size_or_deadline_has_no_retry_hint(err):
    """Sent again, the same request is refused again (a 413 used to say x-should-retry: true), or
    runs out of time again (a 504 made the SDK's two retries triple a slow answer)."""
    assert httperrors.headers(err, "") == {"x-should-retry": "false"}


@pytest.mark.parametrize("err,param", [
    (errors.InvalidInput("x", reason="TOP_P_OUT_OF_RANGE"), "top_p"),
    (errors.InvalidInput("x", reason="MAX_TOKENS_TOO_LARGE"), "max_tokens"),
    (errors.InvalidInput("x", reason="INVALID_ADAPTER", metadata={"field": "adapter"}), "model"),
    (errors.NotFound("x", reason="ADAPTER_NOT_FOUND", metadata={"adapter": "nope"}), "model"),
    (errors.InvalidInput("x", reason="UNKNOWN_ROLE"), "messages"),
    (errors.InvalidInput("x", reason="INVALID_BODY", metadata={"field": "messages.0.role"}), "messages.0.role"),
    (errors.InvalidInput("x", reason="STOP_INVALID", metadata={"field": "sampling.stop"}), "stop"),
    (errors.InvalidInput("x", reason="TRUNCATE_PROMPT_TOKENS_OUT_OF_RANGE",
                         metadata={"field": "sampling.truncate_prompt_tokens"}), "truncate_prompt_tokens"),
    (errors.Overloaded("x", reason="RATE_LIMITED"), None),
])
def test_param_names_the_openai_field(err, param):
    assert httperrors.error_body(err)["error"]["param"] == param
