"""One exception class per error reason a client acts on; every other reason maps to the class of
its gRPC status. Every exception carries the ErrorInfo ``reason`` and ``metadata``, the server's
retry hint (``retry_after_ms``, from RetryInfo / ``grpc-retry-pushback-ms``) and the ``trace_id``.
The reasons and their meaning: docs/errors.md of the Keel repository."""
from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2

DOMAIN = "keel.dev"
TRACE_ID_KEY = "x-keel-trace-id"


class KeelError(Exception):
    """A failed call. ``code`` is the gRPC status name (e.g. "INVALID_ARGUMENT")."""

    def __init__(self, code: str, reason: str, message: str, metadata: dict[str, str],
                 retry_after_ms: int | None, trace_id: str):
        super().__init__(f"{code} {reason}: {message}")
        self.code, self.reason, self.message = code, reason, message
        self.metadata, self.retry_after_ms, self.trace_id = metadata, retry_after_ms, trace_id

    @property
    def retryable(self) -> bool:
        """The server asked for a retry (and said when): only then may the same call succeed."""
        return self.retry_after_ms is not None and self.code in ("UNAVAILABLE", "RESOURCE_EXHAUSTED")

    @property
    def connection_lost(self) -> bool:
        """UNAVAILABLE that no Keel server wrote (Keel's errors carry an ErrorInfo reason): the
        connection failed or broke before an answer, so nothing of one reached the caller."""
        return self.code == "UNAVAILABLE" and self.reason == "UNAVAILABLE"


class InvalidRequest(KeelError):
    """INVALID_ARGUMENT: fix the request (``reason`` names the rule)."""


class AuthenticationError(KeelError):
    """UNAUTHENTICATED: MISSING_API_KEY or INVALID_API_KEY."""


class PermissionDenied(KeelError):
    """PERMISSION_DENIED."""


class Overloaded(KeelError):
    """RESOURCE_EXHAUSTED: retry after ``retry_after_ms`` when it is set."""


class RateLimited(Overloaded):
    """RATE_LIMITED: this API key's rate limit; retry after ``retry_after_ms``."""


class Unavailable(KeelError):
    """UNAVAILABLE: a stage is down, warming up or draining; retry after ``retry_after_ms``."""


class DeadlineExceeded(KeelError):
    """DEADLINE_EXCEEDED: the call's deadline ran out; retry only with a longer one."""


class OutputBlocked(KeelError):
    """OUTPUT_BLOCKED: an output check refused the answer (``metadata["plugin"]`` names it)."""


class FailedPrecondition(KeelError):
    """FAILED_PRECONDITION: the request can never succeed as sent."""


class AdapterRefused(FailedPrecondition):
    """ADAPTER_REFUSED: the LoRA adapter is registered but the server refused it at start
    (``metadata["refusal_reason"]`` says why); Keel never answers with the base model instead."""


class NotFound(KeelError):
    """NOT_FOUND: the named thing does not exist."""


class AdapterNotFound(NotFound):
    """ADAPTER_NOT_FOUND: no registered LoRA adapter has this id (or id@version)."""


class Cancelled(KeelError):
    """CANCELLED."""


class InternalError(KeelError):
    """INTERNAL or any status Keel does not document: report it with the trace id."""


BY_REASON: dict[str, type[KeelError]] = {"RATE_LIMITED": RateLimited, "OUTPUT_BLOCKED": OutputBlocked,
                                         "ADAPTER_REFUSED": AdapterRefused, "ADAPTER_NOT_FOUND": AdapterNotFound}
BY_CODE: dict[str, type[KeelError]] = {
    "INVALID_ARGUMENT": InvalidRequest, "OUT_OF_RANGE": InvalidRequest, "UNAUTHENTICATED": AuthenticationError,
    "PERMISSION_DENIED": PermissionDenied, "RESOURCE_EXHAUSTED": Overloaded, "UNAVAILABLE": Unavailable,
    "DEADLINE_EXCEEDED": DeadlineExceeded, "FAILED_PRECONDITION": FailedPrecondition, "CANCELLED": Cancelled,
    "NOT_FOUND": NotFound,
}


def from_rpc_error(err: grpc.RpcError) -> KeelError:
    """The KeelError for a failed call (works for sync and asyncio errors)."""
    code = err.code().name
    trailers = dict(err.trailing_metadata() or ())
    reason, metadata, retry_ms = code, {}, None
    raw = trailers.get("grpc-status-details-bin")
    if isinstance(raw, bytes):
        for detail in status_pb2.Status.FromString(raw).details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason, metadata = info.reason, dict(info.metadata)
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                hint = error_details_pb2.RetryInfo()
                detail.Unpack(hint)
                retry_ms = hint.retry_delay.ToMilliseconds()
    pushback = trailers.get("grpc-retry-pushback-ms")
    if isinstance(pushback, str) and pushback.lstrip("-").isdigit():
        retry_ms = int(pushback)
    if retry_ms is not None and retry_ms < 0:
        retry_ms = None  # a negative hint means "do not retry"
    cls = BY_REASON.get(reason) or BY_CODE.get(code, InternalError)
    trace_id = trailers.get(TRACE_ID_KEY, "")
    return cls(code, reason, err.details() or code, metadata, retry_ms, trace_id if isinstance(trace_id, str) else "")
