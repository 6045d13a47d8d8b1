"""The gateway's transport to the other stages: one channel per replica, health watching,
round-robin picking, and proto <-> domain conversion. The pipeline sees only domain types.

A replica that answers UNAVAILABLE or cannot be reached is marked down in its balancer; a
grpc.health.v1 Watch stream per replica marks it up again when it reports SERVING.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace

from keel.common.v1 import common_pb2
from keel.inference.v1 import inference_pb2, inference_pb2_grpc
from keel.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from keel.validator.v1 import validator_pb2, validator_pb2_grpc
from services.gateway.balancer import RoundRobinBalancer
from services.gateway.pipeline import Ask, Done, Encoded, Step
from shared import client, errors

log = logging.getLogger("keel.gateway.upstreams")
SERVICES = {"tokenizer": "keel.tokenizer.v1.Tokenizer", "inference": "keel.inference.v1.Inference",
            "validator": "keel.validator.v1.Validator"}
STUBS = {"tokenizer": tokenizer_pb2_grpc.TokenizerStub, "inference": inference_pb2_grpc.InferenceStub,
         "validator": validator_pb2_grpc.ValidatorStub}


def _note_endpoint(target: str) -> None:
    # The attempt's client span (pipeline._call) names the replica it went to, so a trace shows
    # which replica each attempt hit, e.g. that none went to a dead one.
    trace.get_current_span().set_attribute("server.address", target)


class Pool:
    """The replicas of one stage."""

    def __init__(self, stage: str, targets: tuple[str, ...], max_message_bytes: int):
        self.stage, self.targets, self.max_message_bytes = stage, targets, max_message_bytes
        self.balancer = RoundRobinBalancer(stage, targets)
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.stubs: dict = {}
        self._watchers: list[asyncio.Task] = []
        # Replicas whose health (watch stream or check) last said anything but SERVING, or did not answer.
        self._not_serving: set[str] = set(targets)

    def start(self) -> None:
        """Open channels and health watchers; must run inside the serving event loop."""
        self.channels = {t: client.channel(t, max_message_bytes=self.max_message_bytes) for t in self.targets}
        self.stubs = {t: STUBS[self.stage](ch) for t, ch in self.channels.items()}
        self._watchers = [asyncio.create_task(self._watch(t)) for t in self.channels]

    def _note_health(self, target: str, serving: bool, how: str) -> None:
        """Record what a replica's health said; log each transition once."""
        if serving:
            self._not_serving.discard(target)
            if self.balancer.mark_up(target):
                log.info("replica up", extra={"upstream": self.stage, "endpoint": target, "via": how})
        else:
            self._not_serving.add(target)
            if self.balancer.mark_down(target):
                log.warning("replica not serving", extra={"upstream": self.stage, "endpoint": target, "via": how})

    async def _watch(self, target: str) -> None:
        stub = health_pb2_grpc.HealthStub(self.channels[target])
        while True:
            try:
                watch = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICES[self.stage]), wait_for_ready=True)
                async for resp in watch:
                    self._note_health(target, resp.status == health_pb2.HealthCheckResponse.SERVING, "watch")
            except grpc.aio.AioRpcError:
                pass
            # The stream ended: the replica went away (or is draining). Down until it says SERVING.
            self._note_health(target, False, "watch_ended")
            await asyncio.sleep(0.1)

    async def any_serving(self) -> bool:
        """Check every replica once (marking each up or down); True if one is SERVING."""
        up = False
        for target, ch in self.channels.items():
            try:
                resp = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=SERVICES[self.stage]), timeout=1.0, wait_for_ready=True)
                serving = resp.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError:
                serving = False
            self._note_health(target, serving, "check")
            up = up or serving
        return up

    def _pick_serving(self) -> str:
        """balancer.pick(), passing over replicas whose health says they are not SERVING. The
        balancer re-admits a down replica after a while for one probe, meant for a replica that
        failed while its health said SERVING; probing one that is still restarting or loading its
        model only fails the attempt and spends a retry token. Each replica passed over is marked
        down again, so once every replica is, pick() raises NotReady."""
        while True:
            target = self.balancer.pick()
            if target not in self._not_serving:
                return target
            self.balancer.mark_down(target)

    async def pick(self, wait_s: float) -> str:
        """Next healthy replica. With none marked healthy, keep asking the replicas' health for up
        to ``wait_s`` (the watch streams lag a restart by up to a reconnect backoff, and a stage
        the supervisor restarts is back within seconds) before answering NO_HEALTHY_UPSTREAM."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + wait_s
        while True:
            try:
                return self._pick_serving()
            except errors.NotReady:
                if await self.any_serving():
                    continue
                if loop.time() >= give_up:
                    raise
                await asyncio.sleep(0.1)

    async def call(self, wait_s: float, timeout: float, fn: Callable):
        """One unary attempt on the next healthy replica, ``fn(stub, timeout_left)``; errors
        translated, health noted. Time spent waiting for a replica comes off the timeout."""
        target, timeout = await self.pick_for(wait_s, timeout)
        try:
            result = await fn(self.stubs[target], timeout)
        except grpc.aio.AioRpcError as exc:
            raise self.failed(target, exc) from None
        self.balancer.observe_success(target)
        return result

    def failed(self, target: str, exc: grpc.aio.AioRpcError) -> errors.KeelError:
        """The KeelError for a failed call on ``target``, noted by the balancer."""
        err = client.translate(exc)
        self.balancer.observe_error(target, err)
        return err

    async def pick_for(self, wait_s: float, timeout: float) -> tuple[str, float]:
        """pick(), and what ``timeout`` leaves after waiting for the replica."""
        started = asyncio.get_running_loop().time()
        target = await self.pick(wait_s)
        _note_endpoint(target)
        return target, timeout - (asyncio.get_running_loop().time() - started)

    async def close(self) -> None:
        for w in self._watchers:
            w.cancel()
        for ch in self.channels.values():
            await ch.close()


def _md(extra: dict) -> tuple:
    return client.mesh_metadata(extra.items())


class MeshUpstreams:
    """Implements pipeline.Upstreams over gRPC."""

    def __init__(self, targets: dict[str, tuple[str, ...]], max_message_bytes: int, wait_for_replica_s: float):
        self.pools = {stage: Pool(stage, tuple(targets[stage]), max_message_bytes) for stage in SERVICES}
        self.wait_s = wait_for_replica_s

    def _wait(self, timeout: float) -> float:
        return max(0.0, min(self.wait_s, timeout - 0.05))

    def start(self) -> None:
        for p in self.pools.values():
            p.start()

    async def close(self) -> None:
        for p in self.pools.values():
            await p.close()

    async def wait_any_healthy(self) -> None:
        """Block until every stage has a SERVING replica (the gateway's own readiness)."""
        while not all([await p.any_serving() for p in self.pools.values()]):
            await asyncio.sleep(0.5)

    async def validate_input(self, payload: dict, source: str, domain: str, timeout: float, md: dict,
                             rejected: errors.InvalidInput | None = None) -> list[str]:
        req = validator_pb2.ValidateInputRequest(payload_json=json.dumps(payload, ensure_ascii=False),
                                                 source=source, domain=domain)
        if rejected is not None:
            req.rejected_reason, req.rejected_message = rejected.reason, rejected.message
        resp = await self.pools["validator"].call(
            self._wait(timeout), timeout, lambda stub, t: stub.ValidateInput(req, timeout=t, metadata=_md(md)))
        return list(resp.flags)

    async def encode_chat(self, messages, max_length: int, timeout: float, md: dict) -> Encoded:
        chat = tokenizer_pb2.ChatInput(messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in messages],
                                       add_generation_prompt=True)
        req = tokenizer_pb2.EncodeRequest(chat=chat, max_length=max_length)
        resp = await self.pools["tokenizer"].call(
            self._wait(timeout), timeout, lambda stub, t: stub.Encode(req, timeout=t, metadata=_md(md)))
        return Encoded(list(resp.input_ids), resp.truncated, resp.original_length, resp.fingerprint)

    async def generate(self, enc: Encoded, ask: Ask, seed: int, timeout: float, md: dict) -> AsyncIterator[Step | Done]:
        sampling = common_pb2.SamplingParams(max_tokens=ask.max_tokens, temperature=ask.temperature,
                                             top_p=ask.top_p, top_k=ask.top_k, seed=seed)
        req = inference_pb2.GenerateRequest(prompt_ids=enc.ids, sampling=sampling, input_fingerprint=enc.fingerprint)
        pool = self.pools["inference"]
        target, timeout = await pool.pick_for(self._wait(timeout), timeout)
        call = pool.stubs[target].Generate(req, timeout=timeout, metadata=_md(md))
        try:
            async for ev in call:
                if ev.HasField("token"):
                    yield Step(ev.token.id, ev.token.entropy)
                else:
                    f = ev.finished
                    yield Done(f.finish_reason, f.usage.prompt_tokens, f.usage.completion_tokens, f.seed,
                               {"dtype": f.dtype})
        except grpc.aio.AioRpcError as exc:
            raise pool.failed(target, exc) from None
        finally:
            call.cancel()  # the consumer stopped early: free the row in the inference batch
        pool.balancer.observe_success(target)

    async def decode(self, ids: list[int], timeout: float, md: dict) -> str:
        req = tokenizer_pb2.DecodeRequest(ids=ids, skip_special_tokens=True)
        resp = await self.pools["tokenizer"].call(
            self._wait(timeout), timeout, lambda stub, t: stub.Decode(req, timeout=t, metadata=_md(md)))
        return resp.text

    async def decode_stream(self, timeout: float, md: dict) -> TokenizerDecodeStream:
        pool = self.pools["tokenizer"]
        target, timeout = await pool.pick_for(self._wait(timeout), timeout)
        return TokenizerDecodeStream(pool, target, pool.stubs[target].DecodeStream(timeout=timeout, metadata=_md(md)))

    async def validate_output(self, text: str, ask: Ask, entropies: list[float], timeout: float,
                              md: dict) -> tuple[str, common_pb2.ValidationResult]:
        prompt = next((c for r, c in reversed(ask.messages) if r == "user"), "")
        req = validator_pb2.ValidateOutputRequest(text=text, domain=ask.domain or "default",
                                                  token_entropies=entropies, prompt=prompt)
        resp = await self.pools["validator"].call(
            self._wait(timeout), timeout, lambda stub, t: stub.ValidateOutput(req, timeout=t, metadata=_md(md)))
        return resp.text, resp.result


