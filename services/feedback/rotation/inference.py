"""The rotation executor's calls to the inference replicas (with the mesh token, as every stage)."""
from __future__ import annotations

import asyncio
import socket

import grpc

from keel.inference.v1 import inference_pb2, inference_pb2_grpc
from shared import client, errors


class InferenceFleet:
    """Every configured inference replica, one short-lived channel per call (rotation is rare)."""

    def __init__(self, targets: tuple[str, ...], timeout_s: float):
        self.targets = targets
        self.timeout_s = timeout_s

    async def replicas(self) -> list[str]:
        """Every replica behind the targets: a name (a headless Service) resolves to one address per pod."""
        out: list[str] = []
        for target in self.targets:
            host, _, port = target.rpartition(":")
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            except OSError as exc:
                raise errors.NotReady(f"cannot resolve inference target {target}: {exc}",
                                      reason="VARIANT_SWITCH_FAILED") from exc
            for info in infos:
                ip = info[4][0]
                addr = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
                if addr not in out:
                    out.append(addr)
        return out

    async def _call(self, target: str, method: str, request):
        async with client.channel(target) as ch:
            stub = inference_pb2_grpc.InferenceStub(ch)
            try:
                return await getattr(stub, method)(request, timeout=self.timeout_s, metadata=client.mesh_metadata())
            except grpc.aio.AioRpcError as err:
                raise client.translate(err) from None

    async def set_variant(self, target: str, variant: str, actor: str) -> inference_pb2.SetVariantResponse:
        return await self._call(target, "SetVariant", inference_pb2.SetVariantRequest(variant=variant, actor=actor))

    async def get_variant(self, target: str) -> inference_pb2.GetVariantResponse:
        return await self._call(target, "GetVariant", inference_pb2.GetVariantRequest())

    async def list_adapters(self, target: str) -> inference_pb2.ListAdaptersResponse:
        return await self._call(target, "ListAdapters", inference_pb2.ListAdaptersRequest())
