"""Tokenizer servicer: protobuf <-> domain conversion; the core does the tokenizing.

Big inputs are tokenized in a worker thread so one long request never stalls the event loop.
"""
from __future__ import annotations

import asyncio
import json

from opentelemetry import trace

from keel.common.v1 import common_pb2
from keel.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.core import EncodeOptions, Tokenizer
from shared import errors


def _json(text: str, empty):
    """JSON text as the value a template gets (text that is not JSON stays a string)."""
    try:
        return json.loads(text) if text else empty
    except (ValueError, RecursionError):
        return text


def _tool(t: common_pb2.Tool) -> dict:
    """A Tool as transformers hands it to a template."""
    return {"type": "function", "function": {"name": t.name, "description": t.description,
                                             "parameters": _json(t.parameters, {"type": "object"})}}


def _extra(m: common_pb2.ChatMessage) -> dict:
    """A message's calls (``tool_calls``, arguments as a dict) and call id, only the keys it has: a
    template tells a call turn by the key (Llama 3.1: ``'tool_calls' in message``)."""
    extra: dict = {}
    if m.tool_calls:
        extra["tool_calls"] = [{"type": "function", "id": c.id, "function": {"name": c.name,
                                                                             "arguments": _json(c.arguments, {})}}
                               for c in m.tool_calls]
    if m.tool_call_id:
        extra["tool_call_id"] = m.tool_call_id
    return extra


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, cfg: TokenizerConfig, metrics):
        self.tok: Tokenizer | None = None  # set by the stage's warm-up, before it reports SERVING
        self.cfg = cfg
        self._latency = metrics.histogram("keel_tokenizer_latency_seconds")
        self._truncations = metrics.counter("keel_tokenizer_truncations_total")

    def _options(self, req: tokenizer_pb2.EncodeRequest) -> EncodeOptions:
        if req.max_length < 0:
            raise errors.InvalidInput("max_length must be >= 0", reason="MAX_LENGTH_OUT_OF_RANGE")
        if req.pad_to_max_length and not req.max_length:
            raise errors.InvalidInput("pad_to_max_length needs max_length", reason="MAX_LENGTH_REQUIRED")
        c = self.cfg
        return EncodeOptions(max_length=min(req.max_length or c.max_length, c.max_length),
                             truncation_side=c.truncation_side, pad_to_max_length=req.pad_to_max_length,
                             padding_side=c.padding_side,
                             pad_token_id=self.tok.pad_token_id if c.pad_token_id is None else c.pad_token_id,
                             max_input_bytes=c.max_input_bytes)

    def _encode(self, req: tokenizer_pb2.EncodeRequest, options: EncodeOptions):
        which = req.WhichOneof("input")
        if which == "chat":
            chat = req.chat
            messages = [(m.role, m.content) for m in chat.messages]
            text: str | bytes = self.tok.render_chat(
                messages, add_generation_prompt=chat.add_generation_prompt,
                tools=[_tool(t) for t in chat.tools], extras=[_extra(m) for m in chat.messages])
        elif which == "text":
            text = req.text
        else:
            raise errors.InvalidInput("text or chat is required", reason="EMPTY_INPUT")
        return self.tok.encode(text, options)

    async def Encode(self, request, context):
        options = self._options(request)
        size = len(request.text) if request.WhichOneof("input") == "text" else request.ByteSize()
        with self._latency.labels(op="encode").time():
            if size > self.cfg.offload_bytes:
                enc = await asyncio.to_thread(self._encode, request, options)
            else:
                enc = self._encode(request, options)
        if enc.truncated:
            self._truncations.inc()
        span = trace.get_current_span()
        span.set_attributes({"input_len": size, "output_len": len(enc.input_ids), "truncated": enc.truncated,
                             "original_length": enc.original_length, "fingerprint": enc.fingerprint})
        return tokenizer_pb2.EncodeResponse(
            input_ids=enc.input_ids, attention_mask=enc.attention_mask, position_ids=enc.position_ids,
            truncated=enc.truncated, original_length=enc.original_length, fingerprint=enc.fingerprint,
            vocab_sha256=self.tok.vocab_sha256, chat_template_sha256=self.tok.chat_template_sha256,
            tool_format=self.tok.tool_format)

    async def Decode(self, request, context):
        with self._latency.labels(op="decode").time():
            text = self.tok.decode(list(request.ids), skip_special_tokens=request.skip_special_tokens)
        trace.get_current_span().set_attributes({"input_len": len(request.ids), "output_len": len(text)})
        return tokenizer_pb2.DecodeResponse(text=text)

    async def DecodeStream(self, request_iterator, context):
        """One StreamDecoder per call: each request's ids in, exactly the text they complete out."""
        stream, ids, chars, batches = None, 0, 0, 0
        try:
            async for request in request_iterator:
                if stream is None:
                    stream = self.tok.stream_decoder(skip_special_tokens=request.skip_special_tokens)
                with self._latency.labels(op="decode_stream").time():
                    text = stream.extend(request.ids)
                    if request.finish:
                        text += stream.finish()
                ids, chars, batches = ids + len(request.ids), chars + len(text), batches + 1
                yield tokenizer_pb2.DecodeStreamResponse(text=text)
                if request.finish:
                    return
        finally:
            trace.get_current_span().set_attributes({"input_len": ids, "output_len": chars, "batches": batches})
