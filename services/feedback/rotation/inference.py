"""The rotation executor's calls to the inference replicas (with the mesh token, as every stage)."""
from __future__ import annotations

import grpc

from keel.inference.v1 import inference_pb2, inference_pb2_grpc
from shared import client


class InferenceFleet:
    """Every configured inference replica, one short-lived channel per call (rotation is rare)."""

    def __init__(self, targets: tuple[str, ...], timeout_s: float):
        self.targets = targets
        self.timeout_s = timeout_s

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
