"""OpenAI's Responses API (``POST /v1/responses``) over the gateway: a body becomes one GenerateRequest
with ``chat`` (``request``); the gateway's answer becomes a Response object (``response``), its stream
Responses' typed server-sent events (``Events``).

Keel stores no responses: every request carries its whole conversation in ``input`` (what the SDKs
send with ``store: false``), and what would need a stored one (``previous_response_id``,
``store: true``, ``background: true``) is refused naming the field. The conversation's items map onto
chat turns: ``instructions`` is a system turn first, a message item is a turn, a ``function_call`` item
is a call of the assistant turn before it (or of a new one), a ``function_call_output`` a tool turn
answering it by ``call_id``."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2
from services.openai import convert, httperrors, responses_schemas
from services.openai.responses_schemas import FunctionCallItem, FunctionCallOutputItem, ResponsesBody
from services.openai.schemas import unsupported
from shared import errors
from shared.controls import Sampling, sampling_pb

# finish_reason "length": the answer was cut at max_output_tokens (OpenAI's "incomplete").
INCOMPLETE = {"length": {"reason": "max_output_tokens"}}
# The gateway's (and chat's) field names where the Responses API has its own: a refusal names the
# field as the client sent it.
FIELDS = {"max_tokens": "max_output_tokens", "messages": "input", "response_format.json_schema": "text.format.schema",
          "tool_choice.function": "tool_choice.name"}


def in_its_terms(err: errors.KeelError) -> errors.KeelError:
    """``err`` naming the Responses API's field where the gateway named its own."""
    return httperrors.in_terms(err, FIELDS)


def _refuse_stored(body: ResponsesBody) -> None:
    if body.previous_response_id is not None:
        raise unsupported("previous_response_id", "previous_response_id is not served: Keel stores no responses; "
                                                  "send the whole conversation as input items")
    if body.store:
        raise unsupported("store", "store: true is not served: Keel stores no responses to retrieve or continue")
    if body.background:
        raise unsupported("background", "background: true is not served: Keel stores no responses to poll")
    if body.truncation not in (None, "disabled"):
        raise unsupported("truncation", "truncation \"auto\" is not served: Keel never drops input items; a "
                                        "conversation beyond the context is refused")
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        raise unsupported("text.verbosity", "text.verbosity is not served (only \"medium\", the default)")
    convert.check_service_tier(body.service_tier)


def turns(body: ResponsesBody) -> list[common_pb2.ChatMessage]:
    out = [common_pb2.ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    if isinstance(body.input, str):
        return [*out, common_pb2.ChatMessage(role="user", content=body.input)]
    for item in responses_schemas.items(body.input):
        if isinstance(item, FunctionCallItem):
            if not out or out[-1].role != "assistant":
                out.append(common_pb2.ChatMessage(role="assistant"))
            out[-1].tool_calls.add(id=item.call_id, name=item.name, arguments=item.arguments)
        elif isinstance(item, FunctionCallOutputItem):
            out.append(common_pb2.ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
        else:
            out.append(common_pb2.ChatMessage(role=convert.ROLE_ALIASES.get(item.role, item.role), content=item.text))
    return out


def response_format(body: ResponsesBody) -> common_pb2.ResponseFormat | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    schema = {"type": "object"} if fmt.type == "json_object" else fmt.schema_
    return common_pb2.ResponseFormat(json_schema=json.dumps(schema, ensure_ascii=False))


def tool_choice(body: ResponsesBody) -> common_pb2.ToolChoice | None:
    choice = body.tool_choice
    if choice is None:
        return None
    if isinstance(choice, str):
        return common_pb2.ToolChoice(mode=choice)
    return common_pb2.ToolChoice(function=responses_schemas.function_choice(choice).name)


def request(body: ResponsesBody) -> gateway_pb2.GenerateRequest:
    _refuse_stored(body)
    sampling = sampling_pb(Sampling(
        convert._max_tokens(body.max_output_tokens, "max_output_tokens"),
        convert.temperature_of(body.temperature), convert.top_p_of(body.top_p)))
    req = gateway_pb2.GenerateRequest(chat=gateway_pb2.ChatMessages(messages=turns(body)), sampling=sampling,
                                      adapter=convert.adapter_of(body.model))
    for t in responses_schemas.function_tools(body.tools or []):
        req.tools.add(name=t.name, description=t.description or "", strict=bool(t.strict),
                      parameters="" if t.parameters is None else json.dumps(t.parameters, ensure_ascii=False))
    for field, value in (("response_format", response_format(body)), ("tool_choice", tool_choice(body))):
        if value is not None:
            getattr(req, field).CopyFrom(value)
    if body.parallel_tool_calls is not None:
        req.parallel_tool_calls = body.parallel_tool_calls
    # The Response echoes fields the gateway never sees (metadata, user, the format's name): a string
    # in them with no UTF-8 form (a lone surrogate escape) is refused now, as protobuf refuses one.
    json.dumps(Reply(body, "", 0).response("", "in_progress", []), ensure_ascii=False).encode()
    return req


@dataclass(frozen=True)
class Reply:
    """What a Response object repeats of its request, with its id (the trace id) and creation time."""

    body: ResponsesBody
    trace_id: str
    created_at: int

    @classmethod
    def start(cls, body: ResponsesBody, trace_id: str) -> "Reply":
        return cls(body, trace_id, int(time.time()))

    @property
    def id(self) -> str:
        return f"resp_{self.trace_id}"

    @property
    def message_id(self) -> str:
        return f"msg_{self.trace_id}"

    def call_id(self, i: int) -> str:
        return f"fc_{self.trace_id}_{i}"

    def response(self, model: str, status: str, output: list[dict], usage: dict | None = None,
                 incomplete: dict | None = None) -> dict:
        b = self.body
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": None, "incomplete_details": incomplete,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "max_tool_calls": b.max_tool_calls,
            "model": model, "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": None, "service_tier": "default", "store": False,
            "temperature": convert.temperature_of(b.temperature),
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"},
                     "verbosity": "medium"},
            "tool_choice": "auto" if b.tool_choice is None else b.tool_choice,
            "tools": [{"description": None, "parameters": None, "strict": None, **t.model_dump(exclude_none=True)}
                      for t in responses_schemas.function_tools(b.tools or [])],
            "top_p": convert.top_p_of(b.top_p), "truncation": "disabled", "usage": usage, "metadata": b.metadata or {},
            "user": b.user, "safety_identifier": b.safety_identifier, "prompt_cache_key": b.prompt_cache_key,
        }

    def message(self, text: str, status: str) -> dict:
        return {"type": "message", "id": self.message_id, "role": "assistant", "status": status,
                "content": [] if status == "in_progress" else [output_text(text)]}

    def function_call(self, i: int, call: common_pb2.ToolCall, status: str) -> dict:
        return {"type": "function_call", "id": self.call_id(i), "call_id": call.id, "name": call.name,
                "arguments": call.arguments if status == "completed" else "", "status": status}

    def finished(self, r: gateway_pb2.GenerateResponse, message: bool) -> dict:
        """The whole Response of the gateway's answer: with ``message``, its text as one message item;
        then each of its calls as a function_call item."""
        output = [self.message(r.text, message_status(r))] if message else []
        output += [self.function_call(i, c, "completed") for i, c in enumerate(r.tool_calls)]
        incomplete = INCOMPLETE.get(r.finish_reason)
        return self.response(convert.model_of(r.adapter), "incomplete" if incomplete else "completed", output,
                             usage(r.usage), incomplete)


