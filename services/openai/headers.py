"""The request headers the stage reads, each parsed defensively: a value it cannot use is a 400 (or
431 for one too long to pass on) naming the header, never an exception that escapes as a 500.

Passed on to the gateway as gRPC metadata: the API key and the W3C trace context, plus the caller's
address beside the proxy credential (shared/proxyauth.py), so the gateway counts the caller's failed
authentications by that address, not this stage's. The caller's address is the socket's peer unless
the peer is a proxy named in ``trusted_proxies`` (then uvicorn takes it from X-Forwarded-For).
"""
from __future__ import annotations

from starlette.requests import Request

from services.openai.limits import EdgeLimits
from shared import errors, proxyauth

FORWARDED = ("authorization", "x-api-key", "traceparent", "tracestate")
KEY_HEADERS = ("authorization", "x-api-key")
# The request's deadline in milliseconds (a stream's whole stream), as a gRPC client sets one;
# absent: the gateway's default deadline.
DEADLINE_HEADER = "x-keel-deadline-ms"


def _printable(value: str) -> bool:
    """gRPC metadata values are printable ASCII; anything else is not sent on."""
    return all(" " <= c <= "~" for c in value)


def header_too_large(name: str, limit: int) -> errors.InvalidInput:
    return errors.InvalidInput(f"the {name} header is larger than {limit} bytes", reason="HEADER_TOO_LARGE",
                               metadata={"field": name})


def metadata(request: Request, limits: EdgeLimits) -> tuple[tuple[str, str], ...]:
    """The caller's forwarded headers and, with the proxy credential, the caller's address.
    InvalidInput HEADER_TOO_LARGE (431) for a forwarded header over ``max_forwarded_header_bytes``."""
    out = []
    for name in FORWARDED:
        for value in request.headers.getlist(name):
            if len(value) > limits.max_forwarded_header_bytes:
                raise header_too_large(name, limits.max_forwarded_header_bytes)
            if _printable(value):
                out.append((name, value))
    client_address = request.client.host if request.client else ""
    return (*out, *proxyauth.on_behalf_of(client_address))


def has_key(request: Request) -> bool:
    return any(request.headers.getlist(name) for name in KEY_HEADERS)


def deadline_s(request: Request, limits: EdgeLimits) -> float | None:
    """The caller's deadline in seconds, None when not set; INVALID_HEADER unless it is one
    integer of 1..``max_deadline_ms`` milliseconds."""
    values = request.headers.getlist(DEADLINE_HEADER)
    if not values:
        return None
    raw = values[0].strip()
    # ASCII digits only (str.isdigit also takes '²', which int() refuses), and no more of them than
    # the limit has: int() of a 400-digit string is slow, and its float overflows.
    if len(values) > 1 or not raw.isascii() or not raw.isdigit() or len(raw) > len(str(limits.max_deadline_ms)) \
            or not 1 <= int(raw) <= limits.max_deadline_ms:
        raise errors.InvalidInput(f"{DEADLINE_HEADER} must be one integer of 1..{limits.max_deadline_ms} "
                                  "(milliseconds)", reason="INVALID_HEADER", metadata={"field": DEADLINE_HEADER})
    return int(raw) / 1000
