"""A Keel error as an HTTP status and OpenAI's error object: ``{"error": {message, type, param, code}}``
with Keel's reason as ``code``; the retry hint as ``Retry-After`` (whole seconds, rounded up) and
``retry-after-ms`` (which the OpenAI SDKs read first); ``x-should-retry`` (which the SDKs obey
before their own per-status rule) says whether Keel's error class may be retried at all, so a
refused adapter (409) or non-finite logits (500) are not sent again; nor is a request refused for its
size (413, 431), whatever its class: the same request is refused again; nor one whose deadline ran out
(504): sent again it would most likely run out again, and the SDKs' two default retries would hold a
generation slot and the caller three times as long. The table is in docs/openai.md."""
from __future__ import annotations

import math

from shared import errors

# By gRPC status name; a reason in STATUS_BY_REASON has its own status, whatever its class. (A prompt
# over the gateway's max_prompt_bytes is a 400, PROMPT_TOO_LARGE: the SDKs raise BadRequestError for
# it, and a bare APIStatusError for a 413.)
STATUS_BY_CODE = {
    "INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404,
    "FAILED_PRECONDITION": 409, "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504,
    "CANCELLED": 499,
}
STATUS_BY_REASON = {"MESSAGE_TOO_LARGE": 413, "REQUEST_EXCEEDS_MEMORY_BUDGET": 413, "HEADER_TOO_LARGE": 431,
                    "METHOD_NOT_ALLOWED": 405}
# Sending it again cannot help: refused for its size (413, 431), or its deadline ran out (504).
NEVER_RETRIED = frozenset({413, 431, 504})
# OpenAI's own `code` where clients test for it (LangChain, LiteLLM: context_length_exceeded);
# any other error's code is Keel's reason.
OPENAI_CODE = {"CONTEXT_LENGTH_EXCEEDED": "context_length_exceeded"}
TYPE_BY_STATUS = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
                  409: "invalid_request_error", 413: "invalid_request_error", 431: "invalid_request_error",
                  401: "authentication_error", 403: "permission_error",
                  429: "rate_limit_error", 503: "service_unavailable_error", 504: "timeout_error"}
# Which OpenAI field a gateway refusal is about, where its ErrorInfo names none (metadata "field"):
# a refusal naming an adapter is about `model`; one whose reason starts with a sampling field's name
# is about that field (TOP_P_OUT_OF_RANGE: top_p); those in ABOUT are about the field it names (the
# conversation; /detokenize's ids). (This reads the gateway's reasons; it raises none.)
ABOUT = {**dict.fromkeys(("EMPTY_PROMPT", "TOO_MANY_MESSAGES", "UNKNOWN_ROLE", "PROMPT_TOO_LARGE",
                          "CONTEXT_LENGTH_EXCEEDED"), "messages"), "TOKEN_ID_OUT_OF_RANGE": "tokens"}
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "stop", "frequency_penalty", "presence_penalty",
                   "top_logprobs")
# The gateway's own field names, where they differ from OpenAI's.
OPENAI_FIELD = {"adapter": "model", "token_ids": "tokens"}


def param_of(err: errors.KeelError) -> str | None:
    field = err.metadata.get("field", "").removeprefix("sampling.")  # the gRPC field's message is no part of it
    if field:
        return OPENAI_FIELD.get(field, field)
    if "adapter" in err.metadata:
        return "model"
    if err.reason in ABOUT:
        return ABOUT[err.reason]
    return next((f for f in SAMPLING_FIELDS if err.reason.startswith(f.upper() + "_")), None)


def in_terms(err: errors.KeelError, fields: dict[str, str]) -> errors.KeelError:
    """``err`` naming an endpoint's own field (``fields``: the name param_of gives -> the endpoint's)."""
    param = param_of(err)
    if param in fields:
        err.metadata["field"] = fields[param]
    return err


def http_status(err: errors.KeelError) -> int:
    return STATUS_BY_REASON.get(err.reason) or STATUS_BY_CODE.get(err.code, 500)


def error_body(err: errors.KeelError) -> dict:
    status = http_status(err)
    return {"error": {"message": err.message, "type": TYPE_BY_STATUS.get(status, "server_error"),
                      "param": param_of(err), "code": OPENAI_CODE.get(err.reason, err.reason)}}


def headers(err: errors.KeelError, trace_id: str) -> dict[str, str]:
    out = {"x-keel-trace-id": trace_id} if trace_id else {}
    retried = isinstance(err, errors.Recoverable) and http_status(err) not in NEVER_RETRIED
    out["x-should-retry"] = "true" if retried else "false"
    if retried and err.retry_after_ms is not None:
        out["retry-after"] = str(max(1, math.ceil(err.retry_after_ms / 1000)))
        out["retry-after-ms"] = str(err.retry_after_ms)
    return out
