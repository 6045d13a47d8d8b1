"""uvicorn's HTTP/1.1 connection (httptools) with the edge's limits on what a client sends before
the app sees it (services/openai/limits.py):

- the request line and headers must arrive within ``header_timeout_s`` (of the connection opening,
  or of a kept-alive request's first byte), the body within ``body_timeout_s`` of the headers; a
  connection past either is closed, logged as one INFO line (a slowloris client holds nothing long);
- the request line and headers together are at most ``max_header_bytes``, at most ``max_headers``
  lines: more is answered 431 HEADER_TOO_LARGE in OpenAI's error shape, and the connection closed
  without reading further (httptools itself has no limit: a 1 MB header line would be buffered);
- bytes that are not HTTP/1.1 are answered 400 INVALID_HTTP_REQUEST, also in OpenAI's shape.
"""
from __future__ import annotations

import asyncio
import json
import logging

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from services.openai import httperrors
from services.openai.limits import EdgeLimits
from shared import errors

log = logging.getLogger("keel.openai")


# After a refusal the connection reads (and drops) what the client still sends for this long before
# closing, so that the client reads the answer rather than a reset (closing with unread bytes resets).
LINGER_S = 2.0
STATUS_LINES = {400: b"HTTP/1.1 400 Bad Request", 431: b"HTTP/1.1 431 Request Header Fields Too Large"}


def refusal(status_line: bytes, body: dict, headers: dict[str, str]) -> bytes:
    """A whole HTTP/1.1 response that closes the connection."""
    payload = json.dumps(body, separators=(",", ":")).encode()
    head = [status_line, b"content-type: application/json", b"content-length: %d" % len(payload),
            b"connection: close", *(f"{k}: {v}".encode() for k, v in headers.items())]
    return b"\r\n".join(head) + b"\r\n\r\n" + payload


class LimitedConnection(HttpToolsProtocol):
    """One client connection; ``limits`` is set on the subclass ``connection_class`` makes."""

    limits: EdgeLimits

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._in_headers = False   # between a request's first byte (or the connection) and its headers' end
        self._header_bytes = 0
        self._header_count = 0
        self._refused = False      # answered and closing: what arrives now is dropped unread

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._start_headers()

    def connection_lost(self, exc) -> None:
        self._cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_headers:
            self._header_bytes += len(data)
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._unsupported_upgrade_warning()  # no WebSocket here; the request is served as HTTP
        except httptools.HttpParserError as exc:  # also a callback's: too many headers
            if self._header_count > self.limits.max_headers:
                self._refuse(431, errors.InvalidInput(f"more than {self.limits.max_headers} header lines (the limit)",
                                                      reason="HEADER_TOO_LARGE"))
            else:
                self._refuse(400, errors.InvalidInput(f"the request is not valid HTTP/1.1: {exc}",
                                                      reason="INVALID_HTTP_REQUEST"))
            return
        # (the bytes counted may include the start of a body that arrived with the headers)
        if self._in_headers and self._header_bytes > self.limits.max_header_bytes:
            self._refuse(431, errors.InvalidInput(
                f"the request line and headers are over {self.limits.max_header_bytes} bytes (the limit)",
                reason="HEADER_TOO_LARGE"))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_headers:  # a kept-alive connection's next request
            self._start_headers()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_headers:
            raise ValueError("too many headers")  # httptools stops parsing: HttpParserCallbackError
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._arm(self.limits.body_timeout_s, "body")
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._cancel()
        super().on_message_complete()

    def _start_headers(self) -> None:
        self._in_headers, self._header_bytes, self._header_count = True, 0, 0
        self._arm(self.limits.header_timeout_s, "headers")

    def _arm(self, seconds: float, what: str) -> None:
        self._cancel()
        self._timer = self.loop.call_later(seconds, self._timed_out, what, seconds)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self, what: str, seconds: float) -> None:
        self._timer = None
        if not self.transport.is_closing():
            log.info("closing a connection that did not send its request's %s in time", what,
                     extra={"client": self.client[0] if self.client else "", "timeout_s": seconds})
            self.transport.close()

    def shutdown(self) -> None:
        """The stage drains (uvicorn calls this on every connection): an idle TLS connection is
        aborted rather than closed. Closing TLS waits for the client's close_notify, which a client
        holding the connection idle in its pool sends only when it next reads from it, so one such
        client held the whole drain to ``server.drain_grace_s``. Idle means its response was sent
        and nothing is left in the write buffer: the abort loses nothing."""
        idle = self.cycle is None or self.cycle.response_complete
        if (idle and self.transport.get_extra_info("ssl_object") is not None
                and not self.transport.get_write_buffer_size()):
            self.transport.abort()
        else:
            super().shutdown()

    def _refuse(self, status: int, err: errors.KeelError) -> None:
        """Answer ``err`` at once and close: the rest of what the client sends is not read."""
        self._cancel()
        log.info("refused a request before its headers were read", extra={"reason": err.reason, "detail": err.message})
        self.transport.write(refusal(STATUS_LINES[status], httperrors.error_body(err), httperrors.headers(err, "")))
        self._refused = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)


def connection_class(limits: EdgeLimits) -> type[LimitedConnection]:
    """The connection class uvicorn makes one of per client connection, with ``limits``."""
    return type("EdgeConnection", (LimitedConnection,), {"limits": limits})
