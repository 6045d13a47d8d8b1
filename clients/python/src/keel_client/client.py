"""Sync and asyncio clients of Keel's gateway.

Every call sends the API key (``x-api-key``) and a deadline (``timeout`` seconds). A failure the
server marks retryable (UNAVAILABLE or RESOURCE_EXHAUSTED with a retry hint) is retried after the
hinted delay, at most ``max_retries`` times and only while the deadline leaves room; a stream is
retried only before its first message. Failures raise keel_client.errors classes.
"""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Iterator

import grpc

from keel.gateway.v1 import gateway_pb2_grpc
from keel_client import errors, types


def _retry_delay(err: errors.KeelError, attempt: int, max_retries: int, deadline: float) -> float | None:
    """Seconds to wait before retrying, or None to give up."""
    if not err.retryable or attempt > max_retries:
        return None
    delay = err.retry_after_ms / 1000
    return delay if time.monotonic() + delay < deadline else None


def _trace_id(metadata) -> str:
    return dict(metadata or ()).get(errors.TRACE_ID_KEY, "")


class Stream:
    """Iterates Delta..., then the final Answer. ``trace_id`` comes from the initial metadata, so
    it is known before any text (and for a stream cancelled early)."""

    def __init__(self, call):
        self._call, self._first = call, None
        self.trace_id = _trace_id(call.initial_metadata())

    def _start(self) -> None:
        """Wait for the first message, so that a failure to start raises here (and is retried)."""
        try:
            self._first = next(self._call)
        except StopIteration:
            pass
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from None

    def __iter__(self) -> Iterator[types.Delta | types.Answer]:
        if self._first is not None:
            yield types.event(self._first)
        try:
            for msg in self._call:
                yield types.event(msg)
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from None

    def cancel(self) -> None:
        self._call.cancel()


class Client:
    """Blocking client: ``Client("host:50051", api_key=...)``; use as a context manager or close()."""

    def __init__(self, target: str, *, api_key: str, timeout: float = 60.0, max_retries: int = 2,
                 credentials: grpc.ChannelCredentials | None = None):
        self._channel = (grpc.secure_channel(target, credentials) if credentials
                         else grpc.insecure_channel(target))
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._md = (("x-api-key", api_key),)
        self.timeout, self.max_retries = timeout, max_retries

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(self, prompt: str | None = None, **kwargs) -> types.Answer:
        """The whole answer. Keyword arguments: see keel_client.types.request (and ``timeout``)."""
        timeout = kwargs.pop("timeout", self.timeout)
        req, deadline, attempt = types.request(prompt, **kwargs), time.monotonic() + timeout, 0
        while True:
            attempt += 1
            try:
                return types.answer(self._stub.Generate(req, metadata=self._md,
                                                        timeout=max(0.0, deadline - time.monotonic())))
            except grpc.RpcError as exc:
                err = errors.from_rpc_error(exc)
                delay = _retry_delay(err, attempt, self.max_retries, deadline)
                if delay is None:
                    raise err from None
                time.sleep(delay)

    def stream(self, prompt: str | None = None, **kwargs) -> Stream:
        """A Stream of Delta pieces and the final Answer; retries apply until its first message."""
        timeout = kwargs.pop("timeout", self.timeout)
        req, deadline, attempt = types.request(prompt, **kwargs), time.monotonic() + timeout, 0
        while True:
            attempt += 1
            stream = Stream(self._stub.GenerateStream(req, metadata=self._md,
                                                      timeout=max(0.0, deadline - time.monotonic())))
            try:
                stream._start()
                return stream
            except errors.KeelError as err:
                delay = _retry_delay(err, attempt, self.max_retries, deadline)
                if delay is None:
                    raise
                time.sleep(delay)


class AsyncStream:
    """The asyncio Stream: ``async for event in stream``; ``trace_id`` as for Stream."""

    def __init__(self, call):
        self._call, self._first, self.trace_id = call, None, ""

    async def _start(self) -> None:
        self.trace_id = _trace_id(await self._call.initial_metadata())
        try:
            self._first = await self._call.read()
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from None
        if self._first is grpc.aio.EOF:
            self._first = None

    async def __aiter__(self) -> AsyncIterator[types.Delta | types.Answer]:
        if self._first is not None:
            yield types.event(self._first)
        try:
            while (msg := await self._call.read()) is not grpc.aio.EOF:
                yield types.event(msg)
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from None

    def cancel(self) -> None:
        self._call.cancel()


class AsyncClient:
    """asyncio client with the same API: ``await generate(...)``, ``await stream(...)``.

    It mirrors Client line for line on purpose (kept, not shared): grpc's blocking and grpc.aio
    call objects differ in every call (await, read() vs iteration), so one body cannot serve both."""

    def __init__(self, target: str, *, api_key: str, timeout: float = 60.0, max_retries: int = 2,
                 credentials: grpc.ChannelCredentials | None = None):
        self._channel = (grpc.aio.secure_channel(target, credentials) if credentials
                         else grpc.aio.insecure_channel(target))
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._md = (("x-api-key", api_key),)
        self.timeout, self.max_retries = timeout, max_retries

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def generate(self, prompt: str | None = None, **kwargs) -> types.Answer:
        timeout = kwargs.pop("timeout", self.timeout)
        req, deadline, attempt = types.request(prompt, **kwargs), time.monotonic() + timeout, 0
        while True:
            attempt += 1
            try:
                return types.answer(await self._stub.Generate(req, metadata=self._md,
                                                              timeout=max(0.0, deadline - time.monotonic())))
            except grpc.RpcError as exc:
                err = errors.from_rpc_error(exc)
                delay = _retry_delay(err, attempt, self.max_retries, deadline)
                if delay is None:
                    raise err from None
                await asyncio.sleep(delay)

    async def stream(self, prompt: str | None = None, **kwargs) -> AsyncStream:
        """An AsyncStream; retries apply until its first message."""
        timeout = kwargs.pop("timeout", self.timeout)
        req, deadline, attempt = types.request(prompt, **kwargs), time.monotonic() + timeout, 0
        while True:
            attempt += 1
            stream = AsyncStream(self._stub.GenerateStream(req, metadata=self._md,
                                                           timeout=max(0.0, deadline - time.monotonic())))
            try:
                await stream._start()
                return stream
            except errors.KeelError as err:
                delay = _retry_delay(err, attempt, self.max_retries, deadline)
                if delay is None:
                    raise
                await asyncio.sleep(delay)
