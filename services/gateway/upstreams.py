"""The gateway's transport to the other stages: one channel per replica, health watching,
round-robin picking, and proto <-> domain conversion. The pipeline sees only domain types.

A replica that answers UNAVAILABLE or cannot be reached is marked down in its balancer; a
grpc.health.v1 Watch stream per replica marks it up again when it reports SERVING. With no replica
of a stage SERVING, a request is held (up to its deadline) until the watch reports one.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace

from keel.common.v1 import common_pb2
from keel.inference.v1 import inference_pb2, inference_pb2_grpc
from keel.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from keel.validator.v1 import validator_pb2, validator_pb2_grpc
from services.gateway import cachewatch, resolve
from services.gateway.balancer import RoundRobinBalancer
from services.gateway.contract import Ask
from services.gateway.routing import Decision, Router
from services.gateway.values import Done, Encoded, Step
from shared import client, errors
from shared.controls import format_pb, sampling_pb
from shared.stages import GATEWAY_UPSTREAMS, SERVICE_NAMES

log = logging.getLogger("keel.gateway.upstreams")
# The retry hint when a replica is gone: NO_HEALTHY_UPSTREAM once a request's deadline ran out
# waiting for one, CONNECTION_LOST when a call's process died (the supervisor restarts it).
UPSTREAM_DOWN_RETRY_MS = 1000
REPORT_TIMEOUT_S = 2.0  # a breaker report is best effort, off the request path
RETIRE_GRACE_S = 60.0  # a replica whose pod went: how long its calls in flight may still take
STUBS = {"tokenizer": tokenizer_pb2_grpc.TokenizerStub, "inference": inference_pb2_grpc.InferenceStub,
         "validator": validator_pb2_grpc.ValidatorStub}


def _note_endpoint(target: str) -> None:
    # The attempt's client span (pipeline._call) names the replica it went to, so a trace shows
    # which replica each attempt hit, e.g. that none went to a dead one.
    trace.get_current_span().set_attribute("server.address", target)


class Pool:
    """The replicas of one stage.

    Each replica gets ``channels_per_replica`` channels, each its own HTTP/2 connection, and calls
    rotate over them: the worker processes that share a replica's port (SO_REUSEPORT) each accept
    some of the connections, so every worker gets calls (one connection would pin them all to one).
    A target ``dns:///name:port`` stands for every address the name resolves to (services/gateway/
    resolve.py), re-resolved every ``resolve_every_s``: replicas come and go with the pods.
    """

    def __init__(self, stage: str, targets: tuple[str, ...], max_message_bytes: int, channels_per_replica: int = 1,
                 router: Router | None = None, resolver: resolve.Resolver = resolve.getaddrinfo,
                 resolve_every_s: float = 10.0):
        self.configured = targets
        # The replicas now: the targets given, DNS names replaced by what they resolve to (none yet).
        self.targets = tuple(t for t in targets if resolve.named(t) is None)
        self.stage, self.max_message_bytes = stage, max_message_bytes
        self.channels_per_replica = channels_per_replica
        self.resolver, self.resolve_every_s = resolver, resolve_every_s
        # Picks among the healthy replicas (inference, with more than one replica); None: round robin.
        self.router = router
        self.balancer = RoundRobinBalancer(stage, self.targets)
        self.channels: dict[str, list[grpc.aio.Channel]] = {}
        self.stubs: dict[str, list] = {}
        self._turn: dict[str, int] = {}
        self._watchers: dict[str, list[asyncio.Task]] = {}
        self._resolving: asyncio.Task | None = None
        self._retiring: set[asyncio.Task] = set()  # channels of replicas gone, closing once their calls end
        # Replicas whose health watch last said anything but SERVING, or ended.
        self._not_serving: set[str] = set(self.targets)
        # Set (and replaced) whenever a replica reports SERVING: requests held for a replica wait on it.
        self._came_up = asyncio.Event()

    def start(self) -> None:
        """Open channels and health watchers; must run inside the serving event loop."""
        for t in self.targets:
            self._open(t)
        if self.targets != self.configured:
            self._resolving = asyncio.create_task(self._follow_dns())

    async def _follow_dns(self) -> None:
        while True:
            try:
                await self.refresh()
            except OSError as exc:
                log.warning("could not resolve the replicas: keeping those known", extra={
                    "upstream": self.stage, "targets": ",".join(self.configured), "error": str(exc)})
            await asyncio.sleep(self.resolve_every_s)

    async def refresh(self) -> None:
        """Resolve the DNS-named targets again: open the replicas that came, close the ones gone."""
        now = await resolve.expand(self.configured, self.resolver)
        for t in now:
            if t not in self.channels:
                log.info("replica found", extra={"upstream": self.stage, "endpoint": t})
                self._open(t)
        for t in self.targets:
            if t not in now:
                log.info("replica gone", extra={"upstream": self.stage, "endpoint": t})
                self._retire(t)
        self.targets = now
        self.balancer.set_endpoints(now)

    def _retire(self, target: str) -> None:
        """Stop watching a replica that is no longer one; its calls in flight may finish (RETIRE_GRACE_S)."""
        for w in self._watchers.pop(target, []):
            w.cancel()
        for ch in self.channels.pop(target, []):
            task = asyncio.create_task(ch.close(grace=RETIRE_GRACE_S))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        del self.stubs[target], self._turn[target]
        self._not_serving.discard(target)
        if self.router is not None:
            self.router.forget(target)

    def _open(self, target: str) -> None:
        """Channels, stubs and watchers of one replica: its health, and its prefix cache when the router
        follows the replicas' WatchCache streams (services/gateway/cachewatch.py)."""
        self.channels[target] = [client.channel(target, max_message_bytes=self.max_message_bytes, connection=i)
                                 for i in range(self.channels_per_replica)]
        self.stubs[target] = [STUBS[self.stage](ch) for ch in self.channels[target]]
        self._turn[target] = 0
        self._not_serving.add(target)  # until its health watch says SERVING
        self._watchers[target] = [asyncio.create_task(self._watch(target))]
        if self.router is not None and self.router.follows_streams:
            self._watchers[target].append(asyncio.create_task(
                cachewatch.follow(self.router, target, self.stubs[target][0], lambda: self._serving(target))))

    async def _serving(self, target: str) -> None:
        """Returns once the replica's health watch has reported it SERVING."""
        while target in self._not_serving:
            await self._came_up.wait()

    def stub(self, target: str):
        """The next of ``target``'s channels, in rotation."""
        i = self._turn[target]
        self._turn[target] = (i + 1) % len(self.stubs[target])
        return self.stubs[target][i]

    def _note_health(self, target: str, serving: bool, how: str) -> None:
        """Record what a replica's health said; log each transition once; wake held requests."""
        if serving:
            self._not_serving.discard(target)
            if self.balancer.mark_up(target):
                log.info("replica up", extra={"upstream": self.stage, "endpoint": target, "via": how})
            self._came_up.set()
            self._came_up = asyncio.Event()
        else:
            self._not_serving.add(target)
            if self.router is not None:
                self.router.index.forget(target)  # restarting or gone: its prefix cache with it
            if self.balancer.mark_down(target):
                log.warning("replica not serving", extra={"upstream": self.stage, "endpoint": target, "via": how})

    async def _watch(self, target: str) -> None:
        stub = health_pb2_grpc.HealthStub(self.channels[target][0])
        while True:
            try:
                request = health_pb2.HealthCheckRequest(service=SERVICE_NAMES[self.stage])
                watch = stub.Watch(request, wait_for_ready=True)
                async for resp in watch:
                    self._note_health(target, resp.status == health_pb2.HealthCheckResponse.SERVING, "watch")
            except grpc.aio.AioRpcError:
                pass
            # The stream ended: the replica went away (or is draining). Down until it says SERVING.
            self._note_health(target, False, "watch_ended")
            await asyncio.sleep(0.1)

    def _pick_serving(self, choose: Callable[[Sequence[str]], str] | None) -> str:
        """balancer.pick(choose), passing over replicas whose health says they are not SERVING. The
        balancer re-admits a down replica after a while for one probe, meant for a replica that
        failed while its health said SERVING; probing one that is still restarting or loading its
        model only fails the attempt. Each replica passed over is marked down again, so once every
        replica is, pick() raises NotReady."""
        return self.balancer.pick(choose, skip=self._not_serving)

    async def pick(self, wait_s: float, choose: Callable[[Sequence[str]], str] | None = None) -> str:
        """Next healthy replica (or the one ``choose`` takes among the healthy ones). With none, hold
        the request up to ``wait_s`` (what its deadline leaves): it wakes when a health watch reports
        a replica SERVING, or when the balancer re-admits one for a probe; then NO_HEALTHY_UPSTREAM
        with a retry hint."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + wait_s
        while True:
            try:
                return self._pick_serving(choose)
            except errors.NotReady as none:
                left = give_up - loop.time()
                if left <= 0:
                    raise errors.NotReady(f"no {self.stage} replica became SERVING within the deadline",
                                          reason="NO_HEALTHY_UPSTREAM", metadata={"upstream": self.stage},
                                          retry_after_ms=UPSTREAM_DOWN_RETRY_MS) from None
                readmit_s = none.retry_after_ms / 1000 if none.retry_after_ms is not None else left
                try:
                    await asyncio.wait_for(self._came_up.wait(), min(left, max(readmit_s, 0.001)))
                except TimeoutError:
                    pass

    def failed(self, target: str, exc: grpc.aio.AioRpcError) -> errors.KeelError:
        """A failed call to ``target`` as a KeelError, noted by the balancer. UNAVAILABLE without
        a Keel status means no server answered (connection refused, reset or closed: the process
        is gone): reason CONNECTION_LOST, which the retry executor re-dispatches once for free."""
        err = client.translate(exc)
        if err.code == "UNAVAILABLE" and err.reason == "UNAVAILABLE":
            err.reason, err.retry_after_ms = errors.CONNECTION_LOST, UPSTREAM_DOWN_RETRY_MS
        self.balancer.observe_error(target, err)
        return err

    async def call(self, timeout: float, fn: Callable):
        """One unary attempt on the next healthy replica, ``fn(stub, timeout_left)``; errors
        translated, health noted. Time spent waiting for a replica comes off the timeout."""
        target, timeout = await self.pick_for(timeout)
        try:
            result = await fn(self.stub(target), timeout)
        except grpc.aio.AioRpcError as exc:
            raise self.failed(target, exc) from None
        self.balancer.observe_success(target)
        return result

    async def pick_for(self, timeout: float, choose: Callable[[Sequence[str]], str] | None = None
                       ) -> tuple[str, float]:
        """pick(), holding the call up to its whole ``timeout``; and what the timeout leaves."""
        started = asyncio.get_running_loop().time()
        target = await self.pick(timeout, choose)
        _note_endpoint(target)
        return target, timeout - (asyncio.get_running_loop().time() - started)

    async def close(self) -> None:
        if self._resolving is not None:
            self._resolving.cancel()
        for task in list(self._retiring):
            task.cancel()
        for ws in self._watchers.values():
            for w in ws:
                w.cancel()
        for chs in self.channels.values():
            for ch in chs:
                await ch.close()


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
            message.tool_calls.extend(common_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                                      for c in extra.calls)
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