class TokenizerDecodeStream:
    """One DecodeStream call on one tokenizer replica (services/gateway/streamtext.py uses it)."""

    def __init__(self, pool: Pool, target: str, call):
        self.pool, self.target, self.call = pool, target, call

    async def send(self, ids: list[int], finish: bool) -> str:
        request = tokenizer_pb2.DecodeStreamRequest(ids=ids, skip_special_tokens=True, finish=finish)
        try:
            await self.call.write(request)
        except asyncio.InvalidStateError:
            pass  # the call already ended: read() raises its status
        except grpc.aio.AioRpcError as exc:
            # Requests and responses alternate, so a stage's own error status arrives on a read.
            # A write fails when the connection went (grpcio then reports INTERNAL "Internal error
            # from Core", not the cause): the replica is unreachable, as for a refused connection.
            if exc.code() != grpc.StatusCode.INTERNAL:
                raise self.pool.failed(self.target, exc) from None
            err = errors.NotReady(f"the decode stream to {self.target} broke", reason="STREAM_TRUNCATED")
            self.pool.balancer.observe_error(self.target, err)
            raise err from None
        try:
            resp = await self.call.read()
        except grpc.aio.AioRpcError as exc:
            raise self.pool.failed(self.target, exc) from None
        if resp is grpc.aio.EOF:
            raise errors.NotReady("the tokenizer ended a decode stream early", reason="STREAM_TRUNCATED")
        if finish:
            await self.call.done_writing()
            self.pool.balancer.observe_success(self.target)
        return resp.text

    def close(self) -> None:
        self.call.cancel()
