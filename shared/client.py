"""The client side of the mesh: channels, outgoing metadata, and the one error translation.

``translate`` is the only place that turns a grpc.aio.AioRpcError into a shared.errors.KeelError:
``.code`` keeps the gRPC status name, ``.reason``/``.metadata`` come from google.rpc.ErrorInfo, and
``.retry_after_ms`` is the server's valid retry hint (``grpc-retry-pushback-ms`` trailer first, then
google.rpc.RetryInfo). ``metadata["retry_hint"]`` says "absent", "valid" or "invalid" (negative or
unparseable: the caller must not retry); ``metadata["message_size"] == "1"`` marks size errors.
``Reconnecting`` sends a call to the gateway again when its connection was lost before any answer.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Iterable

import grpc
from google.rpc import error_details_pb2, status_pb2

from shared import errors, meshauth, tls, tracing
from shared.interceptor import TRACE_ID_KEY

_BY_CODE: dict[str, type[errors.KeelError]] = {
    "INVALID_ARGUMENT": errors.InvalidInput,
    "FAILED_PRECONDITION": errors.PreconditionFailed,
    "UNAUTHENTICATED": errors.Unauthenticated,
    "PERMISSION_DENIED": errors.PermissionDenied,
    "NOT_FOUND": errors.NotFound,
    "RESOURCE_EXHAUSTED": errors.Overloaded,
    "UNAVAILABLE": errors.NotReady,
    "DEADLINE_EXCEEDED": errors.DeadlineExpired,
    "CANCELLED": errors.Cancelled,
    "OUT_OF_RANGE": errors.NumericalInstability,
}


def channel(target: str, *, max_message_bytes: int = 4 * 1024 * 1024, connection: int = 0) -> grpc.aio.Channel:
    """A channel with grpcio's own retries off (Keel's gateway makes and logs every retry); mTLS
    with the mesh's client certificate when KEEL_MESH_TLS_DIR is set (shared/tls.py).

    Channels to one target with different ``connection`` numbers never share a connection (grpc
    would otherwise reuse one subchannel for equal arguments): several of them reach every worker
    process behind a port shared with SO_REUSEPORT."""
    options = [
        ("grpc.enable_retries", 0),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        # A restarted replica is back within seconds: reconnect fast instead of grpc's 1 s..120 s backoff.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.lb_policy_name", "round_robin"),
        ("grpc.use_local_subchannel_pool", 1),
        ("keel.connection", connection),
    ]
    creds = tls.channel_credentials()
    if creds is not None:
        return grpc.aio.secure_channel(target, creds, options=options)
    return grpc.aio.insecure_channel(target, options=options)


def mesh_metadata(extra: Iterable[tuple[str, str]] = ()) -> tuple[tuple[str, str], ...]:
    """Metadata for a call inside the mesh: credential, current trace context, extras."""
    return tuple(meshauth.outgoing() + tracing.inject() + list(extra))


def _retry_hint(trailers: dict[str, str], status: status_pb2.Status | None) -> tuple[str, int | None]:
    raw = trailers.get("grpc-retry-pushback-ms")
    if raw is not None:
        try:
            value = int(raw)
        except ValueError:
            return "invalid", None
        return ("valid", value) if value >= 0 else ("invalid", None)
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            ms = info.retry_delay.ToMilliseconds()
            return ("valid", ms) if ms >= 0 else ("invalid", None)
    return "absent", None


def translate(err: grpc.aio.AioRpcError) -> errors.KeelError:
    code = err.code().name
    trailers: dict[str, object] = dict(err.trailing_metadata() or ())
    status = None
    raw_status = trailers.get("grpc-status-details-bin")
    if isinstance(raw_status, bytes):
        status = status_pb2.Status()
        status.ParseFromString(raw_status)
    reason, meta = code, {}
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason, meta = info.reason, dict(info.metadata)
    str_trailers = {k: v for k, v in trailers.items() if isinstance(v, str)}
    hint_state, retry_after = _retry_hint(str_trailers, status)
    message = err.details() or code
    meta["retry_hint"] = hint_state
    if code == "RESOURCE_EXHAUSTED" and "message larger than max" in message:
        meta["message_size"] = "1"
        reason = "MESSAGE_TOO_LARGE"
    if TRACE_ID_KEY in str_trailers:
        meta.setdefault("trace_id", str_trailers[TRACE_ID_KEY])
    return error_from(code, message, reason=reason, metadata=meta, retry_after_ms=retry_after)


def error_from(code: str, message: str, *, reason: str, metadata: dict[str, str],
               retry_after_ms: int | None) -> errors.KeelError:
    """The KeelError for a status named by ``code`` (a grpc.StatusCode name): the class that
    carries it, keeping ``code`` itself (so e.g. UNKNOWN stays UNKNOWN, not INTERNAL)."""
    out = _BY_CODE.get(code, errors.Fatal)(message, reason=reason, metadata=metadata, retry_after_ms=retry_after_ms)
    out.code = code
    return out


def connection_lost(err: errors.KeelError) -> bool:
    """UNAVAILABLE that no Keel server wrote (Keel's errors carry an ErrorInfo reason): the
    connection failed or broke before an answer, so nothing of one reached the caller."""
    return err.code == "UNAVAILABLE" and err.reason == "UNAVAILABLE"


@dataclass(frozen=True)
class Reconnect:
    """How a caller of the gateway (the HTTP front) retries a call whose connection was lost: at
    most ``attempts`` times, the n-th retry (n from 0) after a uniform draw in [d/2, d],
    d = min(cap_s, base_s * 2**n) (the jitter keeps the callers that lost one gateway together
    from all coming back at once), then once the channel it goes to has a connection again, waited
    for at most ``ready_s`` (a gateway's restart under load takes seconds); none by then, the call
    fails. So each attempt is spent on a gateway that was up. (keel-client, a package of its own,
    has the same policy: clients/python/src/keel_client/client.py.)"""

    attempts: int = 6
    base_s: float = 0.1
    cap_s: float = 1.0
    ready_s: float = 10.0

    def delay_s(self, retry: int) -> float:
        d = min(self.cap_s, self.base_s * 2 ** retry)
        return random.uniform(d / 2, d)


class Reconnecting:
    """One call's retries of lost connections under ``policy``, within ``timeout`` seconds (None:
    no deadline, the attempts alone bound them). A unary call may be sent again until it answers,
    a stream only until its first message: only then has nothing reached the caller."""

    def __init__(self, policy: Reconnect, timeout: float | None):
        self.policy, self.retries = policy, 0
        self.deadline = None if timeout is None else time.monotonic() + timeout

    def left_s(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    async def wait_or_raise(self, exc: grpc.aio.AioRpcError, channel: grpc.aio.Channel) -> None:
        """Waits until the next attempt, on ``channel``, may go; raises ``exc`` when the call is not
        to be sent again."""
        if self.retries >= self.policy.attempts or not connection_lost(translate(exc)):
            raise exc
        delay = self.policy.delay_s(self.retries)
        left = self.left_s()
        if left is not None and delay >= left:
            raise exc
        self.retries += 1
        await asyncio.sleep(delay)
        left = self.left_s()
        try:
            await asyncio.wait_for(channel.channel_ready(), self.policy.ready_s if left is None
                                   else min(self.policy.ready_s, left))
        except TimeoutError:
            raise exc from None
