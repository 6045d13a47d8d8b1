"""The gateway's transport to the other stages: each stage's replicas (services/gateway/pool.py:
channels, health watching, picking) and proto <-> domain conversion. The pipeline sees only domain
types.

A replica that answers UNAVAILABLE or cannot be reached is marked down in its balancer; a
grpc.health.v1 Watch stream per replica marks it up again when it reports SERVING. With no replica
of a stage SERVING, a request is held (up to its deadline) until the watch reports one.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from keel.common.v1 import common_pb2
from keel.inference.v1 import inference_pb2
from keel.tokenizer.v1 import tokenizer_pb2
from keel.validator.v1 import validator_pb2
from services.gateway import resolve
from services.gateway.contract import Ask
from services.gateway.pool import Pool
from services.gateway.routing import Decision, Router
from services.gateway.values import Done, Encoded, Step
from shared import client, errors
from shared.controls import format_pb, sampling_pb
from shared.stages import GATEWAY_UPSTREAMS

log = logging.getLogger("keel.gateway.upstreams")
REPORT_TIMEOUT_S = 2.0  # a breaker report is best effort, off the request path
def _note_route(decision: Decision) -> None:
    # The routing decision on the attempt's client span: why this replica (docs/gateway.md, Routing).
    span = trace.get_current_span()
    span.set_attribute("keel.route.policy", decision.policy)
    span.set_attribute("keel.route.reason", decision.reason)
    span.set_attribute("keel.route.matched_blocks", decision.matched_blocks)


def _md(extra: dict) -> tuple:
    return client.mesh_metadata(extra.items())


class MeshUpstreams:
    """Implements pipeline.Upstreams over gRPC."""

    def __init__(self, targets: dict[str, tuple[str, ...]], max_message_bytes: int, channels_per_replica: int,
                 router: Router | None = None, resolve_every_s: float = 10.0):
        # The router only where it has a choice to make: one inference replica needs no index (a DNS
        # name may stand for several).
        several = len(set(targets["inference"])) > 1 or any(resolve.named(t) for t in targets["inference"])
        routers = {"inference": router} if router is not None and several else {}
        self.pools = {stage: Pool(stage, tuple(targets[stage]), max_message_bytes, channels_per_replica,
                                  routers.get(stage), resolve_every_s=resolve_every_s)
                      for stage in GATEWAY_UPSTREAMS}

    def start(self) -> None:
        for p in self.pools.values():
            p.start()

    async def close(self) -> None:
        for p in self.pools.values():
            await p.close()

    async def validate_input(self, payload: dict, source: str, domain: str, timeout: float, md: dict,
                             rejected: errors.InvalidInput | None = None) -> list[str]:
        req = validator_pb2.ValidateInputRequest(payload_json=json.dumps(payload, ensure_ascii=False),
                                                 source=source, domain=domain)
        if rejected is not None:
            req.rejected_reason, req.rejected_message = rejected.reason, rejected.message
        resp = await self.pools["validator"].call(
            timeout, lambda stub, t: stub.ValidateInput(req, timeout=t, metadata=_md(md)))
        return list(resp.flags)

    async def encode_chat(self, messages, max_length: int, timeout: float, md: dict,
                          add_generation_prompt: bool = True, tools=(), turn_tools=()) -> Encoded:
        """``messages`` through the chat template, with the ``tools`` it is to show and each turn's
        calls or call id (``turn_tools``: empty, or one TurnTools per message)."""
        chat = tokenizer_pb2.ChatInput(messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in messages],
                                       add_generation_prompt=add_generation_prompt,
                                       tools=[common_pb2.Tool(name=t.name, description=t.description,
                                                              parameters=t.parameters) for t in tools])
        for message, extra in zip(chat.messages, turn_tools):
            message.tool_call_id = extra.call_id
            message.tool_calls.extend(c.pb() for c in extra.calls)
        return await self._encode(tokenizer_pb2.EncodeRequest(chat=chat, max_length=max_length), timeout, md)

    async def encode_text(self, text: str, max_length: int, timeout: float, md: dict) -> Encoded:
        """``text`` as is, no chat template."""
        req = tokenizer_pb2.EncodeRequest(text=text.encode("utf-8", "surrogatepass"), max_length=max_length)
        return await self._encode(req, timeout, md)

    async def _encode(self, req: tokenizer_pb2.EncodeRequest, timeout: float, md: dict) -> Encoded:
        resp = await self.pools["tokenizer"].call(
            timeout, lambda stub, t: stub.Encode(req, timeout=t, metadata=_md(md)))
        return Encoded(list(resp.input_ids), resp.truncated, resp.original_length, resp.fingerprint,
                       resp.vocab_sha256, resp.chat_template_sha256)

    async def generate(self, enc: Encoded, ask: Ask, seed: int, timeout: float, md: dict) -> AsyncIterator[Step | Done]:
        req = inference_pb2.GenerateRequest(prompt_ids=enc.ids, sampling=sampling_pb(ask.sampling(seed)),
                                            input_fingerprint=enc.fingerprint, adapter=ask.adapter,
                                            response_format=format_pb(ask.controls.response_format))
        pool, router = self.pools["inference"], self.pools["inference"].router
        decision = None
        if router is None:
            target, timeout = await pool.pick_for(timeout)
        else:
            route = router.plan(enc.ids, ask.adapter, ask.max_tokens)
            target, timeout = await pool.pick_for(timeout, router.choose(route))
            decision = route.decision
            _note_route(decision)
            router.started(target, route)
        call = pool.stub(target).Generate(req, timeout=timeout, metadata=_md(md))
        try:
            async for ev in call:
                if ev.HasField("token"):
                    yield Step(ev.token.id, ev.token.entropy,
                               ev.token.logprobs if ev.token.HasField("logprobs") else None)
                else:
                    f = ev.finished
                    yield Done(f.finish_reason, f.usage.prompt_tokens, f.usage.completion_tokens, f.seed,
                               dict(f.engine), target, f.adapter, tuple(f.prompt_logprobs), decision)
        except grpc.aio.AioRpcError as exc:
            raise pool.failed(target, exc) from None
        finally:
            call.cancel()  # the consumer stopped early: free the row in the inference batch
            if router is not None:
                router.ended(target, route)
        pool.balancer.observe_success(target)

    async def report_failure(self, replica: str, kind: str, cause: str, md: dict) -> None:
        """One ReportFailure to ``replica`` (the one that generated the answer), if it is still known."""
        pool = self.pools["inference"]
        if replica not in pool.targets:
            return
        req = inference_pb2.ReportFailureRequest(kind=kind, cause=cause)
        try:
            await pool.stub(replica).ReportFailure(req, timeout=REPORT_TIMEOUT_S, metadata=_md(md))
        except grpc.aio.AioRpcError as exc:
            raise client.translate(exc) from None

    async def list_adapters(self, timeout: float, md: dict) -> list[str]:
        """The adapters one inference replica accepted, as sorted "id@version" names."""
        resp = await self.pools["inference"].call(
            timeout,
            lambda stub, t: stub.ListAdapters(inference_pb2.ListAdaptersRequest(), timeout=t, metadata=_md(md)))
        return sorted(f"{a.id}@{a.version}" for a in resp.adapters if a.state == "accepted")

    async def decode(self, ids: list[int], timeout: float, md: dict, skip_special_tokens: bool = True) -> str:
        req = tokenizer_pb2.DecodeRequest(ids=ids, skip_special_tokens=skip_special_tokens)
        resp = await self.pools["tokenizer"].call(
            timeout, lambda stub, t: stub.Decode(req, timeout=t, metadata=_md(md)))
        return resp.text

    async def decode_stream(self, timeout: float, md: dict) -> TokenizerDecodeStream:
        pool = self.pools["tokenizer"]
        target, timeout = await pool.pick_for(timeout)
        return TokenizerDecodeStream(pool, target, pool.stub(target).DecodeStream(timeout=timeout, metadata=_md(md)))

    async def validate_output(self, text: str, ask: Ask, entropies: list[float], timeout: float,
                              md: dict) -> tuple[str, common_pb2.ValidationResult]:
        continuation = ask.continues_text
        prompt = (ask.text or "") if continuation else next((c for r, c in reversed(ask.messages) if r == "user"), "")
        fmt = ask.controls.response_format
        req = validator_pb2.ValidateOutputRequest(text=text, domain=ask.domain or "default",
                                                  token_entropies=entropies, prompt=prompt, continuation=continuation,
                                                  json_schema=fmt.document if fmt and fmt.kind == "json_schema" else "")
        resp = await self.pools["validator"].call(
            timeout, lambda stub, t: stub.ValidateOutput(req, timeout=t, metadata=_md(md)))
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
