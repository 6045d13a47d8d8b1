"""A fake inference replica for the rotation executor's unit tests: the variant RPCs and
ListAdapters only, with failures on demand, recording every call and its mesh token."""
from __future__ import annotations

import grpc

from keel.inference.v1 import inference_pb2, inference_pb2_grpc
from shared.meshauth import HEADER
from testing.ports import free_port

VARIANTS = {"primary": "float32", "fallback": "int8"}


class FakeInference(inference_pb2_grpc.InferenceServicer):
    def __init__(self, adapters: list[tuple[str, str]] | None = None):
        self.active = "primary"
        self.adapters = adapters      # None: ListAdapters is UNIMPLEMENTED (no adapter registry)
        self.fail_set_variant = 0     # the next N SetVariant calls answer UNAVAILABLE; -1: all of them
        self.calls: list[tuple[str, str, str]] = []   # (method, variant or "", mesh token)
        self.server: grpc.aio.Server | None = None
        self.target = ""

    def _seen(self, method: str, context, variant: str = "") -> None:
        self.calls.append((method, variant, dict(context.invocation_metadata()).get(HEADER, "")))

    async def SetVariant(self, request, context):
        self._seen("SetVariant", context, request.variant)
        if self.fail_set_variant != 0:
            if self.fail_set_variant > 0:
                self.fail_set_variant -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "replica down")
        if request.variant not in VARIANTS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "UNKNOWN_VARIANT")
        previous, self.active = self.active, request.variant
        return inference_pb2.SetVariantResponse(active=self.active, previous=previous)

    async def GetVariant(self, request, context):
        self._seen("GetVariant", context)
        return inference_pb2.GetVariantResponse(active=self.active, variants=VARIANTS)

    async def ListAdapters(self, request, context):
        self._seen("ListAdapters", context)
        if self.adapters is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no adapter registry")
        return inference_pb2.ListAdaptersResponse(adapters=[
            inference_pb2.AdapterState(id=a, version=v, state="accepted", slot=i + 1)
            for i, (a, v) in enumerate(self.adapters)] + [
            inference_pb2.AdapterState(id="refused-one", version="1", state="refused",
                                       reason="BASE_FINGERPRINT_MISMATCH")])

    def set_variant_calls(self) -> list[str]:
        return [v for m, v, _ in self.calls if m == "SetVariant"]

    async def start(self) -> "FakeInference":
        self.server = grpc.aio.server()
        inference_pb2_grpc.add_InferenceServicer_to_server(self, self.server)
        port = free_port()
        self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        self.target = f"127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        await self.server.stop(0)
