"""OpenAI's function calling <-> the gateway's tools (GenerateRequest.tools, tool_choice,
parallel_tool_calls; GenerateResponse.tool_calls; ChatMessage.tool_calls and tool_call_id).
What a tool may be, and which choice is valid, is the gateway's to check (services/gateway/tools.py):
its refusals (TOOL_INVALID, TOOL_CHOICE_INVALID, ...) come back naming the field."""
from __future__ import annotations

import json

from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2
from services.openai.schemas import ChatBody, Message, TokenizeBody


def set_tools(body: ChatBody | TokenizeBody, req: gateway_pb2.GenerateRequest | gateway_pb2.TokenizeRequest) -> None:
    """The body's tools, tool_choice and parallel_tool_calls onto ``req``."""
    for t in body.tools or ():
        f = t.function
        req.tools.add(name=f.name, description=f.description or "", strict=bool(f.strict),
                      parameters="" if f.parameters is None else json.dumps(f.parameters, ensure_ascii=False))
    choice = body.tool_choice
    if isinstance(choice, str):
        req.tool_choice.mode = choice
    elif choice is not None:
        req.tool_choice.function = choice.function.name
    if body.parallel_tool_calls is not None:
        req.parallel_tool_calls = body.parallel_tool_calls


def calls_of(m: Message) -> list[common_pb2.ToolCall]:
    """An assistant turn's calls, as the gateway carries them."""
    return [common_pb2.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
            for c in m.tool_calls or ()]


def _call(c: common_pb2.ToolCall) -> dict:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def assistant_message(r: gateway_pb2.GenerateResponse) -> dict:
    """A unary answer's message: its text, or its calls (content null, OpenAI's shape)."""
    if r.tool_calls:
        return {"role": "assistant", "content": None, "refusal": None, "tool_calls": [_call(c) for c in r.tool_calls]}
    return {"role": "assistant", "content": r.text, "refusal": None}


def whole_delta(done: gateway_pb2.GenerateResponse, streamed: bool) -> dict | None:
    """The delta that carries an answer the gateway sent whole with its summary (a request with tools:
    its calls, or its text when no text delta came before), or None."""
    if done.tool_calls:
        return {"tool_calls": [{"index": k, **_call(c)} for k, c in enumerate(done.tool_calls)]}
    if done.text and not streamed:
        return {"content": done.text}
    return None
