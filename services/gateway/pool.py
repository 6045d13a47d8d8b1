"""The replicas of one stage, as the gateway sees them: a channel (or several) per replica, a
grpc.health.v1 Watch per replica, the balancer's rotation or the router's choice among the ones
SERVING, and a request held (up to its deadline) while none is. A ``dns:///`` target is re-resolved
into one replica per address (services/gateway/resolve.py); an inference replica's prefix-cache
events feed the router (services/gateway/cachewatch.py).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace

from keel.inference.v1 import inference_pb2_grpc
from keel.tokenizer.v1 import tokenizer_pb2_grpc
from keel.validator.v1 import validator_pb2_grpc
from services.gateway import cachewatch, resolve
from services.gateway.balancer import RoundRobinBalancer
from services.gateway.routing import Router
from shared import client, errors
from shared.stages import SERVICE_NAMES

log = logging.getLogger("keel.gateway.upstreams")
# The retry hint when a replica is gone: NO_HEALTHY_UPSTREAM once a request's deadline ran out
# waiting for one, CONNECTION_LOST when a call's process died (the supervisor restarts it).
UPSTREAM_DOWN_RETRY_MS = 1000
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