def has_message(r: gateway_pb2.GenerateResponse) -> bool:
    """An answer is a message unless it is calls alone (an empty answer without calls is an empty message)."""
    return bool(r.text) or not r.tool_calls


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_status(r: gateway_pb2.GenerateResponse) -> str:
    return "incomplete" if r.finish_reason in INCOMPLETE else "completed"


def usage(u: common_pb2.Usage) -> dict:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def frame(event: dict) -> bytes:
    """One server-sent event as OpenAI sends it: ``event:`` names its type, ``data:`` is the object."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n" \
        .encode()


class Events:
    """The gateway's stream -> Responses' typed events, each with its sequence number: the response
    created and in progress; with the first text, a message item and its output_text part, then each
    delta; with the gateway's summary, the text and the message done (its text the processed answer,
    which equals the deltas unless an output processor rewrote it), each call as a function_call item
    (its arguments in one delta: the gateway sends calls whole), and the response completed (or
    incomplete, cut at max_output_tokens). After a failure: one ``error`` event."""

    def __init__(self, reply: Reply, model: str):
        self.reply, self.model = reply, model
        self._seq = 0
        self._started = self._opened = False

    def _event(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return ev

    def _text(self, kind: str, **fields) -> dict:
        return self._event(kind, item_id=self.reply.message_id, output_index=0, content_index=0, **fields)

    def _open(self) -> list[dict]:
        self._opened = True
        return [self._event("response.output_item.added", output_index=0, item=self.reply.message("", "in_progress")),
                self._text("response.content_part.added", part=output_text(""))]

    def shaped(self, ev: gateway_pb2.GenerateStreamResponse) -> list[dict]:
        out = []
        if not self._started:
            self._started = True
            start = self.reply.response(self.model, "in_progress", [])
            out += [self._event("response.created", response=start),
                    self._event("response.in_progress", response=start)]
        if ev.WhichOneof("event") == "delta":
            if ev.delta:
                out += ([] if self._opened else self._open())
                out.append(self._text("response.output_text.delta", delta=ev.delta, logprobs=[]))
            return out
        return out + self._done(ev.done)

    def _done(self, r: gateway_pb2.GenerateResponse) -> list[dict]:
        out, message = [], self._opened or has_message(r)
        if message:
            if not self._opened:
                out += self._open() + ([self._text("response.output_text.delta", delta=r.text, logprobs=[])]
                                       if r.text else [])
            out += [self._text("response.output_text.done", text=r.text, logprobs=[]),
                    self._text("response.content_part.done", part=output_text(r.text)),
                    self._event("response.output_item.done", output_index=0,
                                item=self.reply.message(r.text, message_status(r)))]
        for i, call in enumerate(r.tool_calls):
            item_id, at = self.reply.call_id(i), int(message) + i
            out += [self._event("response.output_item.added", output_index=at,
                                item=self.reply.function_call(i, call, "in_progress")),
                    self._event("response.function_call_arguments.delta", item_id=item_id, output_index=at,
                                delta=call.arguments),
                    self._event("response.function_call_arguments.done", item_id=item_id, output_index=at,
                                name=call.name, arguments=call.arguments),
                    self._event("response.output_item.done", output_index=at,
                                item=self.reply.function_call(i, call, "completed"))]
        final = self.reply.finished(r, message)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return out + [self._event(kind, response=final)]

    # The stream's framing (services/openai/app.py): one frame per event, nothing after the last.
    def event(self, ev: gateway_pb2.GenerateStreamResponse, i: int = 0) -> bytes:
        return b"".join(frame(e) for e in self.shaped(ev))

    def end(self) -> bytes:
        return b""

    def failed(self, err: errors.KeelError) -> bytes:
        error = httperrors.error_body(err)["error"]
        return frame(self._event("error", code=error["code"], message=error["message"], param=error["param"]))
