"""Sync and asyncio clients of Keel's gateway.

Every call sends the API key (``x-api-key``) and a deadline (``timeout`` seconds). Two kinds of
failure are sent again, only while the deadline leaves room for the wait, and a stream only before
its first message:

- one the server marks retryable (UNAVAILABLE or RESOURCE_EXHAUSTED with a retry hint): after the
  hinted delay, at most ``max_retries`` times;
- a lost connection (UNAVAILABLE that no Keel server wrote: the gateway was unreachable, or
  restarting, or died mid-call): no answer reached the caller, so sending the call again is safe.
  After a jittered, doubling wait and once a gateway accepts connections again (``Reconnect``),
  at most ``Reconnect.attempts`` times; with several gateway addresses in the target the next
  attempt goes to one that is up.

Failures raise keel_client.errors classes.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

import grpc

from keel.gateway.v1 import gateway_pb2_grpc
from keel_client import errors, types


@dataclass(frozen=True)
class Reconnect:
    """Retries of a call whose connection was lost (``KeelError.connection_lost``). The n-th retry
    (n from 0) waits a uniform draw in [d/2, d], d = min(cap_s, base_s * 2**n) (the jitter keeps
    clients that lost one gateway together from all coming back at once), then until the channel
    has a connection again, at most ``ready_s`` (a gateway's restart under load takes seconds);
    none by then, the call fails. So each attempt is spent on a gateway that was up."""

    attempts: int = 6
    base_s: float = 0.1
    cap_s: float = 1.0
    ready_s: float = 10.0

    def delay_s(self, retry: int) -> float:
        d = min(self.cap_s, self.base_s * 2 ** retry)
        return random.uniform(d / 2, d)


# A restarted gateway is reachable again within about a second: reconnect on that scale instead of
# grpc's default backoff (1 s doubling to 120 s), so that a retry waiting for a connection
# (``Reconnect``) goes soon after the gateway is back. Round robin spreads calls over every address
# the target resolves to (e.g. "ipv4:10.0.0.1:50051,10.0.0.2:50051" or a DNS name with several) and
# skips the unreachable ones.
CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000), ("grpc.lb_policy_name", "round_robin"))


class _Retries:
    """One call's retries: which failure is sent again, after how long, within its deadline."""

    def __init__(self, timeout: float, max_retries: int, reconnect: Reconnect):
        self.deadline = time.monotonic() + timeout
        self.max_retries, self.reconnect = max_retries, reconnect
        self.hinted = self.lost = 0

    def left_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def ready_s(self) -> float:
        """How long to wait for a connection before sending a lost call again."""
        return min(self.reconnect.ready_s, self.left_s())

    def delay_s(self, err: errors.KeelError) -> float | None:
        """Seconds to wait before sending the call again, or None to give up with ``err``."""
        if err.connection_lost and self.lost < self.reconnect.attempts:
            delay = self.reconnect.delay_s(self.lost)
            self.lost += 1
        elif err.retryable and self.hinted < self.max_retries:
            delay = err.retry_after_ms / 1000
            self.hinted += 1
        else:
            return None
        return delay if delay < self.left_s() else None


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
                 reconnect: Reconnect = Reconnect(), credentials: grpc.ChannelCredentials | None = None):
        self._channel = (grpc.secure_channel(target, credentials, options=CHANNEL_OPTIONS) if credentials
                         else grpc.insecure_channel(target, options=CHANNEL_OPTIONS))
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._md = (("x-api-key", api_key),)
        self.timeout, self.max_retries, self.reconnect = timeout, max_retries, reconnect

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _wait(self, retries: _Retries, err: errors.KeelError) -> bool:
        """Waits before sending the call again (for a lost connection: until one is up); False: give up."""
        delay = retries.delay_s(err)
        if delay is None:
            return False
        time.sleep(delay)
        if not err.connection_lost:
            return True
        try:
            grpc.channel_ready_future(self._channel).result(timeout=retries.ready_s())
        except grpc.FutureTimeoutError:
            return False
        return True

    def generate(self, prompt: str | None = None, **kwargs) -> types.Answer:
        """The whole answer. Keyword arguments: see keel_client.types.request (and ``timeout``)."""
        retries = _Retries(kwargs.pop("timeout", self.timeout), self.max_retries, self.reconnect)
        req = types.request(prompt, **kwargs)
        while True:
            try:
                return types.answer(self._stub.Generate(req, metadata=self._md, timeout=retries.left_s()))
            except grpc.RpcError as exc:
                err = errors.from_rpc_error(exc)
                if not self._wait(retries, err):
                    raise err from None

    def stream(self, prompt: str | None = None, **kwargs) -> Stream:
        """A Stream of Delta pieces and the final Answer; retries apply until its first message."""
        retries = _Retries(kwargs.pop("timeout", self.timeout), self.max_retries, self.reconnect)
        req = types.request(prompt, **kwargs)
        while True:
            stream = Stream(self._stub.GenerateStream(req, metadata=self._md, timeout=retries.left_s()))
            try:
                stream._start()
                return stream
            except errors.KeelError as err:
                if not self._wait(retries, err):
                    raise


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
                 reconnect: Reconnect = Reconnect(), credentials: grpc.ChannelCredentials | None = None):
        self._channel = (grpc.aio.secure_channel(target, credentials, options=CHANNEL_OPTIONS) if credentials
                         else grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS))
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._md = (("x-api-key", api_key),)
        self.timeout, self.max_retries, self.reconnect = timeout, max_retries, reconnect

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _wait(self, retries: _Retries, err: errors.KeelError) -> bool:
        delay = retries.delay_s(err)
        if delay is None:
            return False
        await asyncio.sleep(delay)
        if not err.connection_lost:
            return True
        try:
            await asyncio.wait_for(self._channel.channel_ready(), retries.ready_s())
        except TimeoutError:
            return False
        return True

    async def generate(self, prompt: str | None = None, **kwargs) -> types.Answer:
        retries = _Retries(kwargs.pop("timeout", self.timeout), self.max_retries, self.reconnect)
        req = types.request(prompt, **kwargs)
        while True:
            try:
                return types.answer(await self._stub.Generate(req, metadata=self._md, timeout=retries.left_s()))
            except grpc.RpcError as exc:
                err = errors.from_rpc_error(exc)
                if not await self._wait(retries, err):
                    raise err from None

    async def stream(self, prompt: str | None = None, **kwargs) -> AsyncStream:
        """An AsyncStream; retries apply until its first message."""
        retries = _Retries(kwargs.pop("timeout", self.timeout), self.max_retries, self.reconnect)
        req = types.request(prompt, **kwargs)
        while True:
            stream = AsyncStream(self._stub.GenerateStream(req, metadata=self._md, timeout=retries.left_s()))
            try:
                await stream._start()
                return stream
            except errors.KeelError as err:
                if not await self._wait(retries, err):
                    raise
