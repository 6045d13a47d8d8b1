"""Keel's one exception hierarchy. Core code raises these; it never imports grpc.

    KeelError                      (base; never raised itself)
    ├── InvalidInput               INVALID_ARGUMENT     bad request: fix it, do not retry
    ├── PreconditionFailed         FAILED_PRECONDITION  can never succeed as sent (e.g. exceeds memory budget)
    ├── Unauthenticated            UNAUTHENTICATED      missing or wrong credential
    ├── PermissionDenied           PERMISSION_DENIED    credential valid, action not allowed
    ├── NotFound                   NOT_FOUND            named thing does not exist
    ├── Recoverable                (the caller may retry, honouring retry_after_ms)
    │   ├── Overloaded             RESOURCE_EXHAUSTED   queue full, rate limited
    │   ├── NotReady               UNAVAILABLE          warming up, draining, breaker open, upstream down
    │   └── DeadlineExpired        DEADLINE_EXCEEDED    ran out of time
    ├── Cancelled                  CANCELLED            the client went away
    ├── NumericalInstability       OUT_OF_RANGE         NaN/inf in one row's logits; that row fails alone,
    │                                                       retrying the same input fails again
    └── Fatal                      INTERNAL             a bug or a dead component (logged with its stack)

Each error carries a machine-readable ``reason`` (UPPER_SNAKE, goes into google.rpc.ErrorInfo),
free-form ``metadata`` (str -> str, also ErrorInfo) and, for recoverable errors, a retry hint.
The translation to gRPC status lives in exactly one place per side:
``shared/interceptor.py`` (server) and ``shared/client.py`` (client).
"""
from __future__ import annotations

DOMAIN = "keel.dev"

# Reasons the mesh itself sets when a process stops (not the stages' own refusals):
SHUTTING_DOWN = "SHUTTING_DOWN"      # a draining stage cut a call it could not finish, or refused a new one
CONNECTION_LOST = "CONNECTION_LOST"  # no server answered: the upstream process died or its port is closed


class KeelError(Exception):
    """Base of every error Keel raises on purpose."""

    code = "INTERNAL"  # name of the grpc.StatusCode member; kept as a string so core code stays grpc-free
    default_reason = "INTERNAL"

    def __init__(self, message: str, *, reason: str | None = None,
                 metadata: dict[str, str] | None = None, retry_after_ms: int | None = None):
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason
        self.metadata = {k: str(v) for k, v in (metadata or {}).items()}
        self.retry_after_ms = retry_after_ms

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


class InvalidInput(KeelError):
    code = "INVALID_ARGUMENT"
    default_reason = "INVALID_INPUT"


class PreconditionFailed(KeelError):
    code = "FAILED_PRECONDITION"
    default_reason = "FAILED_PRECONDITION"


class Unauthenticated(KeelError):
    code = "UNAUTHENTICATED"
    default_reason = "UNAUTHENTICATED"


class PermissionDenied(KeelError):
    code = "PERMISSION_DENIED"
    default_reason = "PERMISSION_DENIED"


class NotFound(KeelError):
    code = "NOT_FOUND"
    default_reason = "NOT_FOUND"


class Recoverable(KeelError):
    """The same request may succeed later; ``retry_after_ms`` is the server's hint."""


class Overloaded(Recoverable):
    code = "RESOURCE_EXHAUSTED"
    default_reason = "OVERLOADED"


class NotReady(Recoverable):
    code = "UNAVAILABLE"
    default_reason = "NOT_READY"


class DeadlineExpired(Recoverable):
    code = "DEADLINE_EXCEEDED"
    default_reason = "DEADLINE_EXCEEDED"


class Cancelled(KeelError):
    code = "CANCELLED"
    default_reason = "CANCELLED"


class Fatal(KeelError):
    code = "INTERNAL"
    default_reason = "INTERNAL"


class NumericalInstability(KeelError):
    """NaN/inf in a row's logits. The row fails alone; retrying the same input will fail again."""

    code = "OUT_OF_RANGE"
    default_reason = "NUMERICAL_INSTABILITY"
