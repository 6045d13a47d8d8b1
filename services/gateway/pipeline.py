"""The request path through the mesh, in domain terms (no grpc here).

    validate input -> encode (chat template) -> generate (streamed) -> decode -> validate output

Every hop goes through the RetryExecutor, so each retry is decided by policy and logged. The
gateway fixes a seed when the client gave none: a retried generation is then idempotent.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import AsyncIterator, Callable, Protocol

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from keel.common.v1 import common_pb2
from services.gateway import tools
from services.gateway.contract import Ask, Limits, check_ask, check_prompt_bytes, fit
from services.gateway.deadlines import Pace
from services.gateway.rejects import Rejected
from services.gateway.retry import RetryExecutor
from services.gateway.stops import StopText
from services.gateway.streamtext import DecodeStream, StreamedText
from services.gateway.values import Answer, Call, Delta, Done, Encoded, Generated, Prepared, Served, Step
from shared import errors, toolformat, tracing
from shared.clip import clip_payload
from shared.controls import SEED_MAX
from shared.encoding import ids_fingerprint
from shared.failures import FailureKind

log = logging.getLogger("keel.gateway")


class Upstreams(Protocol):
    """What the pipeline needs from the other stages (services/gateway/upstreams.py over gRPC)."""

    async def validate_input(self, payload: dict, source: str, domain: str, timeout: float, md: dict,
                             rejected: errors.InvalidInput | None = None) -> list[str]: ...
    async def encode_chat(self, messages, max_length: int, timeout: float, md: dict,
                          add_generation_prompt: bool = True, tools=(), turn_tools=()) -> Encoded: ...
    async def encode_text(self, text: str, max_length: int, timeout: float, md: dict) -> Encoded: ...
    def generate(self, enc: Encoded, ask: Ask, seed: int, timeout: float, md: dict) -> AsyncIterator[Step | Done]: ...
    async def decode(self, ids: list[int], timeout: float, md: dict, skip_special_tokens: bool = True) -> str: ...
    async def decode_stream(self, timeout: float, md: dict) -> DecodeStream: ...
    async def validate_output(self, text: str, ask: Ask, entropies: list[float], timeout: float,
                              md: dict) -> tuple[str, common_pb2.ValidationResult]: ...
    async def report_failure(self, replica: str, kind: str, cause: str, md: dict) -> None: ...
    async def list_adapters(self, timeout: float, md: dict) -> list[str]: ...


def payload_of(ask: Ask, text: str | None = None) -> dict:
    """The request as the validator's input contract sees it: a raw text as its prompt, token ids as
    their decoded ``text`` (before they are decoded, e.g. refused by the gateway's limits: the ids)."""
    body: dict = {"max_tokens": ask.max_tokens, "temperature": ask.temperature, "top_p": ask.top_p,
                  "top_k": ask.top_k, "domain": ask.domain or "default", "source": ask.source or "default"}
    if ask.seed is not None:
        body["seed"] = ask.seed
    prompt = ask.raw_prompt if ask.raw_prompt is not None else ask.text if ask.text is not None else text
    if prompt is not None:
        body["prompt"] = prompt
    elif ask.token_ids:
        body["token_ids"] = list(ask.token_ids)
    else:
        body["messages"] = [{"role": r, "content": c} for r, c in ask.messages]
    return body


class Pipeline:
    def __init__(self, upstreams: Upstreams, executor: RetryExecutor, limits: Limits,
                 rng: random.Random | None = None, on_served: Callable[[Served], None] | None = None,
                 spill_rejected: Callable[[Rejected], None] | None = None, tool_format: str = toolformat.GENERIC):
        self.up, self.ex, self.limits = upstreams, executor, limits
        # How the model's chat template shows tool calls (shared/toolformat.py), from the model at start.
        self.tool_format = tool_format
        # Keeps a rejected input the validator could not take (services/gateway/rejects.py); the
        # stage always gives one, pipelines built without one (unit tests) log the loss instead.
        self._spill_rejected = spill_rejected
        self._rng = rng or random.SystemRandom()
        # Called once per answered request, after validation; must not block (it hands off to a queue).
        self._on_served = on_served
        self._tasks: set[asyncio.Task] = set()  # fire-and-forget reports, kept until done
        self.pace = Pace(limits)  # the default deadline follows how long answers take here

    def _background(self, coro) -> None:
        """Run ``coro`` beside the request; a failure is logged, never raised to the client."""
        async def guarded():
            try:
                await coro
            except errors.KeelError as err:
                log.warning("breaker report failed", extra={"reason": err.reason, "error": err.message})
        task = asyncio.get_running_loop().create_task(guarded())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def hop(self, upstream: str, method: str, fn, call: Call):
        """``fn(timeout, metadata)``, one call to ``upstream``: retried by policy, a client span per
        attempt, a deadline that ran out said plainly."""
        attempts = 0

        async def traced(timeout: float, md: dict):
            # One client span per attempt: the stage's server span becomes its child.
            nonlocal attempts
            attempts += 1
            with tracing.tracer().start_as_current_span(f"call {upstream}/{method}", kind=SpanKind.CLIENT) as span:
                span.set_attributes({"rpc.attempt": attempts, "upstream": upstream, "timeout_ms": round(timeout * 1e3)})
                try:
                    return await fn(timeout, md)
                except errors.KeelError as err:
                    span.set_attributes({"rpc.grpc.status": err.code, "error.reason": err.reason})
                    span.set_status(Status(StatusCode.ERROR, f"{err.code} {err.reason}"))
                    raise
        try:
            return await self.ex.call_with_retries(traced, method=method, upstream=upstream, idempotent=True,
                                                   deadline=call.deadline, trace_id=call.trace_id,
                                                   inbound_metadata=call.inbound)
        except errors.DeadlineExpired as err:
            raise plain_deadline(err, upstream, method) from err

    async def adapters(self, call: Call) -> list[str]:
        """The adapters a request may name ("id@version"), through the retry policy like any call."""
        return await self.hop("inference", "ListAdapters", self.up.list_adapters, call)

    async def prepare(self, ask: Ask, call: Call, streamed: bool = False) -> Prepared:
        sent = ask
        try:
            check_ask(ask, self.limits)
            if streamed and ask.controls.echo:  # the prompt's text would be a first delta no client expects
                raise errors.InvalidInput("echo is not served with a stream", reason="ECHO_UNSUPPORTED",
                                          metadata={"field": "sampling.echo"})
            tools.check(ask, self.limits, self.tool_format)
            # From here on the conversation is the one the model sees (services/gateway/tools.py);
            # the tools' description counts against max_prompt_bytes like any prompt text.
            ask = tools.render(ask, self.tool_format)
            shown = sum(len(f"{t.name}{t.description}{t.parameters}".encode("utf-8", "surrogatepass"))
                        for t in tools.shown(ask, self.tool_format))
            check_prompt_bytes(shown + sum(len(c.encode("utf-8", "surrogatepass")) for _, c in ask.messages),
                               self.limits)
        except errors.InvalidInput as rejected:
            await self._quarantine(ask, rejected, call)
            raise
        # On the gateway's server span, so that `keel trace` shows what was asked for beside what served.
        trace.get_current_span().set_attribute("adapter.requested", ask.adapter)
        seed = ask.seed if ask.seed is not None else self._rng.getrandbits(SEED_MAX.bit_length())
        text = ask.text if not ask.token_ids else await self._decoded_input(ask, call)
        # The tokenizer cuts the prompt only where the client asked (truncate_prompt_tokens); else
        # it is encoded up to the context, and one longer is counted whole (original_length).
        max_length = ask.truncate_prompt_tokens or self.limits.max_context_tokens
        # The input check and the encoding are independent: run them side by side (one hop less of
        # latency). Nothing reaches inference until both are done; a rejection cancels the encoding.
        try:
            async with asyncio.TaskGroup() as tg:
                checked = tg.create_task(self.hop("validator", "ValidateInput", lambda t, md: self.up.validate_input(
                    payload_of(ask, text), ask.source or "default", ask.domain or "default", t, md), call))
                encoded = tg.create_task(self._encode(ask, max_length, call))
        except BaseExceptionGroup as group:
            raise group.exceptions[0] from None  # the first failure, as a plain KeelError
        flags, enc = checked.result(), encoded.result()
        prompt_tokens = len(enc.ids) if ask.truncate_prompt_tokens else enc.original_length
        trace.get_current_span().set_attributes({"prompt.tokens": prompt_tokens, "prompt.truncated": enc.truncated,
                                                 "prompt.original_tokens": enc.original_length})
        log.info("encoded", extra={"prompt_tokens": prompt_tokens, "truncated": enc.truncated,
                                   "original_length": enc.original_length, "fingerprint": enc.fingerprint})
        echo = ""
        if ask.controls.echo:
            echo = text if not enc.truncated else await self.hop(
                "tokenizer", "Decode", lambda t, md: self.up.decode(enc.ids, t, md, skip_special_tokens=False), call)
        return Prepared(fit(ask, prompt_tokens, self.limits), enc, flags, seed, echo, sent)

    async def _decoded_input(self, ask: Ask, call: Call) -> str:
        """The text of a token-id input (what the validator's input contract and echo see); ids
        outside the vocabulary are the tokenizer's refusal (TOKEN_ID_OUT_OF_RANGE), quarantined as
        any refused input."""
        try:
            return await self.hop("tokenizer", "Decode", lambda t, md: self.up.decode(
                list(ask.token_ids), t, md, skip_special_tokens=False), call)
        except errors.InvalidInput as rejected:
            await self._quarantine(ask, rejected, call)
            raise

    async def _encode(self, ask: Ask, max_length: int, call: Call) -> Encoded:
        """The prompt's ids: a conversation through the chat template, a raw text as it is, token
        ids as sent (their last ``max_length`` when truncate_prompt_tokens cuts them)."""
        if ask.token_ids:
            ids = list(ask.token_ids[-max_length:])
            return Encoded(ids, len(ids) < len(ask.token_ids), len(ask.token_ids), ids_fingerprint(ids))
        if ask.text is not None:
            return await self.hop("tokenizer", "Encode", lambda t, md: self.up.encode_text(
                ask.text, max_length, t, md), call)
        return await self.hop("tokenizer", "Encode", lambda t, md: self.up.encode_chat(
            ask.messages, max_length, t, md, tools=tools.shown(ask, self.tool_format), turn_tools=ask.turn_tools),
            call)

    async def _quarantine(self, ask: Ask, rejected: errors.InvalidInput, call: Call) -> None:
        """Hand an input the gateway's own limits rejected to the validator's quarantine, clipped
        when larger than ``max_quarantine_payload_bytes`` (a message must stay far below the
        channel limit). The validator answers with the same rejection. If it cannot take it within
        the call's deadline, the input is spilled to disk (fsync'd) before the client gets the
        gateway's rejection, and sent again from there until the validator has it."""
        payload = clip_payload(payload_of(ask), self.limits.max_quarantine_payload_bytes)
        source, domain = ask.source or "default", ask.domain or "default"
        try:
            await self.hop("validator", "ValidateInput", lambda t, md: self.up.validate_input(
                payload, source, domain, t, md, rejected=rejected), call)
        except errors.InvalidInput as echoed:
            rejected.metadata.update({k: v for k, v in echoed.metadata.items() if k in ("rule", "quarantine_id")})
        except errors.KeelError as err:
            if self._spill_rejected is None:
                log.error("could not quarantine a rejected input", extra={"reason": rejected.reason, "error": str(err)})
                return
            try:
                self._spill_rejected(Rejected(payload, source, domain, rejected.reason, rejected.message,
                                              call.trace_id))
            except OSError as disk:  # the client still gets its rejection, never a 500
                log.error("could not quarantine nor spill a rejected input", extra={
                    "reason": rejected.reason, "error": str(err), "spill_error": str(disk)})
                return
            log.warning("rejected input spilled for the quarantine", extra={
                "reason": rejected.reason, "error": err.reason, "trace_id": call.trace_id})

    async def generate(self, ask: Ask, call: Call) -> Answer:
        prep = await self.prepare(ask, call)
        ask = prep.ask
        call = self.pace.fit(call, ask.max_tokens)
        started = time.monotonic()

        async def run_generation(timeout: float, md: dict) -> tuple[list[Step], Done]:
            steps: list[Step] = []
            done = None
            async for ev in self.up.generate(prep.enc, ask, prep.seed, timeout, md):
                if isinstance(ev, Step):
                    steps.append(ev)
                else:
                    done = ev
            if done is None:
                raise errors.NotReady("inference stream ended without a result", reason="STREAM_TRUNCATED")
            return steps, done

        try:
            steps, done = await self.hop("inference", "Generate", run_generation, call)
        except errors.InvalidInput as err:
            raise tools.engine_refusal(ask, err) from None
        self.pace.observe(time.monotonic() - started, done.completion_tokens)
        ids = [s.token_id for s in steps]
        raw = await self.hop("tokenizer", "Decode", lambda t, md: self.up.decode(ids, t, md), call)
        stops = StopText(ask.controls.stop)
        raw = stops.whole(raw)
        return await self.finish(ask, prep, done, Generated(raw, ids, [s.entropy for s in steps],
                                                            [s.logprobs for s in steps if s.logprobs], stops.cut), call)

    async def stream(self, ask: Ask, call: Call) -> AsyncIterator[Delta | Answer]:
        """Text deltas as they become decodable (text that may begin a stop string waits for what
        follows it), then the validated Answer.

        Retries cover opening the stream (until the first event); after tokens reached the
        client a failure ends the call with its status, since a retry would repeat text.
        Deltas are the raw model text; output validation runs on the whole answer at the end.
        A request with tools sends no deltas: its generated JSON is read whole, and the answer's text
        or calls come with the Answer.
        """
        if tools.active(ask):
            yield await self.generate(ask, call)
            return
        prep = await self.prepare(ask, call, streamed=True)
        ask = prep.ask
        call = self.pace.fit(call, ask.max_tokens)
        started = time.monotonic()

        async def open_stream(timeout: float, md: dict):
            events = self.up.generate(prep.enc, ask, prep.seed, timeout, md).__aiter__()
            return await events.__anext__(), events

        ev, events = await self.hop("inference", "Generate", open_stream, call)
        # Tokens arrive on their own task. One DecodeStream batch is in flight at a time and takes
        # every token that arrived while the previous one ran (a loaded tokenizer means fewer,
        # larger batches); each returns exactly the new text (services/gateway/streamtext.py).
        arrived: asyncio.Queue = asyncio.Queue()
        reader = asyncio.create_task(_pump(ev, events, arrived))
        streamed = StreamedText(self.up.decode_stream)
        stops = StopText(ask.controls.stop)
        entropies: list[float] = []
        logprobs: list[common_pb2.TokenLogprob] = []
        unsent = 0  # logprobs not yet sent with a delta
        done, failure = None, None
        try:
            while done is None and failure is None:
                items = [await arrived.get()]
                while not arrived.empty():
                    items.append(arrived.get_nowait())
                new: list[int] = []
                for item in items:
                    if isinstance(item, Exception):
                        failure = item  # text that arrived before it still goes out first
                        break
                    if isinstance(item, Step):
                        new.append(item.token_id)
                        entropies.append(item.entropy)
                        if item.logprobs is not None:
                            logprobs.append(item.logprobs)
                    else:
                        done = item if isinstance(item, Done) else False
                finish = isinstance(done, Done)
                text = ""
                if new or (finish and streamed.ids):
                    text = stops.feed(await self.hop("tokenizer", "DecodeStream", streamed.attempt(new, finish),
                                                       call))
                if finish:
                    text += stops.flush()
                if text or (finish and unsent < len(logprobs)):
                    yield Delta(text, tuple(logprobs[unsent:]))
                    unsent = len(logprobs)
        finally:
            reader.cancel()
            streamed.close()
        if failure is not None:
            raise failure
        if not isinstance(done, Done):
            raise errors.NotReady("inference stream ended without a result", reason="STREAM_TRUNCATED")
        self.pace.observe(time.monotonic() - started, done.completion_tokens)
        raw = StopText(ask.controls.stop).whole(streamed.text)
        yield await self.finish(ask, prep, done, Generated(raw, list(streamed.ids), entropies, logprobs, stops.cut),
                                call)

    async def finish(self, ask: Ask, prep: Prepared, done: Done, out: Generated, call: Call) -> Answer:
        reply = tools.parse(out.raw, self.tool_format) if tools.active(ask) else None
        seen, seen_as = tools.for_validation(ask, out.raw, reply)
        text, result = await self.hop("validator", "ValidateOutput", lambda t, md: self.up.validate_output(
            seen, seen_as, out.entropies, t, md), call)
        if not result.passed:
            first = next((v for v in result.verdicts if not v.passed and v.blocking), None)
            plugin, message = (first.plugin, first.message) if first else ("unknown", "")
            # The business-error breaker of the replica that generated it: enough blocked answers
            # in a window degrade it (docs/inference.md, Circuit breakers). Never delays the answer.
            self._background(self.up.report_failure(done.replica, FailureKind.OUTPUT_LIMIT, plugin, {}))
            raise errors.PreconditionFailed(f"answer blocked by output validation: {message}",
                                            reason="OUTPUT_BLOCKED",
                                            metadata={"plugin": plugin, "trace_id": call.trace_id})
        trace.get_current_span().set_attribute("adapter.served", done.adapter)
        if self._on_served is not None:
            self._on_served(Served(ask, prep.enc, done, out.ids, result, call.trace_id, prep.sent,
                                   reply.calls if reply is not None else ()))
        finish_reason = "stop" if out.stopped else done.finish_reason
        if reply is not None and reply.calls:
            text, finish_reason = "", tools.FINISH_REASON
        return Answer(text=prep.echo + text, finish_reason=finish_reason,
                      prompt_tokens=done.prompt_tokens,
                      completion_tokens=done.completion_tokens, seed=done.seed, prompt_truncated=prep.enc.truncated,
                      input_flags=prep.flags, validation=result, trace_id=call.trace_id,
                      system_fingerprint=done.system_fingerprint, adapter=done.adapter, logprobs=out.logprobs,
                      prompt_logprobs=done.prompt_logprobs,
                      tool_calls=reply.calls if reply is not None else ())


def plain_deadline(err: errors.DeadlineExpired, upstream: str, method: str) -> errors.DeadlineExpired:
    """The client's view of a deadline that ran out during a downstream call: which step was
    running, in plain words. The retry executor's own account stays in the log."""
    log.info("deadline exceeded", extra={"upstream": upstream, "method": method, "detail": err.message,
                                         "metadata": err.metadata})
    return errors.DeadlineExpired(
        f"deadline exceeded: the call's deadline ran out while the gateway waited for {upstream} ({method}); "
        "retry with a longer deadline", reason="DEADLINE_EXCEEDED", metadata={"upstream": upstream, "step": method})


async def _pump(first, events, out: asyncio.Queue) -> None:
    """Moves an inference stream into ``out``: its Steps, then its Done, None if it was cut short,
    or the exception that ended it (handed over, so the consumer raises it)."""
    try:
        ev = first
        while isinstance(ev, Step):
            out.put_nowait(ev)
            ev = await anext(events, None)
        out.put_nowait(ev)
    except Exception as exc:
        out.put_nowait(exc)
