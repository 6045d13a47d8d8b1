"""A Keel error as an HTTP status and OpenAI's error object: ``{"error": {message, type, param, code}}``
with Keel's reason as ``code``; the retry hint as ``Retry-After`` (whole seconds, rounded up) and
``retry-after-ms`` (which the OpenAI SDKs read first); ``x-should-retry`` (which the SDKs obey
before their own per-status rule) says whether Keel's error class may be retried at all, so a
refused adapter (409) or non-finite logits (500) are not sent again; nor is a request refused for its
size (413, 431), whatever its class: the same request is refused again. The table is in docs/openai.md."""
from __future__ import annotations

import math

from shared import errors

# By gRPC status name; a reason in SIZE_LIMITS is 413, HEADER_TOO_LARGE 431, whatever its status.
STATUS_BY_CODE = {
    "INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404,
    "FAILED_PRECONDITION": 409, "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504,
    "CANCELLED": 499,
}
SIZE_LIMITS = frozenset({"PROMPT_TOO_LARGE", "MESSAGE_TOO_LARGE", "REQUEST_EXCEEDS_MEMORY_BUDGET"})
HEADER_LIMITS = frozenset({"HEADER_TOO_LARGE"})
NEVER_RETRIED = frozenset({413, 431})  # refused for its size: sending it again cannot help
TYPE_BY_STATUS = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
                  409: "invalid_request_error", 413: "invalid_request_error", 431: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                  429: "rate_limit_error", 503: "service_unavailable_error", 504: "timeout_error"}
# Which OpenAI field a gateway refusal is about, where its ErrorInfo names none (metadata "field"):
# a refusal naming an adapter is about `model`; one whose reason starts with a sampling field's name
# is about that field (TOP_P_OUT_OF_RANGE: top_p); these are about the conversation. (This reads the
# gateway's reasons; it raises none.)
ABOUT_MESSAGES = frozenset({"EMPTY_PROMPT", "TOO_MANY_MESSAGES", "UNKNOWN_ROLE", "PROMPT_TOO_LARGE"})
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "stop", "frequency_penalty", "presence_penalty",
                   "top_logprobs")
# The gateway's own field names, where they differ from OpenAI's.
OPENAI_FIELD = {"adapter": "model"}


def param_of(err: errors.KeelError) -> str | None:
    field = err.metadata.get("field")
    if field:
        return OPENAI_FIELD.get(field, field)
    if "adapter" in err.metadata:
        return "model"
    if err.reason in ABOUT_MESSAGES:
        return "messages"
    return next((f for f in SAMPLING_FIELDS if err.reason.startswith(f.upper() + "_")), None)


def http_status(err: errors.KeelError) -> int:
    if err.reason in SIZE_LIMITS:
        return 413
    if err.reason in HEADER_LIMITS:
        return 431
    return STATUS_BY_CODE.get(err.code, 500)


def error_body(err: errors.KeelError) -> dict:
    status = http_status(err)
    return {"error": {"message": err.message, "type": TYPE_BY_STATUS.get(status, "server_error"),
                      "param": param_of(err), "code": err.reason}}


def headers(err: errors.KeelError, trace_id: str) -> dict[str, str]:
    out = {"x-keel-trace-id": trace_id} if trace_id else {}
    retried = isinstance(err, errors.Recoverable) and http_status(err) not in NEVER_RETRIED
    out["x-should-retry"] = "true" if retried else "false"
    if retried and err.retry_after_ms is not None:
        out["retry-after"] = str(max(1, math.ceil(err.retry_after_ms / 1000)))
        out["retry-after-ms"] = str(err.retry_after_ms)
    return out
