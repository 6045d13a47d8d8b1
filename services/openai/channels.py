"""Channels to the gateway replicas, opened on the serving event loop, and the two calls a
generation makes through them (unary and streamed), each sent again to the next replica when the
connection was lost before any answer (shared/client.py's Reconnect)."""
from __future__ import annotations

import grpc

from keel.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from shared import client


class Gateway:
    """Channels to the gateway replicas (round robin), opened on the serving event loop. A
    generation whose connection was lost before any answer (a gateway killed or restarting) is
    sent again, to the next replica, per ``reconnect`` (shared/client.py)."""

    def __init__(self, targets: tuple[str, ...], max_message_bytes: int,
                 reconnect: client.Reconnect = client.Reconnect()):
        self.targets, self.max_message_bytes, self.reconnect = targets, max_message_bytes, reconnect
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[gateway_pb2_grpc.GatewayStub] = []
        self._next = 0

    def open(self) -> None:
        self._channels = [client.channel(t, max_message_bytes=self.max_message_bytes) for t in self.targets]
        self._stubs = [gateway_pb2_grpc.GatewayStub(ch) for ch in self._channels]

    def stub(self) -> gateway_pb2_grpc.GatewayStub:
        return self._stubs[self._turn()]

    def _turn(self) -> int:
        self._next = (self._next + 1) % len(self._stubs)
        return self._next

    async def generate(self, req: gateway_pb2.GenerateRequest, md,
                       timeout: float | None) -> gateway_pb2.GenerateResponse:
        retries, i = client.Reconnecting(self.reconnect, timeout), self._turn()
        while True:
            try:
                return await self._stubs[i].Generate(req, metadata=md, timeout=retries.left_s())
            except grpc.aio.AioRpcError as exc:
                i = self._turn()
                await retries.wait_or_raise(exc, self._channels[i])

    async def open_stream(self, req: gateway_pb2.GenerateRequest, md, timeout: float | None):
        """(the GenerateStream call, its first message or EOF); sent again only until that message."""
        retries, i = client.Reconnecting(self.reconnect, timeout), self._turn()
        while True:
            call = self._stubs[i].GenerateStream(req, metadata=md, timeout=retries.left_s())
            try:
                return call, await call.read()
            except grpc.aio.AioRpcError as exc:
                i = self._turn()
                await retries.wait_or_raise(exc, self._channels[i])

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()
